// The safetensors reader (validated header, memory-mapped data) and the atomic writer.
#include "colossal/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "colossal/checkpoint/atomic.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"

namespace colossal::checkpoint {
namespace {

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
};

// RAII file descriptor.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void pread_all(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (size > 0) {
    size_t chunk = size < (uint64_t{1} << 30) ? static_cast<size_t>(size) : (size_t{1} << 30);
    ssize_t n = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw InputError(str(path, ": read failed at byte ", offset, ": ", std::strerror(errno)));
    }
    if (n == 0)
      throw InputError(str(path, ": file ended at byte ", offset, " (truncated while reading?)"));
    p += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

// Large destination buffers: ask for transparent huge pages (where THP is in "madvise" mode),
// so filling them takes one page fault per 2 MB instead of per 4 KB, the main cost of a copy
// from the page cache.
void advise_huge_pages(void* p, uint64_t size) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = 2u << 20;
  if (size < 4 * kHuge) return;
  uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(p) + size) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

bool valid_utf8(std::string_view s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (int k = 1; k < len; ++k) {
      unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
        (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

uint64_t as_u64(const json::Value& v, const std::string& what) {
  COLOSSAL_CHECK_INPUT(v.is_int(), what, " must be a non-negative integer, got ",
                       v.is_number() ? v.dump() : std::string(v.type_name()));
  int64_t i = v.as_int(what);
  COLOSSAL_CHECK_INPUT(i >= 0, what, " must be a non-negative integer, got ", i);
  return static_cast<uint64_t>(i);
}

}  // namespace

at::ScalarType dtype_from_safetensors(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  throw InputError(str("unsupported safetensors dtype \"", name,
                       "\" (supported: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL)"));
}

std::string dtype_to_safetensors(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (t == d.type) return d.name;
  }
  throw Error(
      str("dtype ", c10::toString(t),
          " cannot be stored in safetensors here (supported: float64 float32 float16 bfloat16 "
          "float8_e4m3fn float8_e5m2 int64 int32 int16 int8 uint8 bool); convert it first"));
}

// ---- reader ------------------------------------------------------------------------------------

namespace {
// The validated header of one file.
struct Header {
  std::string path;
  std::vector<TensorInfo> tensors;  // file order
  Metadata metadata;
  uint64_t data_start = 0;  // 8 + header length
  uint64_t file_size = 0;

  void parse(int fd);
};
}  // namespace

namespace {
// The live mappings, so release_mapped_pages() can tell a view of one from any other tensor.
std::mutex& mappings_mutex() {
  static std::mutex m;
  return m;
}
std::map<uintptr_t, uintptr_t>& mappings() {  // begin -> end
  static std::map<uintptr_t, uintptr_t> m;
  return m;
}

// Gives whole pages of [p, p + bytes), clipped to the mapping [lo, hi), back to the kernel.
void drop_pages(uintptr_t p, size_t bytes, uintptr_t lo, uintptr_t hi) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t a = std::max(lo, p & ~(page - 1));
  const uintptr_t b = std::min(hi, (p + bytes + page - 1) & ~(page - 1));
  if (b > a) ::madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
}
}  // namespace

struct SafetensorsReader::Impl : Header {
  std::unordered_map<std::string, size_t> index;
  void* map = nullptr;  // the whole file, MAP_PRIVATE (writes are copy-on-write, never reach disk)
  size_t map_size = 0;

  ~Impl() {
    if (map) {
      {
        std::lock_guard<std::mutex> lock(mappings_mutex());
        mappings().erase(reinterpret_cast<uintptr_t>(map));
      }
      ::munmap(map, map_size);
    }
  }
};

