// Test driver for the Python oracle tests: runs this project's optimizers, LR schedules and
// gradient clipping on inputs given as raw float32 files and writes the results back the same
// way, so pytest can compare them with torch.optim / HF transformers / torch.nn.utils.
//   optim_tool optim <dir>   reads <dir>/spec.json, param_<name>.f32, grad_<step>_<name>.f32
//                            (absent = no grad that step); writes out_<name>.f32 (+ master_)
//   optim_tool lr <kind> <warmup> <total> <min_ratio> <cycles> <steps>  prints lrs as JSON
//   optim_tool clip <dir>    reads spec.json {"names","shapes","scale","max_norm","dtype"},
//                            grad_<name>.f32; writes out_<name>.f32 and result.json
#include <ATen/ATen.h>

#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "colossal/amp/grad_scaler.h"
#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/lr_scheduler.h"
#include "colossal/optim/sgd.h"

using namespace colossal;

namespace {
std::vector<int64_t> shape_of(const json::Value& v) {
  std::vector<int64_t> s;
  for (auto& x : v.as_array()) s.push_back(x.as_int());
  return s;
}
bool exists(const std::string& p) {
  return std::ifstream(p).good();
}
at::Tensor read_f32(const std::string& path, const std::vector<int64_t>& shape) {
  std::ifstream f(path, std::ios::binary);
  COLOSSAL_CHECK(f.good(), "cannot open ", path);
  at::Tensor t = at::empty(shape, at::kFloat);
  f.read(reinterpret_cast<char*>(t.data_ptr<float>()), t.numel() * 4);
  COLOSSAL_CHECK(f.gcount() == t.numel() * 4, "short file ", path);
  return t;
}
void write_f32(const std::string& path, const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kFloat).contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * 4);
}
at::ScalarType dtype_of(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16") return at::kHalf;
  throw InputError("bad dtype " + s);
}

int run_optim(const std::string& dir) {
  json::Value spec = json::parse_file(dir + "/spec.json");
  const std::string& type = spec.at("optimizer").as_string();
  at::ScalarType dt = dtype_of(spec.at("dtype").as_string());
  optim::OptimizerOptions oo;
  oo.master_weights = spec.at("master_weights").as_bool();
  std::unique_ptr<optim::Optimizer> opt;
  if (type == "adamw") {
    const std::string& impl = spec.at("impl").as_string();
    auto im = impl == "fused"     ? optim::AdamWImpl::Fused
              : impl == "foreach" ? optim::AdamWImpl::ForEach
                                  : optim::AdamWImpl::Auto;
    opt = std::make_unique<optim::AdamW>(oo, im);
  } else {
    opt = std::make_unique<optim::SGD>(oo);
  }
  std::vector<std::pair<std::string, at::Tensor>> all;
  for (auto& g : spec.at("groups").as_array()) {
    optim::GroupOptions go;
    go.lr = g.at("lr").as_double();
    go.weight_decay = g.at("weight_decay").as_double();
    if (auto* v = g.find("beta1")) go.beta1 = v->as_double();
    if (auto* v = g.find("beta2")) go.beta2 = v->as_double();
    if (auto* v = g.find("eps")) go.eps = v->as_double();
    if (auto* v = g.find("momentum")) go.momentum = v->as_double();
    if (auto* v = g.find("dampening")) go.dampening = v->as_double();
    if (auto* v = g.find("nesterov")) go.nesterov = v->as_bool();
    std::vector<optim::NamedParam> ps;
    for (auto& p : g.at("params").as_array()) {
      std::string name = p.at("name").as_string();
      at::Tensor t = read_f32(dir + "/param_" + name + ".f32", shape_of(p.at("shape"))).to(dt);
      t.set_requires_grad(true);
      ps.push_back({name, t});
      all.emplace_back(name, t);
    }
    opt->add_param_group(std::move(ps), go);
  }
  int64_t steps = spec.at("steps").as_int();
  for (int64_t s = 0; s < steps; ++s) {
    opt->zero_grad(true);
    for (auto& [name, t] : all) {
      std::string gp = dir + "/grad_" + std::to_string(s) + "_" + name + ".f32";
      if (exists(gp)) t.mutable_grad() = read_f32(gp, t.sizes().vec()).to(dt);
    }
    opt->step();
  }
  for (auto& [name, t] : all) {
    write_f32(dir + "/out_" + name + ".f32", t);
    at::Tensor m = opt->master(name);
    if (m.defined()) write_f32(dir + "/master_" + name + ".f32", m);
  }
  return 0;
}

int run_lr(char** argv) {
  optim::LRScheduleOptions o;
  o.kind = optim::schedule_kind_from_string(argv[0]);
  o.warmup_steps = std::stoll(argv[1]);
  o.total_steps = std::stoll(argv[2]);
  o.min_lr_ratio = std::stod(argv[3]);
  o.num_cycles = std::stod(argv[4]);
  int64_t steps = std::stoll(argv[5]);
  at::Tensor p = at::zeros({2});
  optim::SGD sgd;
  optim::GroupOptions go;
  go.lr = 0.1;
  sgd.add_param_group({{"p", p}}, go);
  optim::LRScheduler sched(sgd, o);
  json::Value out = json::Value::array();
  for (int64_t s = 0; s < steps; ++s) {
    out.push_back(sched.lrs()[0]);
    sched.step();
  }
  std::cout << out.dump() << "\n";
  return 0;
}

int run_clip(const std::string& dir) {
  json::Value spec = json::parse_file(dir + "/spec.json");
  at::ScalarType dt = dtype_of(spec.at("dtype").as_string());
  std::vector<at::Tensor> grads;
  const auto& names = spec.at("names").as_array();
  const auto& shapes = spec.at("shapes").as_array();
  for (size_t i = 0; i < names.size(); ++i)
    grads.push_back(
        read_f32(dir + "/grad_" + names[i].as_string() + ".f32", shape_of(shapes[i])).to(dt));
  auto r =
      amp::unscale_and_clip(grads, spec.at("scale").as_double(), spec.at("max_norm").as_double());
  for (size_t i = 0; i < names.size(); ++i)
    write_f32(dir + "/out_" + names[i].as_string() + ".f32", grads[i]);
  json::Value res = json::Value::object();
  res.set("overflow", r.overflow);
  res.set("norm", r.overflow ? -1.0 : r.norm);
  std::ofstream(dir + "/result.json") << res.dump() << "\n";
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "optim" && argc == 3) return run_optim(argv[2]);
    if (mode == "lr" && argc == 8) return run_lr(argv + 2);
    if (mode == "clip" && argc == 3) return run_clip(argv[2]);
    std::cerr << "usage: optim_tool optim <dir> | lr <kind> <warmup> <total> <min_ratio> <cycles> "
                 "<steps> | "
                 "clip <dir>\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "optim_tool: " << e.what() << "\n";
    return 1;
  }
}
