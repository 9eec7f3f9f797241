// The safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {..}},
// then the raw bytes. The header is untrusted input: every violation is a colossal::InputError
// naming the file and the tensor, never a crash.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace colossal::checkpoint {

// Named tensors in a stable order (file order on load, caller's order on save).
using TensorList = std::vector<std::pair<std::string, at::Tensor>>;
using Metadata = std::map<std::string, std::string>;

// "F32" <-> at::kFloat etc. for F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U8 BOOL.
at::ScalarType dtype_from_safetensors(const std::string& name);  // InputError if unknown
std::string dtype_to_safetensors(at::ScalarType t);              // Error if unsupported

struct TensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data section
};

// A validated, memory-mapped safetensors file. Tensors returned by get() are CPU tensors that
// view the read-only mapping (they keep it alive); clone() before writing into one.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const;
  const std::vector<TensorInfo>& tensors() const;  // file order
  const TensorInfo* find(const std::string& name) const;
  at::Tensor get(const std::string& name) const;  // InputError naming the tensor if absent
  // Copies elements [begin, begin + out.numel()) of tensor `name`, flattened, into `out` (any
  // shape, dtype and device: converted as copy_ does), then gives the pages of the mapping it
  // read back to the kernel (madvise), so a load that reads a file slice by slice holds one
  // slice, not the file, in resident memory. Pages a get() view was written through (private
  // copies) would be dropped too: do not mix writes into get() views with read_slice.
  void read_slice(const std::string& name, int64_t begin, const at::Tensor& out) const;
  const Metadata& metadata() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// When `t` views a live SafetensorsReader mapping (get(), load_safetensors), gives the pages it
// spans back to the kernel, as read_slice does, and returns true; otherwise (any other tensor,
// e.g. get()'s copy of an unaligned tensor) does nothing and returns false. For loaders that
// copy mapped tensors one at a time: resident memory then grows by one tensor, not the file.
bool release_mapped_pages(const at::Tensor& t);

// Every tensor of a file (views into the mapping).
TensorList load_safetensors(const std::string& path, Metadata* metadata = nullptr);

// Every tensor of a file as regular tensors owning their memory (read with pread(2) by a few
// threads, no mapping kept): for callers that write into the tensors or must not hold the file.
TensorList load_safetensors_copy(const std::string& path, Metadata* metadata = nullptr);

// The largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// A tensor to be written, as the header needs it before any data.
struct TensorDecl {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes() const;
};

// The order in which a file holds `tensors` (indices into it): grouped by element size, largest
// first, stable (see save_safetensors).
std::vector<size_t> safetensors_file_order(const std::vector<TensorDecl>& tensors);

// A safetensors file written one tensor at a time, for tensors that are produced one by one
// (gathered from other ranks) and must not be alive together. The constructor checks every
// declaration as save_safetensors does, then writes the header; write_next() appends the data of
// the next tensor in file order (next(): its declaration; an Error if the tensor's dtype or shape
// differs); finish() checks that every tensor was written and commits the file atomically.
// Without finish() (an exception while producing) the temporary is removed, `path` untouched.
// save_safetensors is this writer fed from a list: both write identical bytes.
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(const std::string& path, std::vector<TensorDecl> tensors,
                          const Metadata& metadata = {});
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  const std::vector<size_t>& order() const;  // indices into the declarations, file order
  bool done() const;                         // every tensor written
  const TensorDecl& next() const;
  size_t next_index() const;  // index of next() among the declarations
  void write_next(const at::Tensor& tensor);
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes a file atomically: to "<path>.tmp-<pid>", fsync, then rename over `path`. Tensors may
// live on any device and be non-contiguous; names must be unique. Every dtype and name is checked
// before anything is written. In the file, tensors are grouped by element size, largest first
// (stable, so one-dtype lists keep the caller's order), which keeps every tensor naturally
// aligned for the mapped loader, as Python safetensors does.
void save_safetensors(const std::string& path, const TensorList& tensors,
                      const Metadata& metadata = {});

}  // namespace colossal::checkpoint
