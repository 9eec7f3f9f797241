// `colossal bench`: ColossalAI's Llama training benchmark flags (examples/language/llama/
// benchmark.py) on our Booster. Prints the report to stdout (and a `RESULT {json}` line, as
// bench/hf_llama_baseline.py does); --json FILE writes the same JSON. Under `colossal run`
// every rank trains and rank 0 reports.
#include <cstdio>
#include <fstream>
#include <string>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/app/bench.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/dist/runtime.h"

namespace {

using colossal::InputError;

// Flags of ColossalAI's benchmark that need plugins we do not have yet: only their trivial
// values are accepted.
void check_trivial(const colossal::cli::Args& a) {
  auto need_i = [&](const char* name, int64_t ok, const char* what) {
    if (a.i64(name) != ok)
      throw InputError(colossal::str("--", name, " ", a.i64(name), ": ", what,
                                     " is not available in colossal.cpp yet (only --", name, " ",
                                     ok, ")"));
  };
  need_i("tp", 1, "tensor parallelism (the 3d plugin)");
  need_i("pp", 1, "pipeline parallelism (the 3d plugin)");
  need_i("sp", 1, "sequence parallelism (the 3d plugin)");
  need_i("extra_dp", 1, "extra data parallelism (gemini/3d)");
  need_i("mbs", 1, "pipeline micro-batches (the 3d plugin)");
  need_i("zero", 0, "ZeRO inside the 3d plugin (use -p zero1/zero2)");
  need_i("n_chunks", 1, "interleaved pipeline chunks (the 3d plugin)");
  const std::string style = a.str("pp_style");
  if (style != "1f1b") {
    if (style == "interleaved" || style == "zbv")
      throw InputError("--pp_style " + style +
                       ": pipeline schedules are not available in colossal.cpp yet");
    throw InputError("--pp_style must be 1f1b, interleaved or zbv, got '" + style + "'");
  }
  const std::string sp_mode = a.str("sp_mode");
  if (sp_mode != "all_to_all" && sp_mode != "split_gather" && sp_mode != "ring" &&
      sp_mode != "ring_attn")
    throw InputError("--sp_mode must be split_gather, ring, all_to_all or ring_attn, got '" +
                     sp_mode + "'");
  for (const char* f : {"custom_ckpt", "nsys", "use_fp8_comm", "use_fp8"})
    if (a.on(f)) throw InputError(colossal::str("--", f, " is not available in colossal.cpp yet"));
  const double w = a.f64("warmup_ratio");
  if (!(w >= 0.0 && w <= 1.0))
    throw InputError(
        colossal::str("-w/--warmup_ratio must be in [0, 1], got ", a.str("warmup_ratio")));
}

int run_bench(int argc, char** argv) {
  colossal::cli::Args a("bench", "ColossalAI's Llama training benchmark (random tokens)");
  a.option("config", "model preset (tiny|100m|1b|7b|13b|70b...) or an HF config.json", "7b", false,
           "-c")
      .option("plugin",
              "none | ddp | low_level_zero | zero1 | zero2 | gemini | gemini_auto (fsdp, "
              "fsdp_cpu, 3d, 3d_cpu: not available yet)",
              "ddp", false, "-p")
      .option("batch_size", "batch per data-parallel rank", "2", false, "-b")
      .option("num_steps", "steps in all (timed + ignored)", "5", false, "-s")
      .option("ignore_steps", "first steps not timed", "2", false, "-i")
      .flag("grad_checkpoint", "activation checkpointing (recompute every decoder layer)", "-g")
      .option("ckpt_mode",
              "recompute mode: full (every layer) or attention (selective); implies -g", "")
      .option("max_length", "sequence length", "4096", false, "-l")
      .option("warmup_ratio", "gemini_auto: share of non-model memory planned for warm-up", "0.8",
              false, "-w")
      .option("memory_limit", "accepted and unused, as in ColossalAI", "", false, "-m")
      .flag("xformers", "flash attention: SDPA already picks its flash kernel on GPU", "-x")
      .option("precision", "fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)", "")
      .option("device", "cpu | cuda (default: cuda when a GPU is visible)", "")
      .option("seed", "seed of the random tokens and the initial weights", "42")
      .option("json", "also write the report as JSON to this file (rank 0)", "")
      .flag("overlap_allgather", "low_level_zero: background weight all-gather")
      .option("fused_ce", "loss by chunked fused linear + cross-entropy (true|false)", "true")
      .option("fused_kernels", "fused RMSNorm, rotary, SwiGLU and AdamW kernels (true|false)",
              "true")
      .option("ckpt_layers", "recompute only the first N decoder layers (with -g/--ckpt_mode)",
              "-1")
      .option("attn_backend", "SDPA backend: auto | flash | cudnn | efficient | math", "auto")
      .flag("cuda_graph", "capture forward + backward once, replay it every timed step (cuda)")
      .option("ce_chunk_tokens", "tokens per chunk of the fused cross-entropy", "1024")
      .option("tp", "tensor parallel size (only 1)", "1")
      .option("sp", "sequence parallel size (only 1)", "1")
      .option("sp_mode", "sequence parallel mode", "all_to_all")
      .option("extra_dp", "extra data parallel size (only 1)", "1")
      .option("pp", "pipeline stages (only 1)", "1")
      .option("mbs", "pipeline micro-batch size (only 1)", "1")
      .option("zero", "ZeRO stage inside 3d (only 0)", "0")
      .option("pp_style", "pipeline schedule (only 1f1b)", "1f1b")
      .option("n_chunks", "interleaved chunks (only 1)", "1")
      .option("shard_param_frac", "gemini static: fraction of chunks sharded", "1.0")
      .option("offload_optim_frac", "gemini static: fraction of optimizer chunks on the host",
              "0.0")
      .option("offload_param_frac", "gemini static: fraction of parameter chunks on the host",
              "0.0")
      .option("prefetch_num", "gemini: chunks prefetched ahead of use", "0")
      .option("overlap_cpu_adam",
              "gemini: CPU Adam of host chunks beside the next forward (true|false)", "true")
      .flag("custom_ckpt", "3d's custom layer split (not available)")
      .flag("profile",
            "record one extra untimed step with the Kineto profiler: kernel table in "
            "the report, Chrome trace in --profile_dir")
      .option("profile_dir", "--profile: folder of the Chrome traces (rank<r>.json)", "profile")
      .flag("nsys", "nsys ranges (not available)")
      .flag("disable_async_reduce", "Gemini only: accepted, no effect on our plugins")
      .flag("no_cache", "Gemini only: accepted, no effect on our plugins")
      .flag("overlap_p2p", "3d only: accepted, no effect on our plugins")
      .flag("use_fp8_comm", "fp8 communication (not available)")
      .flag("use_fp8", "fp8 linear layers (not available)");
  a.parse(argc, argv);

  colossal::booster::BenchConfig c;
  c.model = a.str("config");
  c.plugin = a.str("plugin");
  for (const char* p : {"fsdp", "fsdp_cpu", "3d", "3d_cpu"})
    if (c.plugin == p)
      throw InputError("-p " + c.plugin +
                       ": this ColossalAI plugin is not available in colossal.cpp yet (use none, "
                       "ddp, low_level_zero, zero1 or zero2)");
  check_trivial(a);
  c.batch = a.i64("batch_size");
  c.steps = a.i64("num_steps");
  c.warmup = a.i64("ignore_steps");
  c.seq_len = a.i64("max_length");
  c.seed = a.i64("seed");
  c.checkpointing = a.given("ckpt_mode")      ? a.str("ckpt_mode")
                    : a.on("grad_checkpoint") ? "full"
                                              : "none";
  if (c.checkpointing == "none" && a.given("ckpt_mode"))
    throw InputError("--ckpt_mode must be full or attention (leave out -g for none)");
  c.flash_attention = a.on("xformers");
  c.overlap_allgather = a.on("overlap_allgather");
  c.fused_ce = a.on("fused_ce");
  c.fused_kernels = a.on("fused_kernels");
  c.ckpt_layers = a.i64("ckpt_layers");
  if (a.given("ckpt_layers") && c.checkpointing == "none")
    throw InputError("--ckpt_layers needs -g or --ckpt_mode (it says how many layers recompute)");
  c.attn_backend = a.str("attn_backend");
  c.cuda_graph = a.on("cuda_graph");
  c.profile = a.on("profile");
  c.profile_dir = a.str("profile_dir");
  if (a.given("profile_dir") && !c.profile) throw InputError("--profile_dir needs --profile");
  c.shard_param_frac = a.f64("shard_param_frac");
  c.offload_optim_frac = a.f64("offload_optim_frac");
  c.offload_param_frac = a.f64("offload_param_frac");
  c.prefetch_num = a.i64("prefetch_num");
  c.overlap_cpu_adam = a.on("overlap_cpu_adam");
  c.warmup_ratio = a.f64("warmup_ratio");
  c.ce_chunk_tokens = a.i64("ce_chunk_tokens");
  c.precision = a.has("precision") ? a.str("precision") : "";
  c.device = a.has("device") ? a.str("device") : "";
  if (c.device.empty()) c.device = colossal::Accelerator::cuda().available() ? "cuda" : "cpu";
  // ColossalAI's default model (-c 7b) is a GPU benchmark; on a CPU it would need ~100 GB.
  // Without an explicit -c, a CPU run benchmarks the tiny preset and says so.
  if (!a.given("config") && c.device == "cpu") {
    c.model = "tiny";
    colossal::log_warn(
        "colossal bench: no -c given and running on the CPU: using -c tiny (ColossalAI's default "
        "7b needs a GPU)");
  }
  c.validate();
  for (const char* f : {"disable_async_reduce", "no_cache", "overlap_p2p"})
    if (a.on(f))
      colossal::log_warn("--", f,
                         " applies to ColossalAI's gemini/3d plugins only: no effect here");

  colossal::dist::Session session;
  colossal::booster::BenchReport r = colossal::booster::run_bench(c);
  if (colossal::dist::rank() == 0) {
    std::fputs(r.to_text().c_str(), stdout);
    std::printf("RESULT %s\n", r.to_json().dump().c_str());
    std::fflush(stdout);
    const std::string path = a.has("json") ? a.str("json") : "";
    if (!path.empty()) {
      std::ofstream f(path);
      COLOSSAL_CHECK_INPUT(f, "--json: cannot write ", path);
      f << r.to_json().dump(2) << "\n";
      COLOSSAL_CHECK_INPUT(f.good(), "--json: writing ", path, " failed");
    }
  }
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("bench", "ColossalAI's Llama training benchmark: tokens/s, TFLOPS, MFU, memory",
                 run_bench);
