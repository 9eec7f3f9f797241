// `colossal bench`'s options, loop and report (see bench.h).
#include "colossal/app/bench.h"

#include <ATen/ATen.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>

#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/hybrid_plugin.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/core/profiler.h"
#include "colossal/dist/runtime.h"
#include "colossal/kernels/fused.h"
#include "colossal/models/llama/config.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/checkpointing.h"
#include "colossal/nn/fp8_linear.h"
#include "colossal/nn/init.h"
#include "colossal/optim/adamw.h"

namespace colossal::app {

using namespace booster;

void BenchConfig::register_options(OptionSet& s) {
  s.add("bench", "model", &model, "model preset (tiny|100m|1b|7b|13b|70b...) or an HF config.json")
      .alias("model", "-c")
      .alias("model", "config")
      .default_text("model", "7b; tiny on a CPU");
  s.add("bench", "micro_batch", &batch, "sequences per data-parallel rank per step")
      .alias("micro_batch", "-b")
      .alias("micro_batch", "batch_size")
      .add("bench", "seq_len", &seq_len, "sequence length")
      .alias("seq_len", "-l")
      .alias("seq_len", "max_length")
      .add("bench", "steps", &steps, "steps in all (timed + ignored)")
      .alias("steps", "-s")
      .alias("steps", "num_steps")
      .add("bench", "ignore_steps", &warmup, "first steps not timed")
      .alias("ignore_steps", "-i")
      .add("bench", "grad_checkpoint", &grad_checkpoint,
           "activation checkpointing (recompute every decoder layer)")
      .alias("grad_checkpoint", "-g")
      .add("bench", "ckpt_mode", &ckpt_mode,
           "recompute mode: full (every layer) or attention (selective); implies -g")
      .add("bench", "ckpt_layers", &ckpt_layers,
           "recompute only the first N decoder layers (with -g/--ckpt_mode)")
      .add("bench", "use_fp8", &use_fp8,
           "FP8 GEMMs in the linear layers (current scaling; emulated on the CPU)")
      .add("bench", "fp8_recipe", &fp8_recipe, "FP8 scaling: tensorwise | rowwise",
           {"tensorwise", "rowwise"})
      .add("bench", "fp8_exclude", &fp8_exclude,
           "comma-separated: linear layers whose path contains one of these stay out of FP8")
      .add("bench", "xformers", &flash_attention,
           "flash attention: SDPA already picks its flash kernel on GPU")
      .alias("xformers", "-x")
      .add("bench", "device", &device, "cpu | cuda")
      .default_text("device", "cuda when a GPU is visible, else cpu")
      .add("bench", "seed", &seed, "seed of the random tokens and the initial weights")
      .add("bench", "fused_ce", &fused_ce, "loss by chunked fused linear + cross-entropy")
      .add("bench", "ce_chunk_tokens", &ce_chunk_tokens,
           "tokens per chunk of the fused cross-entropy")
      .add("bench", "fused_kernels", &fused_kernels,
           "fused RMSNorm, rotary, SwiGLU and AdamW kernels")
      .add("bench", "attn_backend", &attn_backend,
           "SDPA backend: auto | flash | cudnn | efficient | math; or own (our sm_90a kernels, "
           "SDPA where they do not apply)")
      .add("bench", "deterministic", &deterministic,
           "--attn_backend own: a bitwise repeatable attention backward (dQ summed in order)")
      .add("bench", "cuda_graph", &cuda_graph,
           "capture forward + backward once, replay it every timed step (cuda)")
      .add("bench", "profile", &profile,
           "record one extra untimed step with the Kineto profiler: kernel table in the report, "
           "Chrome trace in --profile_dir")
      .add("bench", "profile_dir", &profile_dir,
           "--profile: folder of the Chrome traces (rank<r>.json)")
      .add("bench", "checkpoint_test", &checkpoint_test,
           "after the timed steps, time one checkpoint save with its peak memory: 'discard' "
           "(bytes to /dev/null) or a folder (written, then loaded back)");
  plugin.register_options(s, "-p");
  s.alias("max_prefetch", "prefetch_num")
      .alias("warmup_non_model_data_ratio", "-w")
      .alias("warmup_non_model_data_ratio", "warmup_ratio")
      .default_text("precision", "bf16 on cuda, fp32 on cpu");
}

void BenchConfig::resolve(const OptionSet& set) {
  if (set.was_set("ckpt_mode")) {
    COLOSSAL_CHECK_INPUT(ckpt_mode != "none",
                         "--ckpt_mode must be full or attention (leave out -g for none)");
    checkpointing = ckpt_mode;
  } else {
    checkpointing = grad_checkpoint ? "full" : "none";
  }
  COLOSSAL_CHECK_INPUT(!set.was_set("ckpt_layers") || checkpointing != "none",
                       "--ckpt_layers needs -g or --ckpt_mode (it says how many layers recompute)");
  COLOSSAL_CHECK_INPUT(!set.was_set("profile_dir") || profile, "--profile_dir needs --profile");
  if (device.empty()) device = Accelerator::cuda().available() ? "cuda" : "cpu";
  if (!set.was_set("precision")) plugin.ddp.precision = device == "cuda" ? "bf16" : "fp32";
  // ColossalAI's benchmark: --sp_mode all_to_all by default, on when --sp > 1.
  if (is_hybrid_plugin(plugin.name) && plugin.hybrid.sp_size > 1 &&
      !set.was_set("sequence_parallelism_mode")) {
    plugin.hybrid.sequence_parallelism_mode = "all_to_all";
    log_info("colossal bench: --sp ", plugin.hybrid.sp_size,
             " without --sp_mode: all_to_all (ColossalAI's benchmark default)");
  }
  // ColossalAI's default model (-c 7b) is a GPU benchmark; on a CPU it would need ~100 GB.
  // Without an explicit -c, a CPU run benchmarks the tiny preset and says so.
  if (!set.was_set("model") && device == "cpu") {
    model = "tiny";
    log_warn(
        "colossal bench: no -c given and running on the CPU: using -c tiny (ColossalAI's default "
        "7b needs a GPU)");
  }
}

void BenchConfig::validate() const {
  const std::string& p = plugin.name;
  const GeminiPluginOptions& g = plugin.gemini;
  COLOSSAL_CHECK_INPUT(batch >= 1, "-b/--batch_size must be >= 1, got ", batch);
  COLOSSAL_CHECK_INPUT(seq_len >= 2, "-l/--max_length must be >= 2, got ", seq_len);
  COLOSSAL_CHECK_INPUT(warmup >= 0, "-i/--ignore_steps must be >= 0, got ", warmup);
  COLOSSAL_CHECK_INPUT(steps > warmup, "-s/--num_steps (", steps,
                       ") must exceed -i/--ignore_steps (", warmup,
                       "): at least one step is timed");
  COLOSSAL_CHECK_INPUT(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '",
                       device, "'");
  COLOSSAL_CHECK_INPUT(is_plugin_name(p), "-p/--plugin '", p,
                       "' is not a plugin of colossal.cpp: use ", plugin_names_text());
  plugin.validate();
  nn::checkpoint_mode_from_string(checkpointing);
  const bool gemini = p == "gemini" || p == "gemini_auto";
  if (!gemini)
    COLOSSAL_CHECK_INPUT(g.shard_param_frac == 1.0 && g.offload_optim_frac == 0.0 &&
                             g.offload_param_frac == 0.0 && g.max_prefetch == 0 &&
                             g.overlap_cpu_adam,
                         "--shard_param_frac/--offload_optim_frac/--offload_param_frac/"
                         "--prefetch_num/--overlap_cpu_adam apply to -p gemini only, not '",
                         p, "'");
  for (double f : {g.shard_param_frac, g.offload_optim_frac, g.offload_param_frac})
    COLOSSAL_CHECK_INPUT(f >= 0.0 && f <= 1.0, "Gemini placement fractions must be in [0, 1], got ",
                         f);
  COLOSSAL_CHECK_INPUT(g.max_prefetch >= 0, "--prefetch_num must be >= 0, got ", g.max_prefetch);
  const double w = g.warmup_non_model_data_ratio;
  COLOSSAL_CHECK_INPUT(w >= 0.0 && w <= 1.0, "-w/--warmup_ratio must be in [0, 1], got ", w);
  if (cuda_graph) {
    COLOSSAL_CHECK_INPUT(p == "none" || p == "ddp",
                         "--cuda_graph needs -p none or ddp (the other plugins move memory and "
                         "communicate from hooks), not '",
                         p, "'");
    COLOSSAL_CHECK_INPUT(device == "cuda", "--cuda_graph needs --device cuda, got '", device, "'");
    COLOSSAL_CHECK_INPUT(
        warmup >= 1, "--cuda_graph needs -i/--ignore_steps >= 1 (an eager step before capture)");
    COLOSSAL_CHECK_INPUT(
        checkpointing == "none",
        "--cuda_graph with activation checkpointing is not supported (the recompute "
        "reads the RNG state on the host)");
    COLOSSAL_CHECK_INPUT(
        plugin.ddp.precision != "fp16",
        "--cuda_graph with fp16 is not supported (the loss scaler decides on the host)");
    COLOSSAL_CHECK_INPUT(!plugin.ddp.overlap_step,
                         "--cuda_graph with --overlap_step is not supported (a replayed graph runs "
                         "no forward hooks, so it cannot wait for each layer's update)");
  }
  COLOSSAL_CHECK_INPUT(ckpt_layers >= -1,
                       "--ckpt_layers must be >= 0 (or -1 for every layer), got ", ckpt_layers);
  COLOSSAL_CHECK_INPUT(attn_backend == "auto" || attn_backend == "flash" ||
                           attn_backend == "cudnn" || attn_backend == "efficient" ||
                           attn_backend == "math" || attn_backend == "own",
                       "--attn_backend must be auto, flash, cudnn, efficient, math or own, got '",
                       attn_backend, "'");
  COLOSSAL_CHECK_INPUT(!deterministic || attn_backend == "own",
                       "--deterministic applies to our attention kernels: it needs --attn_backend "
                       "own, not '",
                       attn_backend, "'");
  COLOSSAL_CHECK_INPUT(ce_chunk_tokens >= 1, "--ce_chunk_tokens must be >= 1, got ",
                       ce_chunk_tokens);
  COLOSSAL_CHECK_INPUT(
      !plugin.zero.overlap_allgather || p == "low_level_zero" || p == "zero1" || p == "zero2",
      "--overlap_allgather needs a low_level_zero plugin, not '", p, "'");
}

namespace {

// Restricts scaled_dot_product_attention to one backend (process-wide ATen switches); "auto"
// restores ATen's own choice. A backend that cannot serve the shapes makes SDPA throw.
void set_sdpa_backend(const std::string& name) {
  auto& ctx = at::globalContext();
  const bool all = name == "auto";
  ctx.setSDPUseFlash(all || name == "flash");
  ctx.setSDPUseCuDNN(all || name == "cudnn");
  ctx.setSDPUseMemEfficient(all || name == "efficient");
  ctx.setSDPUseMath(all || name == "math");
}
}  // namespace

FlopCounts bench_flops(int64_t n, int64_t layers, int64_t hidden, int64_t vocab, int64_t batch,
                       int64_t seq, double g) {
  const double N = static_cast<double>(n), L = static_cast<double>(layers),
               h = static_cast<double>(hidden), V = static_cast<double>(vocab),
               B = static_cast<double>(batch), S = static_cast<double>(seq);
  FlopCounts f;
  f.model_flops_per_token = 6.0 * N + 12.0 * L * h * S;
  f.colossalai_flops_per_rank_step = 2.0 * N * B * S * (3 + g);
  f.megatron_flops_per_rank_step =
      24.0 * (3 + g) * B * S * L * h * h * (1.0 + S / (6.0 * h) + V / (16.0 * L * h));
  return f;
}

json::Value BenchReport::to_json() const {
  json::Value c = json::Value::object();
  c.set("model", config.model);
  c.set("plugin", config.plugin.name);
  c.set("precision", precision);
  c.set("device", config.device);
  c.set("grad_checkpoint", config.checkpointing);
  c.set("ckpt_layers", config.ckpt_layers);
  c.set("fp8", config.use_fp8 ? config.fp8_recipe : std::string("off"));
  c.set("fp8_communication", config.plugin.ddp.fp8_communication);
  c.set("attn_backend", config.attn_backend);
  c.set("deterministic", config.deterministic);
  c.set("fused_kernels", config.fused_kernels);
  c.set("cuda_graph", config.cuda_graph);
  c.set("overlap_step", config.plugin.ddp.overlap_step);
  if (config.plugin.name == "gemini" || config.plugin.name == "gemini_auto") {
    const booster::GeminiPluginOptions& g = config.plugin.gemini;
    c.set("shard_param_frac", g.shard_param_frac);
    c.set("offload_optim_frac", g.offload_optim_frac);
    c.set("offload_param_frac", g.offload_param_frac);
    c.set("prefetch_num", g.max_prefetch);  // ColossalAI's benchmark name
    c.set("overlap_cpu_adam", g.overlap_cpu_adam);
  }
  if (booster::is_hybrid_plugin(config.plugin.name)) {  // ColossalAI's benchmark names
    const booster::HybridOptions& h = config.plugin.hybrid;
    c.set("tp", h.tp_size);
    c.set("pp", h.pp_size);
    c.set("sp", h.sp_size);
    c.set("sp_mode", h.sequence_parallelism_mode.empty() ? "off" : h.sequence_parallelism_mode);
    c.set("zero", h.zero_stage);
    if (h.pp_size > 1) {
      c.set("pp_style", h.pp_style);
      c.set("num_model_chunks", h.num_model_chunks);
      c.set("num_microbatches", h.num_microbatches);
      c.set("mbs", h.microbatch_size);
    }
  }
  c.set("flash_attention", config.flash_attention);
  c.set("fused_ce", config.fused_ce);
  c.set("batch_per_dp_rank", config.batch);
  c.set("seq_len", config.seq_len);
  c.set("steps", config.steps);
  c.set("ignored_steps", config.warmup);
  c.set("seed", config.seed);
  c.set("world_size", world_size);
  c.set("dp_size", dp_size);
  c.set("n_params", n_params);
  c.set("num_layers", layers);
  c.set("hidden_size", hidden);
  c.set("vocab_size", vocab);
  json::Value r = json::Value::object();
  r.set("config", c);
  json::Value times = json::Value::array();
  for (double t : step_seconds) times.push_back(t);
  r.set("step_seconds", times);
  r.set("median_step_s", median_step_s);
  r.set("mean_step_s", mean_step_s);
  r.set("tokens_per_s", tokens_per_s);
  r.set("tokens_per_s_per_gpu", tokens_per_s_per_gpu);
  r.set("samples_per_s", samples_per_s);
  r.set("model_flops_per_token", flops.model_flops_per_token);
  r.set("model_tflops_per_gpu", model_tflops_per_gpu);
  r.set("mfu_989", mfu_989);
  r.set("colossalai_flops_per_rank_step", flops.colossalai_flops_per_rank_step);
  r.set("colossalai_tflops_per_gpu", colossalai_tflops_per_gpu);
  r.set("megatron_flops_per_rank_step", flops.megatron_flops_per_rank_step);
  r.set("megatron_tflops_per_gpu", megatron_tflops_per_gpu);
  r.set("peak_memory_mib", peak_memory_mib);
  r.set("peak_memory_kind", peak_memory_kind);
  r.set("final_loss", final_loss);
  if (!attention_kernels.empty()) r.set("attention_kernels", attention_kernels);
  if (config.profile) r.set("profile", profile);
  if (!pipeline.is_null()) r.set("pipeline", pipeline);
  if (!checkpoint.is_null()) r.set("checkpoint", checkpoint);
  return r;
}

std::string BenchReport::to_text() const {
  const std::string ckpt =
      config.checkpointing == "none" || config.ckpt_layers < 0
          ? config.checkpointing
          : str(config.checkpointing, " (first ", config.ckpt_layers, " layers)");
  char buf[2048];
  std::snprintf(
      buf, sizeof buf,
      "colossal bench: %s (%.3fB params, %lld layers, hidden %lld, vocab %lld)\n"
      "  plugin %s, %s on %s, %d rank(s) (dp %d), batch %lld per dp rank, seq %lld, "
      "grad checkpoint %s, attention %s, fused kernels %s, fused CE %s, CUDA graph %s, overlap "
      "step %s\n"
      "  steps %lld (first %lld ignored), median step %.4f s (mean %.4f s)\n"
      "  throughput: %.1f tokens/s/GPU, %.1f tokens/s total, %.3f samples/s\n"
      "  model TFLOPS/GPU (6N + 12LhS per token, no recompute): %.3f, MFU vs 989 TFLOPS: %.4f\n"
      "  ColossalAI TFLOPS/GPU (2NBS(3+g)): %.3f; Megatron formula: %.3f\n"
      "  peak memory: %.1f MiB (%s)\n"
      "  final loss %.4f\n",
      config.model.c_str(), static_cast<double>(n_params) / 1e9, (long long)layers,
      (long long)hidden, (long long)vocab, config.plugin.name.c_str(), precision.c_str(),
      config.device.c_str(), world_size, dp_size, (long long)config.batch,
      (long long)config.seq_len, ckpt.c_str(), config.attn_backend.c_str(),
      config.fused_kernels ? "on" : "off", config.fused_ce ? "on" : "off",
      config.cuda_graph ? "on" : "off", config.plugin.ddp.overlap_step ? "on" : "off",
      (long long)config.steps, (long long)config.warmup, median_step_s, mean_step_s,
      tokens_per_s_per_gpu, tokens_per_s, samples_per_s, model_tflops_per_gpu, mfu_989,
      colossalai_tflops_per_gpu, megatron_tflops_per_gpu, peak_memory_mib, peak_memory_kind.c_str(),
      final_loss);
  std::string pipe;
  if (!pipeline.is_null()) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "pipeline: last step %.2f ms measured, %.2f ms simulated from its own per-op "
                  "costs (bubble %.1f %%)\n",
                  pipeline.at("measured_step_s").as_double() * 1e3,
                  pipeline.at("simulated_step_s").as_double() * 1e3,
                  pipeline.at("simulated_bubble").as_double() * 100);
    pipe = line;
  }
  if (!checkpoint.is_null()) {
    auto g = [&](const char* k) {
      const json::Value* v = checkpoint.find(k);
      return v ? v->as_double() : 0.0;
    };
    char line[512];
    std::snprintf(line, sizeof line,
                  "checkpoint (%s): save %.2f s, %.2f GiB; peak device MiB train %.0f / save "
                  "%.0f; peak host MiB train %.0f / save %.0f; largest tensor %.0f MiB\n",
                  checkpoint.at("where").as_string().c_str(), g("save_s"),
                  g("bytes") / 1073741824.0, g("train_peak_device_mib"), g("save_peak_device_mib"),
                  g("train_peak_host_mib"), g("save_peak_host_mib"), g("largest_tensor_mib"));
    pipe += line;
    if (checkpoint.find("load_s")) {
      std::snprintf(line, sizeof line, "checkpoint load: %.2f s; peak device MiB %.0f, host %.0f\n",
                    g("load_s"), g("load_peak_device_mib"), g("load_peak_host_mib"));
      pipe += line;
    }
  }
  if (!attention_kernels.empty()) pipe = "attention kernels: " + attention_kernels + "\n" + pipe;
  return std::string(buf) + pipe + profile_text;
}

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double peak_rss_mib() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // Linux: KiB
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The model built on meta and materialised on the device (values by name, as `colossal train`),
// with the recompute mode, kernels and SDPA backend the config asks for.
std::shared_ptr<models::CausalLM> build_model(const BenchConfig& c, const at::Device& device,
                                              bool rank0) {
  models::ModelConfig cfg = std::filesystem::exists(c.model)
                                ? models::ModelConfig::from_file(c.model)
                                : models::ModelConfig::preset(c.model);
  COLOSSAL_CHECK_INPUT(c.seq_len <= cfg.max_position_embeddings, "-l ", c.seq_len,
                       " exceeds the model's max_position_embeddings ",
                       cfg.max_position_embeddings);
  // init_parameters materialises every parameter on `device` in fp32.
  models::check_fits_memory(cfg, device, 4, "model " + c.model);
  auto model = std::make_shared<models::CausalLM>(cfg, at::TensorOptions().device(at::kMeta));
  nn::InitOptions io;
  io.seed = static_cast<uint64_t>(c.seed);
  io.std = cfg.initializer_range;
  io.device = device;
  // Setup is minutes at 13b: each phase says what it took (init here, boost in BenchLoop).
  auto t_init = std::chrono::steady_clock::now();
  nn::init_parameters(*model, io);
  if (rank0) log_info("bench: parameters initialised on ", device, " in ", since(t_init), " s");
  model->set_activation_checkpointing(nn::checkpoint_mode_from_string(c.checkpointing),
                                      c.ckpt_layers);
  if (c.use_fp8) {
    nn::Fp8Config fc;
    fc.recipe = c.fp8_recipe;
    fc.keep_weight_casts = false;  // one micro-batch per step: one cast per step either way
    fc.exclude = split_list(c.fp8_exclude);
    const auto paths = nn::convert_to_fp8(*model, fc, device);
    if (rank0) log_info("bench: FP8 (", fc.recipe, ") on ", paths.size(), " linear layers");
  }
  kernels::set_enabled(c.fused_kernels);
  if (c.attn_backend == "own") {
    const auto [own, slots] = nn::use_own_attention(*model, c.deterministic);
    if (rank0)
      log_info("bench: our attention kernels in ", slots, " core-attention slots",
               c.deterministic ? " (deterministic backward)" : "");
    set_sdpa_backend("auto");  // for the calls they hand to SDPA
  } else {
    set_sdpa_backend(c.attn_backend);
  }
  return model;
}