void Header::parse(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw InputError(str(path, ": cannot stat: ", std::strerror(errno)));
  COLOSSAL_CHECK_INPUT(S_ISREG(st.st_mode), path, " is not a regular file");
  file_size = static_cast<uint64_t>(st.st_size);
  COLOSSAL_CHECK_INPUT(file_size >= 8, path, ": not a safetensors file: ", file_size,
                       " bytes, shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  pread_all(fd, len_bytes, 8, 0, path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  COLOSSAL_CHECK_INPUT(n <= kMaxHeaderBytes, path, ": header length ", n,
                       " bytes exceeds the limit of ", kMaxHeaderBytes,
                       " (corrupt file, or not safetensors)");
  COLOSSAL_CHECK_INPUT(n <= file_size - 8, path, ": header length ", n,
                       " runs past the end of the file (", file_size,
                       " bytes); the file is truncated or corrupt");
  data_start = 8 + n;
  std::string header(static_cast<size_t>(n), '\0');
  if (n) pread_all(fd, header.data(), n, 8, path);
  COLOSSAL_CHECK_INPUT(valid_utf8(header), path, ": header is not valid UTF-8");
  json::Value root = json::parse(header, path + " header");
  COLOSSAL_CHECK_INPUT(root.is_object(), path, ": header must be a JSON object");

  for (const auto& [name, v] : root.as_object()) {
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      COLOSSAL_CHECK_INPUT(v.is_object(), path, ": __metadata__ must be an object of strings, got ",
                           v.type_name());
      for (const auto& [k, mv] : v.as_object()) {
        COLOSSAL_CHECK_INPUT(mv.is_string(), path, ": __metadata__ value of \"", k,
                             "\" must be a string, got ", mv.type_name());
        metadata[k] = mv.as_string();
      }
      continue;
    }
    const std::string what = str(path, ": tensor \"", name, "\"");
    COLOSSAL_CHECK_INPUT(v.is_object(), what, ": entry must be an object, got ", v.type_name());
    const json::Value* dt = v.find("dtype");
    const json::Value* sh = v.find("shape");
    const json::Value* off = v.find("data_offsets");
    COLOSSAL_CHECK_INPUT(dt && sh && off, what, ": entry needs dtype, shape and data_offsets");
    COLOSSAL_CHECK_INPUT(dt->is_string(), what, ": dtype must be a string, got ", dt->type_name());
    TensorInfo info;
    info.name = name;
    try {
      info.dtype = dtype_from_safetensors(dt->as_string());
    } catch (const InputError& e) {
      throw InputError(str(what, ": ", e.what()));
    }
    COLOSSAL_CHECK_INPUT(sh->is_array(), what, ": shape must be an array, got ", sh->type_name());
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : sh->as_array()) {
      uint64_t dim = as_u64(d, what + " shape entry");
      COLOSSAL_CHECK_INPUT(dim <= static_cast<uint64_t>(INT64_MAX), what, ": shape entry ", dim,
                           " too large");
      info.shape.push_back(static_cast<int64_t>(dim));
      if (dim != 0 && numel > UINT64_MAX / dim) overflow = true;
      numel *= dim;
    }
    COLOSSAL_CHECK_INPUT(off->is_array() && off->size() == 2, what,
                         ": data_offsets must be an array [begin, end], got ", off->dump());
    info.begin = as_u64(off->as_array()[0], what + " data_offsets[0]");
    info.end = as_u64(off->as_array()[1], what + " data_offsets[1]");
    COLOSSAL_CHECK_INPUT(info.begin <= info.end, what, ": data_offsets [", info.begin, ", ",
                         info.end, "] end before they begin");
    uint64_t item = c10::elementSize(info.dtype);
    uint64_t nbytes = 0;
    if (overflow || numel > UINT64_MAX / item) {
      throw InputError(str(what, ": shape ", sh->dump(), " has too many elements"));
    }
    nbytes = numel * item;
    COLOSSAL_CHECK_INPUT(info.end - info.begin == nbytes, what, ": data_offsets [", info.begin,
                         ", ", info.end, "] hold ", info.end - info.begin, " bytes but shape ",
                         sh->dump(), " of ", dt->as_string(), " needs ", nbytes);
    tensors.push_back(std::move(info));
  }

  // File order; the data section must be covered exactly, without gaps or overlaps.
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) { return a.begin < b.begin; });
  uint64_t pos = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : tensors) {
    if (t.begin != pos) {
      if (t.begin < pos) {
        throw InputError(str(path, ": tensor \"", t.name, "\" (bytes ", t.begin, "..", t.end,
                             ") overlaps tensor \"", prev->name, "\" (bytes ", prev->begin, "..",
                             prev->end, ")"));
      }
      throw InputError(str(path, ": gap in the data section before tensor \"", t.name,
                           "\": it begins at byte ", t.begin, " but the previous tensor ends at ",
                           pos));
    }
    pos = t.end;
    prev = &t;
  }
  uint64_t data_size = file_size - data_start;
  COLOSSAL_CHECK_INPUT(pos == data_size, path, ": tensors cover ", pos,
                       " bytes of the data section but it holds ", data_size,
                       pos < data_size ? " (trailing bytes)" : " (file truncated)");
}

