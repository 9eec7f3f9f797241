// `colossal generate`: greedy continuation of token ids by a Hugging Face model folder (llama,
// mistral, qwen2), with a KV cache. Prints the new ids space-separated on one stdout line.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
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
  colossal::cli::Args args("generate", "greedy generation from a Hugging Face model folder");
  args.option("model", "model folder (config.json + *.safetensors)", "", true)
      .option("prompt-ids", "comma-separated prompt token ids, e.g. 1,2,3", "", true)
      .option("max-new-tokens", "number of tokens to generate", "32")
      .option("dtype", "fp32 | bf16", "fp32")
      .option("device", "cpu | cuda", "cpu")
      .flag("stop-at-eos", "stop once the config's eos_token_id is generated");
  args.parse(argc, argv);
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
  std::vector<int64_t> ids = parse_ids(args.str("prompt-ids"));

  // Positions past max_position_embeddings are outside what the model was trained for: refuse
  // (there is no option to stop at the limit instead) before the weights are read. Dynamic NTK
  // rope scaling exists to go past it (its frequencies stretch with the length, as in HF), so
  // there it is allowed.
  const std::filesystem::path cfg_path = std::filesystem::path(args.str("model")) / "config.json";
  if (std::filesystem::is_regular_file(cfg_path)) {
    const auto mc = colossal::models::ModelConfig::from_file(cfg_path.string());
    const int64_t room = mc.max_position_embeddings - static_cast<int64_t>(ids.size());
    COLOSSAL_CHECK_INPUT(max_new <= room || mc.rope.type == "dynamic", "--prompt-ids (", ids.size(),
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
    COLOSSAL_CHECK_INPUT(id < cfg.vocab_size, "--prompt-ids: token ", id,
                         " is outside the vocabulary of ", cfg.vocab_size);
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
  auto t0 = std::chrono::steady_clock::now();
  at::Tensor out = colossal::models::generate_greedy(*model, prompt, max_new, eos).to(at::kCPU);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string line;
  for (int64_t i = 0; i < out.size(1); ++i) {
    if (i) line += ' ';
    line += std::to_string(out[0][i].item<int64_t>());
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  colossal::log_info("generated ", out.size(1), " tokens in ", secs, " s (",
                     out.size(1) / std::max(secs, 1e-9), " tokens/s)");
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("generate", "greedy generation from a Hugging Face model folder", run_generate);