// The boosted model and optimizer and the timed step (eager, or replayed as a CUDA graph).
class BenchLoop {
 public:
  BenchLoop(const BenchConfig& c, std::shared_ptr<Plugin> plugin,
            std::shared_ptr<models::CausalLM> model, const at::Device& device, bool distributed,
            bool rank0);
  // One training step on fresh random tokens; returns its wall time, to the end of the work on
  // the current stream: under --overlap_step the update left on the side stream is waited for
  // by the next step's forward, so in a run of steps each one's time is its share of the run.
  double step(int64_t s);
  double last_loss() const { return last_loss_; }
  // --checkpoint_test: one save (and, into a folder, a load) through the Booster, timed, with
  // the peak memory of each phase against training's (see BenchReport::checkpoint).
  json::Value checkpoint_test(const std::string& where, bool distributed);

 private:
  at::Tensor forward_backward(const at::Tensor& ids, const at::Tensor& targets);
  void sync() const {
    if (device_.is_cuda()) Accelerator::cuda().synchronize();
  }
  void sync_stream() const {
    if (device_.is_cuda()) Accelerator::cuda().synchronize_stream();
  }
  const BenchConfig& c_;
  std::shared_ptr<models::CausalLM> model_;
  at::Device device_;
  Booster booster_;
  Boosted boosted_;
  at::Generator gen_;
  // --cuda_graph: everything runs on a side stream (CUDA cannot capture the default one); the
  // eager warm-up steps run there too, then forward + backward is captured once (untimed) and
  // every timed step refills the static inputs, replays it and steps the optimizer. The graph
  // writes the gradients in place, so they are never set to none between steps.
  std::unique_ptr<CudaGraph> graph_;
  at::Tensor graph_ids_, graph_targets_, graph_loss_;
  double last_loss_ = 0;
};