SafetensorsReader::SafetensorsReader(const std::string& path) : impl_(std::make_shared<Impl>()) {
  impl_->path = path;
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw InputError(str("cannot open ", path, ": ", std::strerror(errno)));
  impl_->parse(f.fd);
  for (size_t i = 0; i < impl_->tensors.size(); ++i)
    impl_->index.emplace(impl_->tensors[i].name, i);
  if (impl_->file_size > impl_->data_start) {
    impl_->map_size = static_cast<size_t>(impl_->file_size);
    void* m = ::mmap(nullptr, impl_->map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, f.fd, 0);
    if (m == MAP_FAILED) throw Error(str("cannot mmap ", path, ": ", std::strerror(errno)));
    impl_->map = m;
    std::lock_guard<std::mutex> lock(mappings_mutex());
    mappings()[reinterpret_cast<uintptr_t>(m)] = reinterpret_cast<uintptr_t>(m) + impl_->map_size;
  }
}

SafetensorsReader::~SafetensorsReader() = default;

const std::string& SafetensorsReader::path() const {
  return impl_->path;
}
const std::vector<TensorInfo>& SafetensorsReader::tensors() const {
  return impl_->tensors;
}
const Metadata& SafetensorsReader::metadata() const {
  return impl_->metadata;
}

const TensorInfo* SafetensorsReader::find(const std::string& name) const {
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

at::Tensor SafetensorsReader::get(const std::string& name) const {
  const TensorInfo* info = find(name);
  COLOSSAL_CHECK_INPUT(info, impl_->path, ": no tensor named \"", name, "\"");
  auto options = at::TensorOptions().dtype(info->dtype).device(at::kCPU);
  if (info->end == info->begin) return at::empty(info->shape, options);
  char* ptr = static_cast<char*>(impl_->map) + impl_->data_start + info->begin;
  size_t item = c10::elementSize(info->dtype);
  if (reinterpret_cast<uintptr_t>(ptr) % item != 0) {
    // A writer that did not keep tensors aligned: ATen kernels expect natural alignment, so copy.
    at::Tensor t = at::empty(info->shape, options);
    std::memcpy(t.data_ptr(), ptr, info->end - info->begin);
    return t;
  }
  std::shared_ptr<Impl> keep = impl_;
  return at::from_blob(
      ptr, info->shape, [keep](void*) mutable { keep.reset(); }, options);
}

void SafetensorsReader::read_slice(const std::string& name, int64_t begin,
                                   const at::Tensor& out) const {
  const TensorInfo* info = find(name);
  COLOSSAL_CHECK_INPUT(info, impl_->path, ": no tensor named \"", name, "\"");
  const size_t item = c10::elementSize(info->dtype);
  const int64_t numel = static_cast<int64_t>((info->end - info->begin) / item);
  const int64_t n = out.numel();
  COLOSSAL_CHECK(begin >= 0 && begin + n <= numel, impl_->path, ": ", name, ": elements [", begin,
                 ", ", begin + n, ") requested of ", numel);
  if (n == 0) return;
  char* ptr = static_cast<char*>(impl_->map) + impl_->data_start + info->begin +
              static_cast<uint64_t>(begin) * item;
  const size_t bytes = static_cast<size_t>(n) * item;
  auto options = at::TensorOptions().dtype(info->dtype).device(at::kCPU);
  if (reinterpret_cast<uintptr_t>(ptr) % item != 0) {
    at::Tensor t = at::empty({n}, options);
    std::memcpy(t.data_ptr(), ptr, bytes);
    out.copy_(t.view(out.sizes()));
  } else {
    out.copy_(at::from_blob(ptr, out.sizes(), options));
  }
  // A page shared with a neighbouring tensor is read again from the file when next touched.
  const uintptr_t base = reinterpret_cast<uintptr_t>(impl_->map);
  drop_pages(reinterpret_cast<uintptr_t>(ptr), bytes, base, base + impl_->map_size);
}

bool release_mapped_pages(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.numel() == 0 || !t.is_contiguous()) return false;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  std::lock_guard<std::mutex> lock(mappings_mutex());
  auto it = mappings().upper_bound(p);
  if (it == mappings().begin()) return false;
  --it;
  if (p + bytes > it->second) return false;
  drop_pages(p, bytes, it->first, it->second);
  return true;
}

