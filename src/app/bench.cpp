// `colossal bench`'s loop and report (see bench.h).
#include "colossal/app/bench.h"

#include <ATen/ATen.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <numeric>

#include "colossal/booster/booster.h"
#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/booster/plugins/gemini_plugin.h"
#include "colossal/booster/plugins/low_level_zero_plugin.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/core/profiler.h"
#include "colossal/dist/runtime.h"
#include "colossal/kernels/fused.h"
#include "colossal/nn/causal_lm.h"
#include "colossal/nn/checkpointing.h"
#include "colossal/nn/config.h"
#include "colossal/nn/init.h"
#include "colossal/optim/adamw.h"

namespace colossal::booster {

void BenchConfig::validate() const {
  COLOSSAL_CHECK_INPUT(batch >= 1, "-b/--batch_size must be >= 1, got ", batch);
  COLOSSAL_CHECK_INPUT(seq_len >= 2, "-l/--max_length must be >= 2, got ", seq_len);
  COLOSSAL_CHECK_INPUT(warmup >= 0, "-i/--ignore_steps must be >= 0, got ", warmup);
  COLOSSAL_CHECK_INPUT(steps > warmup, "-s/--num_steps (", steps,
                       ") must exceed -i/--ignore_steps (", warmup,
                       "): at least one step is timed");
  COLOSSAL_CHECK_INPUT(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '",
                       device, "'");
  COLOSSAL_CHECK_INPUT(plugin == "none" || plugin == "ddp" || plugin == "low_level_zero" ||
                           plugin == "zero1" || plugin == "zero2" || plugin == "gemini" ||
                           plugin == "gemini_auto",
                       "-p/--plugin '", plugin,
                       "' is not a plugin of colossal.cpp: use none, ddp, low_level_zero, zero1, "
                       "zero2, gemini or gemini_auto");
  if (!precision.empty()) precision_from_string(precision);
  nn::checkpoint_mode_from_string(checkpointing);
  const bool gemini = plugin == "gemini" || plugin == "gemini_auto";
  if (!gemini)
    COLOSSAL_CHECK_INPUT(shard_param_frac == 1.0 && offload_optim_frac == 0.0 &&
                             offload_param_frac == 0.0 && prefetch_num == 0 && overlap_cpu_adam,
                         "--shard_param_frac/--offload_optim_frac/--offload_param_frac/"
                         "--prefetch_num/--overlap_cpu_adam apply to -p gemini only, not '",
                         plugin, "'");
  for (double f : {shard_param_frac, offload_optim_frac, offload_param_frac})
    COLOSSAL_CHECK_INPUT(f >= 0.0 && f <= 1.0, "Gemini placement fractions must be in [0, 1], got ",
                         f);
  COLOSSAL_CHECK_INPUT(prefetch_num >= 0, "--prefetch_num must be >= 0, got ", prefetch_num);
  if (cuda_graph) {
    COLOSSAL_CHECK_INPUT(plugin == "none" || plugin == "ddp",
                         "--cuda_graph needs -p none or ddp (the other plugins move memory and "
                         "communicate from hooks), not '",
                         plugin, "'");
    COLOSSAL_CHECK_INPUT(device == "cuda", "--cuda_graph needs --device cuda, got '", device, "'");
    COLOSSAL_CHECK_INPUT(
        warmup >= 1, "--cuda_graph needs -i/--ignore_steps >= 1 (an eager step before capture)");
    COLOSSAL_CHECK_INPUT(
        checkpointing == "none",
        "--cuda_graph with activation checkpointing is not supported (the recompute "
        "reads the RNG state on the host)");
    COLOSSAL_CHECK_INPUT(
        precision != "fp16",
        "--cuda_graph with fp16 is not supported (the loss scaler decides on the host)");
  }
  COLOSSAL_CHECK_INPUT(ckpt_layers >= -1,
                       "--ckpt_layers must be >= 0 (or -1 for every layer), got ", ckpt_layers);
  COLOSSAL_CHECK_INPUT(
      attn_backend == "auto" || attn_backend == "flash" || attn_backend == "cudnn" ||
          attn_backend == "efficient" || attn_backend == "math",
      "--attn_backend must be auto, flash, cudnn, efficient or math, got '", attn_backend, "'");
  COLOSSAL_CHECK_INPUT(ce_chunk_tokens >= 1, "--ce_chunk_tokens must be >= 1, got ",
                       ce_chunk_tokens);
  COLOSSAL_CHECK_INPUT(
      !overlap_allgather || plugin == "low_level_zero" || plugin == "zero1" || plugin == "zero2",
      "--overlap_allgather needs a low_level_zero plugin, not '", plugin, "'");
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
  c.set("plugin", config.plugin);
  c.set("precision", precision);
  c.set("device", config.device);
  c.set("grad_checkpoint", config.checkpointing);
  c.set("ckpt_layers", config.ckpt_layers);
  c.set("attn_backend", config.attn_backend);
  c.set("fused_kernels", config.fused_kernels);
  c.set("cuda_graph", config.cuda_graph);
  if (config.plugin == "gemini" || config.plugin == "gemini_auto") {
    c.set("shard_param_frac", config.shard_param_frac);
    c.set("offload_optim_frac", config.offload_optim_frac);
    c.set("offload_param_frac", config.offload_param_frac);
    c.set("prefetch_num", config.prefetch_num);
    c.set("overlap_cpu_adam", config.overlap_cpu_adam);
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
  if (config.profile) r.set("profile", profile);
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
      "grad checkpoint %s, attention %s, fused kernels %s, fused CE %s, CUDA graph %s\n"
      "  steps %lld (first %lld ignored), median step %.4f s (mean %.4f s)\n"
      "  throughput: %.1f tokens/s/GPU, %.1f tokens/s total, %.3f samples/s\n"
      "  model TFLOPS/GPU (6N + 12LhS per token, no recompute): %.3f, MFU vs 989 TFLOPS: %.4f\n"
      "  ColossalAI TFLOPS/GPU (2NBS(3+g)): %.3f; Megatron formula: %.3f\n"
      "  peak memory: %.1f MiB (%s)\n"
      "  final loss %.4f\n",
      config.model.c_str(), static_cast<double>(n_params) / 1e9, (long long)layers,
      (long long)hidden, (long long)vocab, config.plugin.c_str(), precision.c_str(),
      config.device.c_str(), world_size, dp_size, (long long)config.batch,
      (long long)config.seq_len, ckpt.c_str(), config.attn_backend.c_str(),
      config.fused_kernels ? "on" : "off", config.fused_ce ? "on" : "off",
      config.cuda_graph ? "on" : "off", (long long)config.steps, (long long)config.warmup,
      median_step_s, mean_step_s, tokens_per_s_per_gpu, tokens_per_s, samples_per_s,
      model_tflops_per_gpu, mfu_989, colossalai_tflops_per_gpu, megatron_tflops_per_gpu,
      peak_memory_mib, peak_memory_kind.c_str(), final_loss);
  return std::string(buf) + profile_text;
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

}  // namespace

BenchReport run_bench(const BenchConfig& c) {
  c.validate();
  const bool distributed = dist::is_initialized() && dist::world_size() > 1;
  const std::string precision = !c.precision.empty() ? c.precision
                                : c.device == "cuda" ? "bf16"
                                                     : "fp32";
  if (c.device == "cuda")
    COLOSSAL_CHECK_INPUT(Accelerator::cuda().available(),
                         "--device cuda: no CUDA device is visible (use --device cpu)");
  const at::Device device =
      c.device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);