BenchLoop::BenchLoop(const BenchConfig& c, std::shared_ptr<Plugin> plugin,
                     std::shared_ptr<models::CausalLM> model, const at::Device& device,
                     bool distributed, bool rank0)
    : c_(c), model_(std::move(model)), device_(device), booster_(std::move(plugin)) {
  auto adamw = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> params;
  for (auto& item : model_->named_parameters(true)) params.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = c.lr;
  adamw->add_param_group(params, g);
  auto t_boost = std::chrono::steady_clock::now();
  boosted_ = booster_.boost(model_, adamw);
  if (rank0) log_info("bench: boost (", c.plugin.name, ") took ", since(t_boost), " s");
  // Random tokens, labels = inputs (HF's shift inside the loss), one batch per step.
  gen_ = at::detail::createCPUGenerator(static_cast<uint64_t>(c.seed) +
                                        1000003ull *
                                            static_cast<uint64_t>(booster_.plugin().dp_rank()));
  if (c.cuda_graph) {
    COLOSSAL_CHECK_INPUT(!distributed,
                         "--cuda_graph runs one process (no gradient collectives in the graph)");
    Accelerator::cuda().set_stream(Accelerator::cuda().new_stream());
  }
  if (device_.is_cuda()) Accelerator::cuda().reset_peak_memory_stats();
}