TensorList load_safetensors(const std::string& path, Metadata* metadata) {
  SafetensorsReader r(path);
  TensorList out;
  out.reserve(r.tensors().size());
  for (const auto& t : r.tensors()) out.emplace_back(t.name, r.get(t.name));
  if (metadata) *metadata = r.metadata();
  return out;
}

TensorList load_safetensors_copy(const std::string& path, Metadata* metadata) {
  auto impl = std::make_shared<Header>();
  impl->path = path;
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw InputError(str("cannot open ", path, ": ", std::strerror(errno)));
  impl->parse(f.fd);
  TensorList out;
  out.reserve(impl->tensors.size());
  // Work items of at most 32 MB so a few large tensors still spread over the threads.
  struct Piece {
    char* dst;
    uint64_t size, offset;
  };
  std::vector<Piece> pieces;
  constexpr uint64_t kPiece = 32ull << 20;
  for (const auto& t : impl->tensors) {
    at::Tensor x = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
    char* dst = static_cast<char*>(x.data_ptr());
    advise_huge_pages(dst, t.end - t.begin);
    for (uint64_t o = t.begin; o < t.end; o += kPiece) {
      pieces.push_back({dst + (o - t.begin), std::min(kPiece, t.end - o), impl->data_start + o});
    }
    out.emplace_back(t.name, std::move(x));
  }
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  size_t nthreads = std::min<size_t>({pieces.size(), hw, 8});
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&] {
    try {
      for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
        pread_all(f.fd, pieces[i].dst, pieces[i].size, pieces[i].offset, path);
      }
    } catch (...) {
      std::lock_guard<std::mutex> g(error_mu);
      if (!error) error = std::current_exception();
      next = pieces.size();
    }
  };
  if (nthreads <= 1) {
    work();
  } else {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < nthreads; ++i) threads.emplace_back(work);
    for (auto& t : threads) t.join();
  }
  if (error) std::rethrow_exception(error);
  if (metadata) *metadata = impl->metadata;
  return out;
}

// ---- writer ------------------------------------------------------------------------------------

uint64_t TensorDecl::nbytes() const {
  uint64_t n = c10::elementSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<size_t> safetensors_file_order(const std::vector<TensorDecl>& tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return c10::elementSize(tensors[a].dtype) > c10::elementSize(tensors[b].dtype);
  });
  return order;
}