  // Plugin (as `colossal train` builds it).
  DDPOptions ddp;
  ddp.precision = precision;
  ddp.device = c.device;
  std::shared_ptr<Plugin> plugin;
  if (c.plugin == "ddp") {
    plugin = std::make_shared<DDPPlugin>(ddp);
  } else if (c.plugin == "none") {
    COLOSSAL_CHECK_INPUT(!distributed,
                         "-p none runs one process; use ddp or a zero plugin under "
                         "`colossal run`");
    plugin = std::make_shared<NonePlugin>(ddp.precision, c.device, ddp.loss_scale);
  } else if (c.plugin == "gemini" || c.plugin == "gemini_auto") {
    // ColossalAI's benchmark: gemini = static placement (ZeRO-3 defaults), gemini_auto = auto.
    GeminiPluginOptions gemini;
    gemini.precision = precision;
    gemini.device = c.device;
    gemini.loss_scale = ddp.loss_scale;
    gemini.placement_policy = c.plugin == "gemini_auto" ? "auto" : "static";
    gemini.shard_param_frac = c.shard_param_frac;
    gemini.offload_optim_frac = c.offload_optim_frac;
    gemini.offload_param_frac = c.offload_param_frac;
    gemini.max_prefetch = c.prefetch_num;
    gemini.overlap_cpu_adam = c.overlap_cpu_adam;
    gemini.warmup_non_model_data_ratio = c.warmup_ratio;
    plugin = std::make_shared<GeminiPlugin>(gemini);
  } else {
    ZeroOptions zero;
    zero.stage = c.plugin == "zero2" ? 2 : 1;
    zero.precision = precision;
    zero.device = c.device;
    zero.loss_scale = ddp.loss_scale;
    zero.overlap_allgather = c.overlap_allgather;
    plugin = std::make_shared<LowLevelZeroPlugin>(zero);
  }