at::Tensor BenchLoop::forward_backward(const at::Tensor& ids, const at::Tensor& targets) {
  if (booster_.plugin().support_pipeline()) {
    // Pipeline stages: the schedule splits the batch into micro-batches (--num_microbatches or
    // --microbatch_size) and returns the step's loss on every rank.
    COLOSSAL_CHECK_INPUT(!c_.cuda_graph, "--cuda_graph does not capture a pipeline schedule");
    BatchIterator next = [&] { return std::make_pair(ids, targets); };
    Criterion criterion;
    if (!c_.fused_ce)
      criterion = [](const at::Tensor& logits, const at::Tensor& t) {
        return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                      t.reshape({-1}).to(logits.device()), std::nullopt,
                                      at::Reduction::Mean, -100);
      };
    PipelineStep ps;
    ps.ce_chunk_tokens = c_.fused_ce ? c_.ce_chunk_tokens : 0;
    return booster_
        .execute_pipeline(next, *boosted_.model, criterion, boosted_.optimizer.get(), true, false,
                          ps)
        .loss;
  }
  // This rank's part of the batch (a sequence shard under sequence parallelism).
  LocalBatch lb = booster_.plugin().local_batch(ids, targets);
  models::ForwardOptions fo;
  fo.seq_offset = lb.seq_offset;
  fo.global_seq_len = lb.global_seq_len;
  if (lb.positions.defined()) fo.positions = lb.positions.to(lb.inputs.device());
  at::Tensor loss;
  // A head sharded over the vocabulary returns sharded logits: its loss is always the
  // vocab-parallel one (one chunk of every token without fused_ce).
  if (c_.fused_ce || model_->vocab_parallel_head()) {
    loss = model_->forward_loss(lb.inputs, lb.targets, c_.fused_ce ? c_.ce_chunk_tokens : 0, fo);
  } else {
    at::Tensor logits = model_->forward(lb.inputs, fo);
    loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                  lb.targets.reshape({-1}).to(logits.device()), std::nullopt,
                                  at::Reduction::Mean, -100);
  }
  booster_.backward(lb.loss_weight == 1.0 ? loss : loss * lb.loss_weight, *boosted_.optimizer);
  return loss;
}

