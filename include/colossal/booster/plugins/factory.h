// The one plugin factory: a plugin by name from the typed option structs, for every program
// that picks its strategy from a config (`colossal train --plugin`, `colossal bench -p`). An
// unknown name is an InputError listing the valid ones.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "colossal/booster/plugins/ddp_plugin.h"
#include "colossal/booster/plugins/gemini_plugin.h"
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

  // --plugin (with `alias`, e.g. "-p", when not empty), then the ddp, zero and gemini fields,
  // all under section "plugin".
  void register_options(OptionSet& set, const std::string& alias = "");
  // The name is a plugin's, the precision is known, zero1 is not contradicted by --stage.
  void validate() const;
};

// none, ddp, low_level_zero, zero1, zero2, gemini, gemini_auto.
const std::vector<std::string>& plugin_names();
bool is_plugin_name(const std::string& name);
std::string plugin_names_text();  // "none, ddp, ..., gemini or gemini_auto"

// The plugin `options.name` names, on `device` ("cpu" | "cuda"), over `comm` (default: the
// world of dist::init()):
//   none            NonePlugin (one process)
//   ddp             DDPPlugin
//   low_level_zero  LowLevelZeroPlugin at zero.stage; zero1 / zero2 at stage 1 / 2
//   gemini          GeminiPlugin with gemini.placement_policy; gemini_auto with "auto"
// (ColossalAI's benchmark names zero1/zero2/gemini_auto; the option structs keep its plugins'.)
std::shared_ptr<Plugin> make_plugin(const PluginOptions& options, const std::string& device,
                                    dist::Communicator comm = {});
// The same over a run's parallel layout: the plugin gets the data-parallel axis of `dims`.
// Today's plugins are data parallel, so every other degree must be 1: an InputError naming the
// degrees otherwise (tensor, sequence and pipeline layouts are the hybrid plugin's).
std::shared_ptr<Plugin> make_plugin(const PluginOptions& options, const std::string& device,
                                    dist::ParallelDims& dims);

}  // namespace colossal::booster