  // Model: built on meta, materialised on the device (values by name, as `colossal train`).
  nn::ModelConfig cfg = ::access(c.model.c_str(), F_OK) == 0 ? nn::ModelConfig::from_file(c.model)
                                                             : nn::ModelConfig::preset(c.model);
  COLOSSAL_CHECK_INPUT(c.seq_len <= cfg.max_position_embeddings, "-l ", c.seq_len,
                       " exceeds the model's max_position_embeddings ",
                       cfg.max_position_embeddings);
  auto model = std::make_shared<nn::CausalLM>(cfg, at::TensorOptions().device(at::kMeta));
  nn::InitOptions io;
  io.seed = static_cast<uint64_t>(c.seed);
  io.std = cfg.initializer_range;
  io.device = device;
  // Setup is minutes at 13b: each phase says what it took (init here, boost below).
  const bool rank0 = !distributed || dist::rank() == 0;
  auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  auto t_init = std::chrono::steady_clock::now();
  nn::init_parameters(*model, io);
  if (rank0) log_info("bench: parameters initialised on ", device, " in ", since(t_init), " s");
  const nn::CheckpointMode mode = nn::checkpoint_mode_from_string(c.checkpointing);
  model->set_activation_checkpointing(mode, c.ckpt_layers);
  kernels::set_enabled(c.fused_kernels);
  set_sdpa_backend(c.attn_backend);
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();

  auto adamw = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> params;
  for (auto& item : model->named_parameters(true)) params.push_back({item.key(), item.value()});
  optim::GroupOptions g;
  g.lr = c.lr;
  adamw->add_param_group(params, g);

  Booster booster(plugin);
  auto t_boost = std::chrono::steady_clock::now();
  Boosted boosted = booster.boost(model, adamw);
  if (rank0) log_info("bench: boost (", c.plugin, ") took ", since(t_boost), " s");
  OptimizerWrapper& opt = *boosted.optimizer;
  const int world = distributed ? dist::world_size() : 1;
  const int dp = plugin->dp_size(), dp_rank = plugin->dp_rank();