double BenchLoop::step(int64_t s) {
  OptimizerWrapper& opt = *boosted_.optimizer;
  at::Tensor ids = at::randint(0, model_->config().vocab_size, {c_.batch, c_.seq_len}, gen_,
                               at::TensorOptions().dtype(at::kLong))
                       .to(device_);
  // Next-token targets (HF's shift; the last position has none).
  at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, c_.seq_len - 1), {0, 1}, -100);
  const bool replay = c_.cuda_graph && s >= c_.warmup;
  if (replay && !graph_) {
    graph_ids_ = ids.clone();
    graph_targets_ = targets.clone();
    opt.zero_grad(true);
    sync();
    graph_ = std::make_unique<CudaGraph>();
    graph_->capture([&] { graph_loss_ = forward_backward(graph_ids_, graph_targets_); });
    sync();
  }
  // Under --overlap_step only the current stream is waited for (the update left on the side
  // stream overlaps the next step, which waits for it); otherwise the whole device.
  const bool overlap = c_.plugin.ddp.overlap_step;
  overlap ? sync_stream() : sync();
  auto t0 = std::chrono::steady_clock::now();
  at::Tensor loss;
  if (replay) {
    graph_ids_.copy_(ids);
    graph_targets_.copy_(targets);
    graph_->replay();
    loss = graph_loss_;
    opt.step();
  } else {
    loss = forward_backward(ids, targets);
    opt.step();
    opt.zero_grad(true);
  }
  overlap ? sync_stream() : sync();
  const double dt = since(t0);
  last_loss_ = loss.item<double>();
  return dt;
}