struct SafetensorsStreamWriter::Impl {
  std::string path;
  std::vector<TensorDecl> tensors;
  std::vector<size_t> order;
  size_t pos = 0;  // position in `order` of the next tensor
  std::unique_ptr<AtomicFile> file;
};

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::string& path,
                                                 std::vector<TensorDecl> tensors,
                                                 const Metadata& metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->tensors = std::move(tensors);
  const auto& decls = impl_->tensors;
  // Validate everything before touching the disk.
  std::set<std::string> names;
  std::vector<std::string> dtype_names(decls.size());
  for (size_t i = 0; i < decls.size(); ++i) {
    const std::string& name = decls[i].name;
    COLOSSAL_CHECK_INPUT(name != "__metadata__", path, ": a tensor may not be named __metadata__");
    COLOSSAL_CHECK_INPUT(names.insert(name).second, path, ": tensor name \"", name,
                         "\" appears twice");
    try {
      dtype_names[i] = dtype_to_safetensors(decls[i].dtype);
    } catch (const Error& e) {
      throw Error(str(path, ": tensor \"", name, "\": ", e.what()));
    }
    for (int64_t d : decls[i].shape)
      COLOSSAL_CHECK_INPUT(d >= 0, path, ": tensor \"", name, "\" has a negative dimension ", d);
  }
  impl_->order = safetensors_file_order(decls);

  json::Value header = json::Value::object();
  if (!metadata.empty()) {
    json::Value md = json::Value::object();
    for (const auto& [k, v] : metadata) md.set(k, v);
    header.set("__metadata__", std::move(md));
  }
  uint64_t pos = 0;
  for (size_t i : impl_->order) {
    const TensorDecl& t = decls[i];
    json::Value shape = json::Value::array();
    for (int64_t d : t.shape) shape.push_back(d);
    uint64_t nbytes = t.nbytes();
    json::Value offsets = json::Value::array();
    offsets.push_back(pos);
    offsets.push_back(pos + nbytes);
    pos += nbytes;
    json::Value entry = json::Value::object();
    entry.set("dtype", dtype_names[i]);
    entry.set("shape", std::move(shape));
    entry.set("data_offsets", std::move(offsets));
    header.set(t.name, std::move(entry));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  COLOSSAL_CHECK_INPUT(text.size() <= kMaxHeaderBytes, path, ": header would be ", text.size(),
                       " bytes, over the format's limit of ", kMaxHeaderBytes,
                       "; save fewer tensors per file");

  impl_->file = std::make_unique<AtomicFile>(path);
  unsigned char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  impl_->file->write(len, 8);
  impl_->file->write(text.data(), text.size());
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;

const std::vector<size_t>& SafetensorsStreamWriter::order() const {
  return impl_->order;
}

bool SafetensorsStreamWriter::done() const {
  return impl_->pos == impl_->order.size();
}

size_t SafetensorsStreamWriter::next_index() const {
  COLOSSAL_CHECK(!done(), impl_->path, ": every tensor has been written");
  return impl_->order[impl_->pos];
}

const TensorDecl& SafetensorsStreamWriter::next() const {
  return impl_->tensors[next_index()];
}

void SafetensorsStreamWriter::write_next(const at::Tensor& t) {
  const TensorDecl& d = next();
  COLOSSAL_CHECK(t.defined(), impl_->path, ": tensor \"", d.name, "\" is undefined");
  COLOSSAL_CHECK(t.scalar_type() == d.dtype && t.sizes().vec() == d.shape, impl_->path,
                 ": tensor \"", d.name, "\" was declared ", c10::toString(d.dtype), " ",
                 at::IntArrayRef(d.shape), " but is ", c10::toString(t.scalar_type()), " ",
                 t.sizes());
  impl_->file->write_tensor(t);
  ++impl_->pos;
}

void SafetensorsStreamWriter::finish() {
  COLOSSAL_CHECK(done(), impl_->path, ": finish() before tensor \"", next().name, "\" was written");
  impl_->file->commit();
}

void save_safetensors(const std::string& path, const TensorList& tensors,
                      const Metadata& metadata) {
  std::vector<TensorDecl> decls;
  decls.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    COLOSSAL_CHECK_INPUT(t.defined(), path, ": tensor \"", name, "\" is undefined");
    decls.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  SafetensorsStreamWriter w(path, std::move(decls), metadata);
  while (!w.done()) w.write_next(tensors[w.next_index()].second);
  w.finish();
}

}  // namespace colossal::checkpoint
