// SentencePiece `.model` files through libsentencepiece (see colossal/data/sentencepiece.h).
#include "colossal/data/sentencepiece.h"

#include <filesystem>

#include "colossal/core/error.h"

#ifndef COLOSSAL_WITH_SENTENCEPIECE
namespace colossal::data {
// Built without libsentencepiece: every way in is a named error.
struct SentencePieceTokenizer::Impl {};
SentencePieceTokenizer SentencePieceTokenizer::from_file(const std::string& path) {
  throw InputError(str("SentencePiece model ", path,
                       ": this build has no SentencePiece support (install libsentencepiece-dev "
                       "and rebuild)"));
}
std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view, bool, bool) const {
  return {};
}
std::string SentencePieceTokenizer::decode(const std::vector<int32_t>&) const {
  return {};
}
int64_t SentencePieceTokenizer::vocab_size() const {
  return 0;
}
std::optional<int32_t> SentencePieceTokenizer::bos_id() const {
  return std::nullopt;
}
std::optional<int32_t> SentencePieceTokenizer::eos_id() const {
  return std::nullopt;
}
std::optional<int32_t> SentencePieceTokenizer::pad_id() const {
  return std::nullopt;
}
int32_t SentencePieceTokenizer::unk_id() const {
  return 0;
}
std::optional<int32_t> SentencePieceTokenizer::piece_to_id(std::string_view) const {
  return std::nullopt;
}
std::string SentencePieceTokenizer::id_to_piece(int32_t) const {
  return {};
}
}  // namespace colossal::data
#else

#include <sentencepiece_processor.h>

namespace colossal::data {

struct SentencePieceTokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

SentencePieceTokenizer SentencePieceTokenizer::from_file(const std::string& path) {
  std::error_code ec;
  COLOSSAL_CHECK_INPUT(std::filesystem::is_regular_file(path, ec), "SentencePiece model ", path,
                       " is not a readable file");
  auto impl = std::make_shared<Impl>();
  const auto status = impl->sp.Load(path);
  COLOSSAL_CHECK_INPUT(status.ok(), "SentencePiece model ", path,
                       " cannot be loaded (not a SentencePiece .model file?): ", status.ToString());
  SentencePieceTokenizer t;
  t.impl_ = std::move(impl);
  t.path_ = path;
  return t;
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text, bool add_bos,
                                                    bool add_eos) const {
  std::vector<int> ids;
  const auto status = impl_->sp.Encode(text, &ids);
  COLOSSAL_CHECK_INPUT(status.ok(), path_, ": cannot encode the text: ", status.ToString());
  std::vector<int32_t> out;
  out.reserve(ids.size() + 2);
  if (add_bos) {
    COLOSSAL_CHECK_INPUT(bos_id().has_value(), path_,
                         ": a BOS token was asked for but the model defines none");
    out.push_back(*bos_id());
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (add_eos) {
    COLOSSAL_CHECK_INPUT(eos_id().has_value(), path_,
                         ": an EOS token was asked for but the model defines none");
    out.push_back(*eos_id());
  }
  return out;
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids) const {
  const int64_t n = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    COLOSSAL_CHECK_INPUT(ids[i] >= 0 && ids[i] < n, path_, ": token id ", ids[i], " (position ", i,
                         ") is outside the vocabulary of ", n);
  }
  std::string text;
  const auto status = impl_->sp.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  COLOSSAL_CHECK_INPUT(status.ok(), path_, ": cannot decode: ", status.ToString());
  return text;
}

int64_t SentencePieceTokenizer::vocab_size() const {
  return impl_->sp.GetPieceSize();
}

namespace {
std::optional<int32_t> defined(int id) {
  return id >= 0 ? std::optional<int32_t>(id) : std::nullopt;
}
}  // namespace

std::optional<int32_t> SentencePieceTokenizer::bos_id() const {
  return defined(impl_->sp.bos_id());
}
std::optional<int32_t> SentencePieceTokenizer::eos_id() const {
  return defined(impl_->sp.eos_id());
}
std::optional<int32_t> SentencePieceTokenizer::pad_id() const {
  return defined(impl_->sp.pad_id());
}
int32_t SentencePieceTokenizer::unk_id() const {
  return impl_->sp.unk_id();
}

std::optional<int32_t> SentencePieceTokenizer::piece_to_id(std::string_view piece) const {
  // The library answers unk_id for pieces it does not know.
  const int id = impl_->sp.PieceToId(piece);
  if (id < 0 || impl_->sp.IdToPiece(id) != piece) return std::nullopt;
  return id;
}

std::string SentencePieceTokenizer::id_to_piece(int32_t id) const {
  COLOSSAL_CHECK_INPUT(id >= 0 && id < vocab_size(), path_, ": token id ", id,
                       " is outside the vocabulary of ", vocab_size());
  return impl_->sp.IdToPiece(id);
}

}  // namespace colossal::data
#endif  // COLOSSAL_WITH_SENTENCEPIECE