json::Value BenchLoop::checkpoint_test(const std::string& where, bool distributed) {
  namespace fs = std::filesystem;
  const bool cuda = device_.is_cuda();
  auto device_peak = [&] {
    return cuda ? static_cast<double>(Accelerator::cuda().memory_stats().peak_allocated) /
                      (1024.0 * 1024.0)
                : 0.0;
  };
  auto reset_peaks = [&] {
    sync();
    if (cuda) Accelerator::cuda().reset_peak_memory_stats();
    Accelerator::cpu().reset_peak_memory_stats();  // VmHWM back to the current RSS
  };
  auto host_peak = [] {  // the process's VmHWM, in MiB
    return static_cast<double>(Accelerator::cpu().memory_stats().peak_allocated) /
           (1024.0 * 1024.0);
  };
  json::Value js = json::Value::object();
  js.set("where", where);
  js.set("train_peak_device_mib", device_peak());
  js.set("train_peak_host_mib", host_peak());
  double largest = 0;  // the largest tensor a save holds whole: an fp32 state of the biggest weight
  for (const auto& p : model_->parameters()) largest = std::max(largest, p.numel() * 4.0);
  js.set("largest_tensor_mib", largest / (1024.0 * 1024.0));
  const bool discard = where == "discard";
  const std::string dir =
      discard ? (fs::temp_directory_path() / ("colossal-bench-ckpt-" + std::to_string(::getpid())))
                    .string()
              : where;
  reset_peaks();
  auto t0 = std::chrono::steady_clock::now();
  {
    std::optional<checkpoint::DiscardWrites> sink;
    if (discard) sink.emplace();
    booster_.save_model(*boosted_.model, dir + "/model");
    booster_.save_optimizer(*boosted_.optimizer, dir);
  }
  sync();
  js.set("save_s", since(t0));
  js.set("save_peak_device_mib", device_peak());
  js.set("save_peak_host_mib", host_peak());
  double bytes = 0;
  if (!discard && fs::exists(dir)) {
    for (const auto& e : fs::recursive_directory_iterator(dir))
      if (e.is_regular_file()) bytes += static_cast<double>(e.file_size());
  } else {
    // What the files would hold: every weight at its dtype, every optimizer state in fp32.
    for (const auto& p : model_->parameters()) bytes += p.numel() * (p.element_size() + 12.0);
  }
  js.set("bytes", bytes);
  if (!discard) {
    reset_peaks();
    t0 = std::chrono::steady_clock::now();
    booster_.load_model(*boosted_.model, dir + "/model", true, boosted_.optimizer.get());
    booster_.load_optimizer(*boosted_.optimizer, dir);
    sync();
    js.set("load_s", since(t0));
    js.set("load_peak_device_mib", device_peak());
    js.set("load_peak_host_mib", host_peak());
  } else {
    // (checkpoint::remove_tree: libtorch.so exports a std::filesystem::remove_all of its own
    // build that crashes when called from ours.)
    std::string err;
    if (!checkpoint::remove_tree(dir, &err)) log_warn("--checkpoint_test: ", err);
  }
  if (distributed) {  // the largest rank's figures
    for (const char* k : {"save_s", "load_s", "train_peak_device_mib", "save_peak_device_mib",
                          "load_peak_device_mib", "train_peak_host_mib", "save_peak_host_mib",
                          "load_peak_host_mib"}) {
      const json::Value* v = js.find(k);
      if (!v) continue;
      at::Tensor t = at::full({1}, v->as_double(), at::kDouble);
      dist::world_cpu().all_reduce(t, dist::ReduceOp::Max);
      js.set(k, t.item<double>());
    }
  }
  return js;
}

