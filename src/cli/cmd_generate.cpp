// `colossal generate`: continuation of a prompt by a Hugging Face model folder (llama, mistral,
// qwen2) with a KV cache: greedy by default, or sampled (temperature, top-k, top-p, seed), with
// an optional repetition penalty, as HF's generate(). --prompt TEXT goes through the folder's
// tokenizer and the new text is printed as it is generated; --prompt-ids prints the new ids
// space-separated on one stdout line, each as soon as it is chosen.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/data/text_tokenizer.h"
#include "colossal/models/llama/config.h"
#include "colossal/models/llama/model.h"

namespace {

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    COLOSSAL_CHECK_INPUT(!tok.empty() && used == tok.size() && v >= 0, "--prompt-ids: '", tok,
                         "' is not a non-negative integer (expected e.g. 1,2,3)");
    ids.push_back(v);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

int run_generate(int argc, char** argv) {
  colossal::cli::Args args("generate", "text generation from a Hugging Face model folder");
  args.option("model", "model folder (config.json + *.safetensors)", "", true)
      .option("prompt",
              "prompt text, encoded by the model folder's tokenizer (or --tokenizer);"
              " the new text is printed as it is generated")
      .option("prompt-ids", "comma-separated prompt token ids, e.g. 1,2,3 (instead of --prompt)")
      .option("tokenizer", "tokenizer.json, .model or folder for --prompt (default: --model)")
      .option("max-new-tokens", "number of tokens to generate", "32")
      .option("dtype", "fp32 | bf16", "fp32")
      .option("device", "cpu | cuda", "cpu")
      .flag("stop-at-eos", "stop once the config's eos_token_id is generated")
      .flag("do-sample", "sample the next token (default: greedy, the most likely one)")
      .option("temperature", "divide the logits by this before sampling (> 0)", "1.0")
      .option("top-k", "sample among the k most likely tokens only (0: all)", "0")
      .option("top-p", "sample among the most likely tokens holding this probability (0, 1]", "1.0")
      .option("repetition-penalty",
              "penalise tokens already in the prompt or output (> 0, 1: off; greedy too)", "1.0")
      .option("seed", "seed of the sampling generator (same seed, same tokens)", "0");
  args.parse(argc, argv);
  colossal::models::GenerateOptions go;
  go.do_sample = args.on("do-sample");
  for (const char* name : {"temperature", "top-k", "top-p", "seed"}) {
    COLOSSAL_CHECK_INPUT(go.do_sample || !args.given(name), "--", name,
                         " only applies when sampling: add --do-sample (greedy decoding "
                         "ignores it)");
  }
  go.temperature = args.f64("temperature");
  go.top_k = args.i64("top-k");
  go.top_p = args.f64("top-p");
  go.repetition_penalty = args.f64("repetition-penalty");
  const int64_t seed = args.i64("seed");
  COLOSSAL_CHECK_INPUT(seed >= 0, "--seed must be >= 0, got ", seed);
  go.seed = static_cast<uint64_t>(seed);
  try {
    go.validate();
  } catch (const colossal::InputError& e) {
    // Name the flags, not the struct's fields.
    std::string msg = e.what();
    for (auto [field, flag] : {std::pair{"max_new_tokens", "--max-new-tokens"},
                               {"repetition_penalty", "--repetition-penalty"},
                               {"temperature", "--temperature"},
                               {"top_k", "--top-k"},
                               {"top_p", "--top-p"}}) {
      auto at = msg.find(field);
      if (at != std::string::npos) msg.replace(at, std::strlen(field), flag);
    }
    throw colossal::InputError(msg);
  }
  const std::string dtype = args.str("dtype"), device = args.str("device");
  COLOSSAL_CHECK_INPUT(dtype == "fp32" || dtype == "bf16", "--dtype must be fp32 or bf16, got '",
                       dtype, "'");
  COLOSSAL_CHECK_INPUT(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '",
                       device, "'");
  if (device == "cuda") {
    COLOSSAL_CHECK_INPUT(at::hasCUDA(),
                         "--device cuda: no CUDA device is available (use --device cpu)");
  }
  const int64_t max_new = args.i64("max-new-tokens");
  COLOSSAL_CHECK_INPUT(max_new >= 0, "--max-new-tokens must be >= 0, got ", max_new);
  COLOSSAL_CHECK_INPUT(args.given("prompt") != args.given("prompt-ids"),
                       "give the prompt as --prompt TEXT or as --prompt-ids 1,2,3 (one of them)");
  COLOSSAL_CHECK_INPUT(!args.given("tokenizer") || args.given("prompt"),
                       "--tokenizer is for --prompt (text); --prompt-ids needs none");
  std::optional<colossal::data::TextTokenizer> tok;
  std::vector<int64_t> ids;
  if (args.given("prompt")) {
    tok = colossal::data::load_tokenizer(args.given("tokenizer") ? args.str("tokenizer")
                                                                 : args.str("model"));
    for (int32_t id : tok->encode(args.str("prompt"), /*add_special=*/true)) ids.push_back(id);
    COLOSSAL_CHECK_INPUT(!ids.empty(), "--prompt: the tokenizer ", tok->path,
                         " turns this prompt into no tokens; give some text");
  } else {
    ids = parse_ids(args.str("prompt-ids"));
  }

  // Positions past max_position_embeddings are outside what the model was trained for: refuse
  // (there is no option to stop at the limit instead) before the weights are read. Dynamic NTK
  // rope scaling exists to go past it (its frequencies stretch with the length, as in HF), so
  // there it is allowed.
  const std::filesystem::path cfg_path = std::filesystem::path(args.str("model")) / "config.json";
  if (std::filesystem::is_regular_file(cfg_path)) {
    const auto mc = colossal::models::ModelConfig::from_file(cfg_path.string());
    const int64_t room = mc.max_position_embeddings - static_cast<int64_t>(ids.size());
    COLOSSAL_CHECK_INPUT(max_new <= room || mc.rope.type == "dynamic", "the prompt (", ids.size(),
                         " tokens) + --max-new-tokens (", max_new,
                         ") positions exceed the model's max_position_embeddings (",
                         mc.max_position_embeddings, ", ", cfg_path.string(),
                         "); use a shorter prompt or fewer new tokens");
  }

  colossal::checkpoint::PretrainedOptions po;
  po.device = at::Device(device == "cuda" ? at::kCUDA : at::kCPU);
  po.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  auto model = colossal::checkpoint::load_pretrained(args.str("model"), po);
  const auto& cfg = model->config();
  for (int64_t id : ids) {
    COLOSSAL_CHECK_INPUT(
        id < cfg.vocab_size, "prompt token ", id, " is outside the model's vocabulary of ",
        cfg.vocab_size,
        tok ? colossal::str(" (is ", tok->path, " this model's tokenizer?)") : std::string());
  }
  std::optional<int64_t> eos;
  if (args.on("stop-at-eos")) {
    if (cfg.eos_token_id.is_int()) {
      eos = cfg.eos_token_id.as_int();
    } else if (cfg.eos_token_id.is_array() && cfg.eos_token_id.size() > 0) {
      eos = cfg.eos_token_id.as_array().front().as_int("eos_token_id[0]");
    } else {
      throw colossal::InputError("--stop-at-eos: the model's config.json has no eos_token_id");
    }
  }
  model->eval();
  at::Tensor prompt =
      at::tensor(ids, at::TensorOptions().dtype(at::kLong)).unsqueeze(0).to(*po.device);
  go.max_new_tokens = max_new;
  go.eos_token_id = eos;
  int64_t printed = 0;
  // Text: decode everything generated so far and print what is new up to the first U+FFFD: a
  // byte-level model may emit part of a UTF-8 character, which decodes as U+FFFD until (and
  // unless) its other bytes follow, so text from there on may still change; the rest is final.
  std::vector<int32_t> generated;
  std::string shown;
  auto show_text = [&](bool final) {
    std::string text = tok->decode(generated, /*skip_special=*/true);
    if (!final) text = text.substr(0, text.find("\xEF\xBF\xBD"));
    if (text.compare(0, shown.size(), shown) != 0) {
      colossal::log_warn("the tokenizer's decoding of the new tokens changed text already printed");
      return;
    }
    std::fwrite(text.data() + shown.size(), 1, text.size() - shown.size(), stdout);
    std::fflush(stdout);
    shown = std::move(text);
  };
  go.on_token = [&](const at::Tensor& next) {
    const int64_t id = next[0].item<int64_t>();
    if (tok) {
      generated.push_back(static_cast<int32_t>(id));
      show_text(false);
      return;
    }
    std::printf(printed++ ? " %lld" : "%lld", static_cast<long long>(id));
    std::fflush(stdout);
  };
  auto t0 = std::chrono::steady_clock::now();
  at::Tensor out = colossal::models::generate(*model, prompt, go);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tok) show_text(true);
  std::printf("\n");
  std::fflush(stdout);
  colossal::log_info("generated ", out.size(1), " tokens in ", secs, " s (",
                     out.size(1) / std::max(secs, 1e-9), " tokens/s)");
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("generate", "text generation from a Hugging Face model folder", run_generate);
