// `colossal bench`: ColossalAI's Llama training benchmark flags (examples/language/llama/
// benchmark.py) on our Booster. Prints the report to stdout (and a `RESULT {json}` line, as
// bench/hf_llama_baseline.py does); --json FILE writes the same JSON. Under `colossal run`
// every rank trains and rank 0 reports. The flags come from the typed structs
// (app::BenchConfig, booster::PluginOptions) through one OptionSet, ColossalAI's names as
// aliases; --tp/--sp/--sp_mode/--pp/--zero/--pp_style/--n_chunks/--mbs are the hybrid (3d)
// plugin's own options (with --pp > 1 and neither --mbs nor --num_microbatches, --mbs 1 as in
// ColossalAI's benchmark), the other 3d flags are accepted at their trivial values only.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "colossal/app/bench.h"
#include "colossal/core/error.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/dist/runtime.h"

namespace {

using colossal::InputError;

// Flags of ColossalAI's benchmark that need what we do not have yet (extra dp; --use_fp8 itself
// is BenchConfig's; --use_fp8_comm sets the plugins' --fp8_communication):
// only their trivial values are accepted; the Gemini/3d tuning switches are accepted and warned
// about.
struct HybridFlags {
  int64_t extra_dp = 1;
  std::string memory_limit;
  bool custom_ckpt = false, nsys = false, use_fp8_comm = false;
  bool disable_async_reduce = false, no_cache = false, overlap_p2p = false;

  void register_options(colossal::OptionSet& s) {
    s.add("3d", "extra_dp", &extra_dp, "extra data parallel size (only 1)")
        .add("3d", "custom_ckpt", &custom_ckpt, "3d's custom layer split (not available)")
        .add("3d", "nsys", &nsys, "nsys ranges (not available)")
        .add("3d", "use_fp8_comm", &use_fp8_comm,
             "fp8 communication: the same as --fp8_communication (ddp, zero1/2, gemini)")
        .add("3d", "disable_async_reduce", &disable_async_reduce,
             "Gemini only: accepted, no effect on our plugins")
        .add("3d", "no_cache", &no_cache, "Gemini only: accepted, no effect on our plugins")
        .add("3d", "overlap_p2p", &overlap_p2p, "3d only: accepted, no effect on our plugins")
        .add("3d", "memory_limit", &memory_limit, "accepted and unused, as in ColossalAI")
        .alias("memory_limit", "-m");
  }

  void check() const {
    auto need = [](const char* name, int64_t value, int64_t ok, const char* what) {
      if (value != ok)
        throw InputError(colossal::str("--", name, " ", value, ": ", what,
                                       " is not available in colossal.cpp yet (only --", name, " ",
                                       ok, ")"));
    };
    need("extra_dp", extra_dp, 1, "extra data parallelism (gemini/3d)");
    for (auto [name, on] : {std::pair{"custom_ckpt", custom_ckpt}, std::pair{"nsys", nsys}})
      if (on) throw InputError(colossal::str("--", name, " is not available in colossal.cpp yet"));
  }

  void warn() const {
    for (auto [name, on] : {std::pair{"disable_async_reduce", disable_async_reduce},
                            std::pair{"no_cache", no_cache}, std::pair{"overlap_p2p", overlap_p2p}})
      if (on)
        colossal::log_warn("--", name,
                           " applies to ColossalAI's gemini/3d plugins only: no effect here");
  }
};

int run_bench(int argc, char** argv) {
  colossal::app::BenchConfig c;
  HybridFlags hybrid;
  std::string json_path;
  colossal::OptionSet options;
  c.register_options(options);
  options.add("output", "json", &json_path, "also write the report as JSON to this file (rank 0)");
  hybrid.register_options(options);
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: colossal bench [options]\n"
          "ColossalAI's Llama training benchmark (random tokens). Names after a comma are\n"
          "ColossalAI's benchmark flags; [default] in brackets.\n%s",
          options.help().c_str());
      return 0;
    }
  }
  options.apply_flags(args);

  for (const char* p : {"fsdp", "fsdp_cpu", "3d_cpu"})
    if (c.plugin.name == p)
      throw InputError("-p " + c.plugin.name +
                       ": this ColossalAI plugin is not available in colossal.cpp yet (use none, "
                       "ddp, low_level_zero, zero1, zero2, gemini, gemini_auto or 3d)");
  hybrid.check();
  if (hybrid.use_fp8_comm) c.plugin.ddp.fp8_communication = true;
  {
    colossal::booster::HybridOptions& h = c.plugin.hybrid;
    if (h.pp_size > 1 && h.num_microbatches == 0 && h.microbatch_size == 0) h.microbatch_size = 1;
  }
  c.resolve(options);
  // The benchmark's own messages first (they name ColossalAI's flags), then every remaining
  // range and choice of the option structs.
  c.validate();
  options.validate();
  hybrid.warn();

  colossal::dist::Session session;
  colossal::app::BenchReport r = colossal::app::run_bench(c);
  if (colossal::dist::rank() == 0) {
    std::fputs(r.to_text().c_str(), stdout);
    std::printf("RESULT %s\n", r.to_json().dump().c_str());
    std::fflush(stdout);
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      COLOSSAL_CHECK_INPUT(f, "--json: cannot write ", json_path);
      f << r.to_json().dump(2) << "\n";
      COLOSSAL_CHECK_INPUT(f.good(), "--json: writing ", json_path, " failed");
    }
  }
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("bench", "ColossalAI's Llama training benchmark: tokens/s, TFLOPS, MFU, memory",
                 run_bench);