// --profile: one more step (untimed, after the timed ones) under the profiler; the report's
// text and JSON.
std::pair<std::string, json::Value> profile_step(const BenchConfig& c, BenchLoop& loop, bool cuda,
                                                 int rank) {
  COLOSSAL_CHECK_INPUT(::mkdir(c.profile_dir.c_str(), 0755) == 0 || errno == EEXIST,
                       "--profile_dir: cannot create '", c.profile_dir, "'");
  const std::string trace = c.profile_dir + "/rank" + std::to_string(rank) + ".json";
  Profiler profiler(cuda);
  const double dt = loop.step(c.steps);
  ProfileSummary ps = profiler.stop(trace);
  constexpr size_t kTopKernels = 40;
  json::Value js = ps.to_json(dt * 1e3, kTopKernels);
  js.set("trace", trace);
  return {ps.to_text(dt * 1e3, kTopKernels) + "  Chrome trace: " + trace + "\n", js};
}

// Per step the slowest rank's time; peak memory the largest rank's; loss the dp mean.
void reduce_over_ranks(std::vector<double>& times, double& peak, double& loss) {
  at::Tensor t = at::tensor(times, at::TensorOptions().dtype(at::kDouble));
  dist::world_cpu().all_reduce(t, dist::ReduceOp::Max);
  for (size_t i = 0; i < times.size(); ++i) times[i] = t[static_cast<int64_t>(i)].item<double>();
  at::Tensor m = at::full({1}, peak, at::kDouble);
  dist::world_cpu().all_reduce(m, dist::ReduceOp::Max);
  peak = m.item<double>();
  at::Tensor l = at::full({1}, loss, at::kDouble);
  dist::world_cpu().all_reduce(l, dist::ReduceOp::Avg);
  loss = l.item<double>();
}

