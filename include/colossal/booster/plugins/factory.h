// The one plugin factory: a plugin by name from the typed option structs, for every program
// that picks its strategy from a config (`colossal train --plugin`, `colossal bench -p`). An
// unknown name is an InputError listing the valid ones.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/booster/plugins/gemini_plugin.h"
#include "colossal/booster/plugins/hybrid_plugin.h"
#include "colossal/booster/plugins/low_level_zero_plugin.h"

namespace colossal {
class OptionSet;
}
namespace colossal::dist {
class ParallelDims;
}

namespace colossal::booster {

// Every plugin's options; `name` picks which of them apply. The precision and the loss scale
// are ddp's fields and the gradient communication dtype is zero's, whatever plugin runs: one
// flag each (--precision, --initial_scale, ..., --communication_dtype).
struct PluginOptions {
  std::string name = "ddp";  // --plugin
  DDPOptions ddp;
  ZeroOptions zero;            // low_level_zero / zero1 / zero2
  GeminiPluginOptions gemini;  // gemini / gemini_auto
  HybridOptions hybrid;        // hybrid / 3d

  // --plugin (with `alias`, e.g. "-p", when not empty), then the ddp, zero and gemini fields,
  // all under section "plugin".
  void register_options(OptionSet& set, const std::string& alias = "");
  // The name is a plugin's, the precision is known, zero1 is not contradicted by --stage, the
  // hybrid layout flags (--tp, --sp, --pp, --sp_mode, --zero_stage) are not given to another
  // plugin.
  void validate() const;
};

// none, ddp, low_level_zero, zero1, zero2, gemini, gemini_auto, hybrid, 3d.
const std::vector<std::string>& plugin_names();
bool is_plugin_name(const std::string& name);
std::string plugin_names_text();  // "none, ddp, ..., gemini or gemini_auto"

// The plugin `options.name` names, on `device` ("cpu" | "cuda"), over `comm` (default: the
// world of dist::init()):
//   none            NonePlugin (one process)
//   ddp             DDPPlugin
//   low_level_zero  LowLevelZeroPlugin at zero.stage; zero1 / zero2 at stage 1 / 2
//   gemini          GeminiPlugin with gemini.placement_policy; gemini_auto with "auto"
//   hybrid, 3d      HybridParallelPlugin over a ParallelDims of the world from options.hybrid
//                   (`comm` must be invalid: its mesh spans the world)
// (ColossalAI's benchmark names zero1/zero2/gemini_auto; the option structs keep its plugins'.)
std::shared_ptr<Plugin> make_plugin(const PluginOptions& options, const std::string& device,
                                    dist::Communicator comm = {});
// The same over a run's parallel layout: the plugin gets the data-parallel axis of `dims`.
// Today's plugins are data parallel, so every other degree must be 1: an InputError naming the
// degrees otherwise (tensor, sequence and pipeline layouts are the hybrid plugin's).
// hybrid / 3d run over `dims` (whose degrees must be options.hybrid.degrees(world)); `dims`
// must outlive the plugin.
std::shared_ptr<Plugin> make_plugin(const PluginOptions& options, const std::string& device,
                                    dist::ParallelDims& dims);
// The same, the plugin sharing ownership of `dims`.
std::shared_ptr<Plugin> make_plugin(const PluginOptions& options, const std::string& device,
                                    std::shared_ptr<dist::ParallelDims> dims);
// Whether `name` is the hybrid plugin ("hybrid" or ColossalAI's benchmark name "3d").
bool is_hybrid_plugin(const std::string& name);
// options.hybrid with the fields shared with the other plugins (precision, loss scale, ddp
// bucket, communication dtype, overlap, cpu offload) and `device` filled in.
HybridOptions hybrid_options(const PluginOptions& options, const std::string& device);

}  // namespace colossal::booster
