// Test driver for test_nf4_bnb.py:
//   nf4_tool IN.safetensors OUT.safetensors BLOCKSIZE DOUBLE(0|1)
// Quantizes every tensor x of IN to NF4 (nn/nf4.h) and writes <x>.codes, <x>.absmax,
// <x>.absmax2 and <x>.offset (double quantisation) and <x>.dequant (in x's dtype) to OUT.
#include <ATen/ATen.h>

#include <cstdio>
#include <string>

#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/error.h"
#include "colossal/nn/nf4.h"

using namespace colossal;

int main(int argc, char** argv) {
  try {
    if (argc != 5) {
      std::fprintf(stderr, "usage: nf4_tool IN OUT BLOCKSIZE DOUBLE\n");
      return 2;
    }
    const int64_t bs = std::stoll(argv[3]);
    const bool dq = std::string(argv[4]) == "1";
    checkpoint::TensorList out{{"dynamic_map", nn::dynamic_map()}};
    for (auto& [name, t] : checkpoint::load_safetensors_copy(argv[1])) {
      nn::NF4Tensor q = nn::quantize_nf4(t, bs, dq);
      out.emplace_back(name + ".codes", q.codes);
      out.emplace_back(name + ".absmax", q.absmax);
      if (dq) {
        out.emplace_back(name + ".absmax2", q.absmax2);
        out.emplace_back(name + ".offset", at::full({1}, q.offset, at::kFloat));
      }
      out.emplace_back(name + ".dequant", nn::dequantize_nf4(q));
    }
    checkpoint::save_safetensors(argv[2], out);
    return 0;
  } catch (const InputError& e) {
    std::fprintf(stderr, "nf4_tool: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nf4_tool: %s\n", e.what());
    return 1;
  }
}
