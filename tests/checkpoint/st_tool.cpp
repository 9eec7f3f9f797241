// The C++ side of test_safetensors_interop.py (not a test on its own):
//   st_tool dump <file|dir>            one JSON line per tensor: name, dtype, shape, hex of bytes
//                                      (read through our mapped reader), then the metadata
//   st_tool copy <in> <out>            read with our reader, write with our writer
//   st_tool save-hf <in> <dir> <MB>    read a file, save it in the HF layout with MB-sized shards
// Errors: the message on stderr, exit code 2 for InputError, 1 otherwise.
#include <ATen/ATen.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"

using namespace colossal;
using namespace colossal::checkpoint;

namespace {

std::string hex_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  const unsigned char* p = static_cast<const unsigned char*>(c.data_ptr());
  size_t n = static_cast<size_t>(c.numel()) * c.element_size();
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

int run(int argc, char** argv) {
  std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "dump" && argc == 3) {
    Metadata md;
    std::string path = argv[2];
    TensorList tensors;
    if (path.size() > 12 && path.substr(path.size() - 12) == ".safetensors") {
      tensors = load_safetensors(path, &md);
    } else {
      tensors = load_state_dict(path);
    }
    for (const auto& [name, t] : tensors) {
      json::Value line = json::Value::object();
      line.set("name", name);
      line.set("dtype", dtype_to_safetensors(t.scalar_type()));
      json::Value shape = json::Value::array();
      for (int64_t d : t.sizes()) shape.push_back(d);
      line.set("shape", std::move(shape));
      line.set("hex", hex_of(t));
      std::cout << line.dump() << "\n";
    }
    json::Value m = json::Value::object();
    for (const auto& [k, v] : md) m.set(k, v);
    json::Value last = json::Value::object();
    last.set("metadata", std::move(m));
    std::cout << last.dump() << "\n";
    return 0;
  }
  if (cmd == "copy" && argc == 4) {
    Metadata md;
    TensorList tensors = load_safetensors(argv[2], &md);
    save_safetensors(argv[3], tensors, md);
    return 0;
  }
  if (cmd == "save-hf" && argc == 5) {
    SaveOptions opts;
    opts.size_per_shard_mb = std::stoll(argv[4]);
    save_state_dict(argv[3], load_safetensors(argv[2]), opts);
    return 0;
  }
  std::cerr << "usage: st_tool dump <file|dir> | copy <in> <out> | save-hf <in> <dir> <MB>\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const InputError& e) {
    std::cerr << "InputError: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
