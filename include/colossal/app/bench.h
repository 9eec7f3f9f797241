// `colossal bench`: ColossalAI's Llama training benchmark (examples/language/llama/benchmark.py)
// on our stack. Random tokens (seeded per data-parallel rank), the real training step through the
// Booster (forward, loss, backward, optimizer step), device-synchronised step times and their
// median; throughput, model FLOPs by two rules, and peak memory. See docs/design.md.
// The app layer: the plugin comes from booster::make_plugin, the flags from the same typed
// option structs as `colossal train` (register_options), with ColossalAI's names as aliases.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "colossal/booster/plugins/factory.h"
#include "colossal/core/json.h"

namespace colossal {
class OptionSet;
}

namespace colossal::app {

struct BenchConfig {
  std::string model = "7b";  // preset or path to an HF config.json (-c; tiny on a CPU if unset)
  // -p and every plugin's options: gemini's placement fractions, max_prefetch (--prefetch_num),
  // overlap_cpu_adam and warmup_non_model_data_ratio (-w); zero's overlap_allgather; precision
  // (fp32 | bf16 | fp16; bf16 on cuda, fp32 on cpu unless given).
  booster::PluginOptions plugin;
  std::string device;            // cpu | cuda ("" until resolve(): cuda when a GPU is visible)
  bool grad_checkpoint = false;  // -g: recompute every decoder layer
  // FP8 linear layers (nn/fp8_linear.h; ColossalAI's use_fp8): recipe and excluded paths.
  bool use_fp8 = false;
  std::string fp8_recipe = "tensorwise";
  std::string fp8_exclude = "lm_head";
  std::string ckpt_mode;               // full | attention (implies -g)
  std::string checkpointing = "none";  // resolved: none | full | attention
  int64_t ckpt_layers = -1;            // recompute only the first N decoder layers (-1: all)
  // SDPA backend (auto | flash | cudnn | efficient | math), or `own`: our kernels
  // (nn::OwnAttention; SDPA where they do not apply, counted in the report).
  std::string attn_backend = "auto";
  bool deterministic = false;  // own attention: a bitwise repeatable backward
  bool fused_kernels = true;   // kernels/fused.h (RMSNorm, rotary, SwiGLU, AdamW)
  bool cuda_graph = false;     // replay forward + backward as one CUDA graph
  // --profile: one extra, untimed step recorded by the Kineto profiler; kernel table in the
  // report, Chrome trace in profile_dir/rank<r>.json.
  bool profile = false;
  std::string profile_dir = "profile";
  bool flash_attention = false;  // -x: recorded; SDPA picks its flash kernel on GPU by itself
  bool fused_ce = true;  // loss by CausalLM::forward_loss (no full logits), as colossal train
  int64_t ce_chunk_tokens = 1024;
  int64_t batch = 2;  // per data-parallel rank
  int64_t seq_len = 4096;
  int64_t steps = 5;   // timed + ignored
  int64_t warmup = 2;  // first steps not timed
  int64_t seed = 42;
  double lr = 1e-4;
  // --checkpoint_test: after the timed steps, one checkpoint save (model + optimizer, as
  // `colossal train` writes them) timed with its peak device and host memory: "discard" sends
  // the bytes to /dev/null (a benchmark-only sink: everything but the disk), a folder writes
  // them there and loads them back (timed too). "" (default): none.
  std::string checkpoint_test;

  // Every flag, named as `colossal train` names the same field, ColossalAI's benchmark names as
  // aliases (-c -p -b -l -s -i -g -x -w, --config, --batch_size, --max_length, --num_steps,
  // --ignore_steps, --xformers, --warmup_ratio, --prefetch_num, ...).
  void register_options(OptionSet& set);
  // After the flags: the defaults that depend on others (device, then precision and model) and
  // the recompute mode; InputError for contradicting flags.
  void resolve(const OptionSet& set);
  void validate() const;  // InputError naming the flag
};

// Floating-point operations of one training step of the whole global batch.
struct FlopCounts {
  double model_flops_per_token = 0;           // torchtitan: 6·N + 12·L·h·S (no recompute)
  double colossalai_flops_per_rank_step = 0;  // ColossalAI: 2·N·B·S·(3+g), B per dp rank
  double megatron_flops_per_rank_step = 0;    // 24(3+g)·B·S·L·h²·(1 + S/6h + V/16Lh)
};
// recompute: the fraction of decoder layers recomputed in backward (1 = ColossalAI's -g).
FlopCounts bench_flops(int64_t n_params, int64_t layers, int64_t hidden, int64_t vocab,
                       int64_t batch, int64_t seq_len, double recompute);

// The report (every figure also in to_json()).
struct BenchReport {
  BenchConfig config;
  std::string precision;
  int64_t n_params = 0, layers = 0, hidden = 0, vocab = 0;
  int world_size = 1, dp_size = 1;
  std::vector<double> step_seconds;  // timed steps, slowest rank's time per step
  double median_step_s = 0, mean_step_s = 0;
  double tokens_per_s = 0, tokens_per_s_per_gpu = 0, samples_per_s = 0;
  FlopCounts flops;
  double model_tflops_per_gpu = 0, mfu_989 = 0;
  double colossalai_tflops_per_gpu = 0, megatron_tflops_per_gpu = 0;
  double peak_memory_mib = 0;    // max over ranks
  std::string peak_memory_kind;  // "cuda max_memory_allocated" | "cpu peak RSS (process)"
  double final_loss = 0;
  // --attn_backend own: which kernel served the attention calls ("own N, SDPA M (why)").
  std::string attention_kernels;
  std::string profile_text;  // --profile: where the profiled step's device time went
  json::Value profile;       // the same, as {"step_ms", "busy_ms", "categories": {...}, ...}
  // pp > 1: the last timed step's pipeline, measured and simulated from its own per-instruction
  // costs ({"measured_step_s", "simulated_step_s", "simulated_bubble", "f_s", "b_s", "w_s"}).
  json::Value pipeline;
  // --checkpoint_test: {"where", "save_s", "load_s" (folder only), "bytes", "largest_tensor_mib",
  // "train_peak_device_mib", "save_peak_device_mib", "load_peak_device_mib",
  // "train_peak_host_mib", "save_peak_host_mib", "load_peak_host_mib"} (max over ranks).
  json::Value checkpoint;

  json::Value to_json() const;
  std::string to_text() const;  // the human-readable report
};

// Runs the benchmark on this rank (dist::init() done by the caller, or a single process).
// Every rank returns the same report.
BenchReport run_bench(const BenchConfig& config);

}  // namespace colossal::app
