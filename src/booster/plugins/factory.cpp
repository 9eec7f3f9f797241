// The plugin factory (see factory.h).
#include "colossal/booster/plugins/factory.h"

#include <algorithm>

#include "colossal/core/error.h"
#include "colossal/core/options.h"
#include "colossal/dist/parallel_dims.h"

namespace colossal::booster {

void PluginOptions::register_options(OptionSet& set, const std::string& alias) {
  set.add("plugin", "plugin", &name,
          "parallel strategy (zero1/zero2: low_level_zero at that stage; gemini_auto: gemini "
          "with auto placement)",
          plugin_names());
  if (!alias.empty()) set.alias("plugin", alias);
  ddp.register_options(set);
  zero.register_options(set);
  gemini.register_options(set);
  hybrid.register_options(set);
}

void PluginOptions::validate() const {
  COLOSSAL_CHECK_INPUT(is_plugin_name(name), "'", name, "' is not a plugin of colossal.cpp: use ",
                       plugin_names_text());
  precision_from_string(ddp.precision);
  COLOSSAL_CHECK_INPUT(is_hybrid_plugin(name) || !hybrid.non_default_layout(),
                       "--tp_size/--pp_size/--sp_size/--sequence_parallelism_mode/"
                       "--enable_sequence_parallelism/--zero_stage and the pipeline options "
                       "(--num_microbatches, --microbatch_size, --pp_style, --num_model_chunks, "
                       "...) apply to --plugin hybrid (3d) only, not '",
                       name, "'");
  if (is_hybrid_plugin(name)) {
    hybrid.validate();
    COLOSSAL_CHECK_INPUT(!zero.overlap_allgather,
                         "--overlap_allgather is not available with --plugin ", name);
  }
  COLOSSAL_CHECK_INPUT(!ddp.fp8_communication || name == "ddp" || name == "low_level_zero" ||
                           name == "zero1" || name == "zero2" || name == "gemini" ||
                           name == "gemini_auto",
                       "--fp8_communication is available with --plugin ddp, low_level_zero, "
                       "zero1, zero2, gemini or gemini_auto, not '",
                       name, "'",
                       name == "none" ? " (one process: nothing is communicated)"
                                      : " (its FP8 collectives are not wired yet)");
  COLOSSAL_CHECK_INPUT(!ddp.overlap_step || name == "ddp",
                       "--overlap_step is available with --plugin ddp (one rank or more), not '",
                       name, "'");
  COLOSSAL_CHECK_INPUT(!(name == "zero1" && zero.stage != 1), "--plugin zero1 contradicts --stage ",
                       zero.stage);
}

const std::vector<std::string>& plugin_names() {
  static const std::vector<std::string> names{
      "none", "ddp", "low_level_zero", "zero1", "zero2", "gemini", "gemini_auto", "hybrid", "3d"};
  return names;
}

bool is_plugin_name(const std::string& name) {
  const auto& n = plugin_names();
  return std::find(n.begin(), n.end(), name) != n.end();
}

std::string plugin_names_text() {
  const auto& n = plugin_names();
  std::string out;
  for (size_t i = 0; i < n.size(); ++i)
    out += (i == 0 ? "" : i + 1 == n.size() ? " or " : ", ") + n[i];
  return out;
}

bool is_hybrid_plugin(const std::string& name) {
  return name == "hybrid" || name == "3d";
}

HybridOptions hybrid_options(const PluginOptions& o, const std::string& device) {
  HybridOptions h = o.hybrid;
  h.precision = o.ddp.precision;
  h.device = device;
  h.loss_scale = o.ddp.loss_scale;
  h.ddp_bucket_cap_mb = o.ddp.bucket_cap_mb;
  h.communication_dtype = o.zero.communication_dtype;
  h.overlap_communication = o.zero.overlap_communication;
  h.cpu_offload = o.zero.cpu_offload;
  return h;
}

std::shared_ptr<Plugin> make_plugin(const PluginOptions& o, const std::string& device,
                                    dist::Communicator comm) {
  o.validate();
  const std::string& name = o.name;
  if (is_hybrid_plugin(name)) {
    COLOSSAL_CHECK_INPUT(!comm.valid(), "plugin '", name,
                         "' lays its mesh over the whole world: give it a "
                         "ParallelDims (make_plugin(options, device, dims)), not a communicator");
    return std::make_shared<HybridParallelPlugin>(hybrid_options(o, device));
  }
  if (name == "none")
    return std::make_shared<NonePlugin>(o.ddp.precision, device, o.ddp.loss_scale);
  if (name == "ddp") {
    DDPOptions ddp = o.ddp;
    ddp.device = device;
    return std::make_shared<DDPPlugin>(ddp, std::move(comm));
  }
  if (name == "gemini" || name == "gemini_auto") {
    GeminiPluginOptions gemini = o.gemini;
    gemini.precision = o.ddp.precision;
    gemini.device = device;
    gemini.loss_scale = o.ddp.loss_scale;
    gemini.communication_dtype = o.zero.communication_dtype;
    gemini.fp8_communication = o.ddp.fp8_communication;
    if (name == "gemini_auto") gemini.placement_policy = "auto";
    return std::make_shared<GeminiPlugin>(gemini, std::move(comm));
  }
  // low_level_zero, zero1, zero2. Precision and loss scale are ddp's fields (so `colossal train`
  // defaults to fp32, not ColossalAI's fp16, and to the initial scale 2**16).
  ZeroOptions zero = o.zero;
  if (name == "zero2") zero.stage = 2;
  zero.precision = o.ddp.precision;
  zero.device = device;
  zero.loss_scale = o.ddp.loss_scale;
  zero.fp8_communication = o.ddp.fp8_communication;
  return std::make_shared<LowLevelZeroPlugin>(zero, std::move(comm));
}

std::shared_ptr<Plugin> make_plugin(const PluginOptions& o, const std::string& device,
                                    dist::ParallelDims& dims) {
  if (is_hybrid_plugin(o.name))  // not owned: the caller keeps `dims` alive
    return make_plugin(o, device, std::shared_ptr<dist::ParallelDims>(&dims, [](auto*) {}));
  const dist::ParallelDegrees& d = dims.degrees();
  COLOSSAL_CHECK_INPUT(d.pp == 1 && d.tp == 1 && d.sp == 1 && d.ep == 1, "plugin '", o.name,
                       "' is data parallel only; the layout ", d.describe(),
                       " needs the hybrid plugin");
  return make_plugin(o, device, dims.dp());
}

std::shared_ptr<Plugin> make_plugin(const PluginOptions& o, const std::string& device,
                                    std::shared_ptr<dist::ParallelDims> dims) {
  COLOSSAL_CHECK(dims, "make_plugin: no ParallelDims");
  if (!is_hybrid_plugin(o.name)) return make_plugin(o, device, *dims);
  o.validate();
  return std::make_shared<HybridParallelPlugin>(hybrid_options(o, device), std::move(dims));
}

}  // namespace colossal::booster