// Throughput and FLOP figures from the step times.
void fill_figures(BenchReport& r) {
  const BenchConfig& c = r.config;
  r.median_step_s = median(r.step_seconds);
  r.mean_step_s = std::accumulate(r.step_seconds.begin(), r.step_seconds.end(), 0.0) /
                  static_cast<double>(r.step_seconds.size());
  const double tokens = static_cast<double>(c.batch * r.dp_size * c.seq_len);
  r.tokens_per_s = tokens / r.median_step_s;
  r.tokens_per_s_per_gpu = r.tokens_per_s / r.world_size;
  r.samples_per_s = static_cast<double>(c.batch * r.dp_size) / r.median_step_s;
  // ColossalAI counts recompute (g = 1 with -g); its formula has no term for attention-only
  // recompute, which we count as g = 0.
  const double recompute =
      nn::checkpoint_mode_from_string(c.checkpointing) != nn::CheckpointMode::Full ? 0.0
      : c.ckpt_layers < 0                                                          ? 1.0
                          : static_cast<double>(c.ckpt_layers) / static_cast<double>(r.layers);
  r.flops = bench_flops(r.n_params, r.layers, r.hidden, r.vocab, c.batch, c.seq_len, recompute);
  r.model_tflops_per_gpu = r.tokens_per_s_per_gpu * r.flops.model_flops_per_token / 1e12;
  r.mfu_989 = r.model_tflops_per_gpu / 989.0;
  const double gpus_per_replica = static_cast<double>(r.world_size) / r.dp_size;
  r.colossalai_tflops_per_gpu =
      r.flops.colossalai_flops_per_rank_step / 1e12 / r.median_step_s / gpus_per_replica;
  r.megatron_tflops_per_gpu =
      r.flops.megatron_flops_per_rank_step / 1e12 / r.median_step_s / gpus_per_replica;
}

}  // namespace

BenchReport run_bench(const BenchConfig& c) {
  c.validate();
  const bool distributed = dist::is_initialized() && dist::world_size() > 1;
  const bool rank0 = !distributed || dist::rank() == 0;
  if (c.device == "cuda")
    COLOSSAL_CHECK_INPUT(Accelerator::cuda().available(),
                         "--device cuda: no CUDA device is visible (use --device cpu)");
  const at::Device device =
      c.device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);
  if (c.plugin.name == "none")
    COLOSSAL_CHECK_INPUT(!distributed,
                         "-p none runs one process; use ddp or a zero plugin under "
                         "`colossal run`");
  std::shared_ptr<Plugin> plugin = make_plugin(c.plugin, c.device);
  auto model = build_model(c, device, rank0);

  BenchReport r;
  r.config = c;
  r.precision = c.plugin.ddp.precision;
  for (const auto& p : model->parameters()) r.n_params += p.numel();
  r.layers = model->config().num_hidden_layers;
  r.hidden = model->config().hidden_size;
  r.vocab = model->config().vocab_size;
  r.world_size = distributed ? dist::world_size() : 1;
  r.dp_size = plugin->dp_size();

  BenchLoop loop(c, plugin, model, device, distributed, rank0);
  for (int64_t s = 0; s < c.steps; ++s) {
    const double dt = loop.step(s);
    if (s >= c.warmup) r.step_seconds.push_back(dt);
  }
  if (auto* hybrid = dynamic_cast<HybridParallelPlugin*>(plugin.get());
      hybrid && hybrid->support_pipeline()) {
    PipelineProfile pp = hybrid->pipeline_profile();
    json::Value js = json::Value::object();
    js.set("measured_step_s", pp.measured);
    js.set("simulated_step_s", pp.simulated.step_time);
    js.set("simulated_bubble", pp.simulated.bubble_fraction);
    json::Value f = json::Value::array(), b = json::Value::array(), w = json::Value::array();
    for (size_t i = 0; i < pp.costs.f_rank.size(); ++i) {
      f.push_back(pp.costs.f_rank[i]);
      b.push_back(pp.costs.b_rank[i]);
      w.push_back(pp.costs.w_rank[i]);
    }
    js.set("f_s", f);
    js.set("b_s", b);
    js.set("w_s", w);
    r.pipeline = js;
  }
  if (!c.checkpoint_test.empty())
    r.checkpoint = loop.checkpoint_test(c.checkpoint_test, distributed);
  if (c.profile) {
    auto [text, js] = profile_step(c, loop, device.is_cuda(), distributed ? dist::rank() : 0);
    r.profile_text = std::move(text);
    r.profile = std::move(js);
  }
  r.peak_memory_mib = device.is_cuda()
                          ? static_cast<double>(Accelerator::cuda().memory_stats().peak_allocated) /
                                (1024.0 * 1024.0)
                          : peak_rss_mib();
  r.final_loss = loop.last_loss();
  for (const auto& m : model->modules(false))
    if (auto own = std::dynamic_pointer_cast<nn::OwnAttention>(m)) {
      r.attention_kernels = own->summary();
      break;
    }
  if (distributed) reduce_over_ranks(r.step_seconds, r.peak_memory_mib, r.final_loss);
  r.peak_memory_kind = device.is_cuda() ? "cuda max_memory_allocated" : "cpu peak RSS (process)";
  fill_figures(r);
  return r;
}

}  // namespace colossal::app