  // Random tokens, labels = inputs (HF's shift inside the loss), one batch per step.
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(c.seed) +
                                                     1000003ull * static_cast<uint64_t>(dp_rank));
  auto sync = [&] {
    if (device.is_cuda()) Accelerator::cuda().synchronize();
  };
  // --cuda_graph: everything runs on a side stream (CUDA cannot capture the default one); the
  // eager warm-up steps run there too, then forward + backward is captured once (untimed) and
  // every timed step refills the static inputs, replays it and steps the optimizer. The graph
  // writes the gradients in place, so they are never set to none between steps.
  std::unique_ptr<CudaGraph> graph;
  at::Tensor graph_ids, graph_targets, graph_loss;
  if (c.cuda_graph) {
    COLOSSAL_CHECK_INPUT(!distributed,
                         "--cuda_graph runs one process (no gradient collectives in the graph)");
    Accelerator::cuda().set_stream(Accelerator::cuda().new_stream());
  }
  auto forward_backward = [&](const at::Tensor& ids, const at::Tensor& targets) {
    at::Tensor loss = c.fused_ce ? model->forward_loss(ids, targets, c.ce_chunk_tokens)
                                 : nn::causal_lm_loss(model->forward(ids), ids);
    booster.backward(loss, opt);
    return loss;
  };
  if (device.is_cuda()) Accelerator::cuda().reset_peak_memory_stats();
  std::vector<double> times;
  double last_loss = 0;
  // One training step; returns its device-synchronised wall time.
  auto step = [&](int64_t s) {
    at::Tensor ids = at::randint(0, cfg.vocab_size, {c.batch, c.seq_len}, gen,
                                 at::TensorOptions().dtype(at::kLong))
                         .to(device);
    // Next-token targets (HF's shift; the last position has none).
    at::Tensor targets = at::constant_pad_nd(ids.narrow(1, 1, c.seq_len - 1), {0, 1}, -100);
    const bool replay = c.cuda_graph && s >= c.warmup;
    if (replay && !graph) {
      graph_ids = ids.clone();
      graph_targets = targets.clone();
      opt.zero_grad(true);
      sync();
      graph = std::make_unique<CudaGraph>();
      graph->capture([&] { graph_loss = forward_backward(graph_ids, graph_targets); });
      sync();
    }
    sync();
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor loss;
    if (replay) {
      graph_ids.copy_(ids);
      graph_targets.copy_(targets);
      graph->replay();
      loss = graph_loss;
      opt.step();
    } else {
      loss = forward_backward(ids, targets);
      opt.step();
      opt.zero_grad(true);
    }
    sync();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last_loss = loss.item<double>();
    return dt;
  };
  for (int64_t s = 0; s < c.steps; ++s) {
    const double dt = step(s);
    if (s >= c.warmup) times.push_back(dt);
  }
  // --profile: one more step (untimed, after the timed ones) under the profiler.
  std::string profile_text;
  json::Value profile_json;
  if (c.profile) {
    const int rank = distributed ? dist::rank() : 0;
    COLOSSAL_CHECK_INPUT(::mkdir(c.profile_dir.c_str(), 0755) == 0 || errno == EEXIST,
                         "--profile_dir: cannot create '", c.profile_dir, "'");
    const std::string trace = c.profile_dir + "/rank" + std::to_string(rank) + ".json";
    Profiler profiler(device.is_cuda());
    const double dt = step(c.steps);
    ProfileSummary ps = profiler.stop(trace);
    constexpr size_t kTopKernels = 40;
    profile_text = ps.to_text(dt * 1e3, kTopKernels) + "  Chrome trace: " + trace + "\n";
    profile_json = ps.to_json(dt * 1e3, kTopKernels);
    profile_json.set("trace", trace);
  }

  // Per step the slowest rank's time; peak memory the largest rank's; loss the dp mean.
  double peak = device.is_cuda()
                    ? static_cast<double>(Accelerator::cuda().memory_stats().peak_allocated) /
                          (1024.0 * 1024.0)
                    : peak_rss_mib();
  if (distributed) {
    at::Tensor t = at::tensor(times, at::TensorOptions().dtype(at::kDouble));
    dist::world_cpu().all_reduce(t, dist::ReduceOp::Max);
    for (size_t i = 0; i < times.size(); ++i) times[i] = t[static_cast<int64_t>(i)].item<double>();
    at::Tensor m = at::full({1}, peak, at::kDouble);
    dist::world_cpu().all_reduce(m, dist::ReduceOp::Max);
    peak = m.item<double>();
    at::Tensor l = at::full({1}, last_loss, at::kDouble);
    dist::world_cpu().all_reduce(l, dist::ReduceOp::Avg);
    last_loss = l.item<double>();
  }

  BenchReport r;
  r.config = c;
  r.precision = precision;
  r.n_params = n_params;
  r.layers = cfg.num_hidden_layers;
  r.hidden = cfg.hidden_size;
  r.vocab = cfg.vocab_size;
  r.world_size = world;
  r.dp_size = dp;
  r.step_seconds = times;
  r.median_step_s = median(times);
  r.mean_step_s =
      std::accumulate(times.begin(), times.end(), 0.0) / static_cast<double>(times.size());
  const double tokens = static_cast<double>(c.batch * dp * c.seq_len);
  r.tokens_per_s = tokens / r.median_step_s;
  r.tokens_per_s_per_gpu = r.tokens_per_s / world;
  r.samples_per_s = static_cast<double>(c.batch * dp) / r.median_step_s;
  // ColossalAI counts recompute (g = 1 with -g); its formula has no term for attention-only
  // recompute, which we count as g = 0.
  const double recompute = mode != nn::CheckpointMode::Full ? 0.0
                           : c.ckpt_layers < 0
                               ? 1.0
                               : static_cast<double>(c.ckpt_layers) / static_cast<double>(r.layers);
  r.flops = bench_flops(n_params, r.layers, r.hidden, r.vocab, c.batch, c.seq_len, recompute);
  r.model_tflops_per_gpu = r.tokens_per_s_per_gpu * r.flops.model_flops_per_token / 1e12;
  r.mfu_989 = r.model_tflops_per_gpu / 989.0;
  const double gpus_per_replica = static_cast<double>(world) / dp;
  r.colossalai_tflops_per_gpu =
      r.flops.colossalai_flops_per_rank_step / 1e12 / r.median_step_s / gpus_per_replica;
  r.megatron_tflops_per_gpu =
      r.flops.megatron_flops_per_rank_step / 1e12 / r.median_step_s / gpus_per_replica;
  r.peak_memory_mib = peak;
  r.peak_memory_kind = device.is_cuda() ? "cuda max_memory_allocated" : "cpu peak RSS (process)";
  r.final_loss = last_loss;
  r.profile_text = profile_text;
  r.profile = profile_json;
  return r;
}

}  // namespace colossal::booster
