// Loading speed of a safetensors file or HF checkpoint folder (bench/checkpoint_load.sh runs it
// next to Python safetensors on the same file). Prints one JSON line per mode to stdout:
//   mapped        load_state_dict/load_safetensors: validated header + tensors viewing the mmap
//                 (no data read; what Python's load_file with the default mmap backend returns)
//   mapped_touch  the same, then every page of every tensor read once (data now in memory)
//   copy          load_safetensors_copy: owned tensors filled with pread by a few threads
// usage: bench_checkpoint_load <file.safetensors|dir> [repeats=5]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "colossal/checkpoint/hf.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"

using namespace colossal::checkpoint;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t touch(const TensorList& tensors) {
  uint64_t sum = 0;
  for (const auto& [n, t] : tensors) {
    const unsigned char* p = static_cast<const unsigned char*>(t.data_ptr());
    size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    for (size_t i = 0; i < bytes; i += 4096) sum += p[i];
    if (bytes) sum += p[bytes - 1];
  }
  return sum;
}

uint64_t total_bytes(const TensorList& tensors) {
  uint64_t b = 0;
  for (const auto& [n, t] : tensors) b += static_cast<uint64_t>(t.numel()) * t.element_size();
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <file.safetensors|dir> [repeats=5]\n", argv[0]);
    return 1;
  }
  try {
    std::string path = argv[1];
    int repeats = argc > 2 ? std::stoi(argv[2]) : 5;
    bool is_file = path.size() > 12 && path.substr(path.size() - 12) == ".safetensors";
    uint64_t bytes = total_bytes(load_state_dict(path));
    uint64_t sink = 0;
    struct Mode {
      const char* name;
      std::function<void()> run;
    };
    std::vector<Mode> modes = {
        {"mapped", [&] { sink += load_state_dict(path).size(); }},
        {"mapped_touch", [&] { sink += touch(load_state_dict(path)); }},
        {"copy",
         [&] {
           if (!is_file) throw colossal::InputError("copy mode needs a .safetensors file");
           sink += touch(load_safetensors_copy(path));
         }},
    };
    for (auto& m : modes) {
      std::vector<double> t;
      m.run();  // warm-up
      for (int r = 0; r < repeats; ++r) {
        double t0 = now_s();
        m.run();
        t.push_back(now_s() - t0);
      }
      std::sort(t.begin(), t.end());
      double med = t[t.size() / 2];
      std::printf(
          "{\"impl\": \"cpp\", \"mode\": \"%s\", \"median_s\": %.6f, \"min_s\": %.6f, \"GBps\": "
          "%.2f, \"bytes\": %llu}\n",
          m.name, med, t.front(), bytes / med / 1e9, static_cast<unsigned long long>(bytes));
    }
    std::fprintf(stderr, "(checksum %llu)\n", static_cast<unsigned long long>(sink));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
