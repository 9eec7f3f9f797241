// Optimizer base: grouping, masters, step bookkeeping and named state export/import.
#include "colossal/optim/optimizer.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <set>

#include "colossal/core/error.h"
#include "colossal/core/weights_epoch.h"

namespace colossal::optim {
namespace {
bool is_half(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}
}  // namespace

void Optimizer::add_param_group(std::vector<NamedParam> params, GroupOptions options) {
  COLOSSAL_CHECK_INPUT(options.lr >= 0, "optimizer: lr must be >= 0, got ", options.lr);
  COLOSSAL_CHECK_INPUT(options.weight_decay >= 0, "optimizer: weight_decay must be >= 0, got ",
                       options.weight_decay);
  COLOSSAL_CHECK_INPUT(
      options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
      "optimizer: betas must be in [0, 1), got (", options.beta1, ", ", options.beta2, ")");
  COLOSSAL_CHECK_INPUT(options.eps >= 0, "optimizer: eps must be >= 0, got ", options.eps);
  COLOSSAL_CHECK_INPUT(options.momentum >= 0, "optimizer: momentum must be >= 0, got ",
                       options.momentum);
  COLOSSAL_CHECK_INPUT(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
                       "optimizer: nesterov needs momentum > 0 and dampening = 0");
  ParamGroup g;
  g.options = options;
  for (auto& np : params) {
    COLOSSAL_CHECK(np.param.defined(), "optimizer: parameter '", np.name, "' is undefined");
    COLOSSAL_CHECK_INPUT(at::isFloatingType(np.param.scalar_type()), "optimizer: parameter '",
                         np.name, "' has non-floating dtype ", np.param.scalar_type());
    for (auto& other : groups_)
      for (auto& n : other.names)
        COLOSSAL_CHECK_INPUT(n != np.name, "optimizer: parameter name '", np.name,
                             "' registered twice");
    for (auto& n : g.names)
      COLOSSAL_CHECK_INPUT(n != np.name, "optimizer: parameter name '", np.name,
                           "' registered twice");
    if (options_.master_weights && is_half(np.param))
      masters_[np.name] = np.param.detach().to(at::kFloat).clone();
    g.names.push_back(std::move(np.name));
    g.params.push_back(std::move(np.param));
  }
  groups_.push_back(std::move(g));
}

void Optimizer::step(double grad_divisor) {
  auto plans = plan_step(
      grad_divisor, [](const at::Tensor&) { return size_t{0}; }, 1);
  run_update(plans[0]);
}

bool Optimizer::UpdatePlan::empty() const {
  for (const auto& g : groups)
    if (!g.params.empty() || !g.masters.empty()) return false;
  return true;
}

std::vector<Optimizer::UpdatePlan> Optimizer::plan_step(
    double grad_divisor, const std::function<size_t(const at::Tensor&)>& bucket_of,
    size_t buckets) {
  COLOSSAL_CHECK(grad_divisor > 0 && std::isfinite(grad_divisor),
                 "optimizer: grad_divisor must be finite and > 0, got ", grad_divisor);
  COLOSSAL_CHECK(buckets >= 1, "optimizer: plan_step needs at least one bucket");
  bump_weights_epoch();
  c10::NoGradGuard no_grad;
  std::vector<UpdatePlan> plans(buckets);
  for (auto& plan : plans) {
    plan.grad_divisor = grad_divisor;
    plan.groups.resize(groups_.size());
    for (size_t gi = 0; gi < groups_.size(); ++gi) plan.groups[gi].options = groups_[gi].options;
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    auto& g = groups_[gi];
    // Plain parameters (updated in place) and master-backed ones (fp32 master updated, working
    // weight rewritten from it) go in separate lists.
    for (size_t i = 0; i < g.params.size(); ++i) {
      const at::Tensor& p = g.params[i];
      at::Tensor grad = p.grad();
      if (!grad.defined()) continue;
      const size_t b = bucket_of(p);
      COLOSSAL_CHECK(b < buckets, "optimizer: parameter '", g.names[i], "' put in bucket ", b,
                     " of ", buckets);
      GroupUpdate& u = plans[b].groups[gi];
      ParamState& st = state_[g.names[i]];
      st.step += 1;
      // Create missing state tensors (zeros of the updated tensor's shape and dtype), except
      // those an optimizer creates lazily itself (SGD's momentum buffer is the first gradient).
      auto init_state = [&](const at::Tensor& t) {
        for (const auto& key : state_keys(g.options))
          if (!st.tensors.count(key) && key != "momentum_buffer")
            st.tensors[key] = at::zeros_like(t, at::MemoryFormat::Preserve);
      };
      auto m = masters_.find(g.names[i]);
      if (m != masters_.end()) {
        init_state(m->second);
        u.masters.push_back(m->second);
        u.master_grads.push_back(grad);
        u.working.push_back(p);  // written in place under NoGradGuard (no detach per step)
        u.master_states.push_back(&st);
      } else {
        init_state(p);
        u.params.push_back(p);
        u.grads.push_back(grad.scalar_type() == p.scalar_type() ? grad : grad.to(p.scalar_type()));
        u.states.push_back(&st);
      }
    }
  }
  return plans;
}

void Optimizer::run_update(UpdatePlan& plan) {
  c10::NoGradGuard no_grad;
  grad_divisor_ = plan.grad_divisor;
  for (auto& u : plan.groups) {
    if (!u.params.empty()) update(u.options, u.params, u.grads, u.states);
    if (!u.masters.empty() &&
        !update_masters_fused(u.options, u.masters, u.master_grads, u.master_states, u.working)) {
      for (auto& gr : u.master_grads) gr = gr.to(at::kFloat);
      update(u.options, u.masters, u.master_grads, u.master_states);
      for (size_t i = 0; i < u.masters.size(); ++i) u.working[i].copy_(u.masters[i]);
    }
  }
  grad_divisor_ = 1.0;
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& g : groups_)
    for (auto& p : g.params) {
      if (!p.grad().defined()) continue;
      if (set_to_none) {
        p.mutable_grad() = at::Tensor();
      } else {
        p.mutable_grad().detach_();
        p.mutable_grad().zero_();
      }
    }
}

void Optimizer::set_lr(double lr) {
  for (auto& g : groups_) g.options.lr = lr;
}

at::Tensor Optimizer::master(const std::string& name) const {
  auto it = masters_.find(name);
  return it == masters_.end() ? at::Tensor() : it->second;
}

void Optimizer::retain_params(const std::function<bool(const at::Tensor&)>& keep) {
  for (auto& g : groups_) {
    std::vector<std::string> names;
    std::vector<at::Tensor> params;
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (keep(g.params[i])) {
        names.push_back(g.names[i]);
        params.push_back(g.params[i]);
      } else {
        state_.erase(g.names[i]);
        masters_.erase(g.names[i]);
      }
    }
    g.names = std::move(names);
    g.params = std::move(params);
  }
}

void Optimizer::adopt_masters(const std::vector<std::pair<std::string, at::Tensor>>& masters) {
  if (!options_.master_weights) return;
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [n, t] : masters) by_name[n] = &t;
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      auto it = by_name.find(g.names[i]);
      if (it == by_name.end() || !is_half(g.params[i])) continue;
      const at::Tensor& m = *it->second;
      COLOSSAL_CHECK(m.sizes() == g.params[i].sizes(), "adopt_masters: shape of '", g.names[i],
                     "' differs");
      // Taken over without a copy when it already is fp32 on the parameter's device (the caller
      // drops its list): a second full fp32 copy would double the boost-time peak.
      masters_[g.names[i]] = m.detach().to(g.params[i].device(), at::kFloat);
    }
}

void Optimizer::sync_masters_from_params() {
  c10::NoGradGuard no_grad;
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      auto it = masters_.find(g.names[i]);
      if (it != masters_.end()) it->second.copy_(g.params[i].detach());
    }
}

const ParamState* Optimizer::state(const std::string& name) const {
  auto it = state_.find(name);
  return it == state_.end() ? nullptr : &it->second;
}

StateDict Optimizer::state_dict() const {
  StateDict out;
  json::Value scalars = json::Value::object();
  scalars.set("type", type());
  json::Value groups = json::Value::array();
  json::Value steps = json::Value::object();
  for (auto& g : groups_) {
    json::Value jg = json::Value::object();
    jg.set("lr", g.options.lr);
    jg.set("weight_decay", g.options.weight_decay);
    jg.set("beta1", g.options.beta1);
    jg.set("beta2", g.options.beta2);
    jg.set("eps", g.options.eps);
    jg.set("momentum", g.options.momentum);
    jg.set("dampening", g.options.dampening);
    jg.set("nesterov", g.options.nesterov);
    json::Value names = json::Value::array();
    for (size_t i = 0; i < g.names.size(); ++i) {
      const std::string& n = g.names[i];
      names.push_back(n);
      auto st = state_.find(n);
      if (st != state_.end()) {
        steps.set(n, st->second.step);
        for (auto& [key, t] : st->second.tensors) out.tensors.emplace_back(n + "." + key, t);
      }
      auto m = masters_.find(n);
      if (m != masters_.end()) out.tensors.emplace_back(n + ".master", m->second);
    }
    jg.set("params", std::move(names));
    groups.push_back(std::move(jg));
  }
  scalars.set("param_groups", std::move(groups));
  scalars.set("steps", std::move(steps));
  out.scalars = std::move(scalars);
  return out;
}

std::vector<GroupOptions> read_state_groups(const StateDict& sd, const Optimizer& opt) {
  const auto& s = sd.scalars;
  COLOSSAL_CHECK_INPUT(s.is_object(), "optimizer state: scalars must be an object");
  const std::string& t = s.at("type").as_string("optimizer state 'type'");
  COLOSSAL_CHECK_INPUT(t == opt.type(), "optimizer state was saved by '", t,
                       "' but this optimizer is '", opt.type(), "'");
  const auto& groups = opt.param_groups();
  const auto& jgroups = s.at("param_groups").as_array("optimizer state 'param_groups'");
  COLOSSAL_CHECK_INPUT(jgroups.size() == groups.size(), "optimizer state has ", jgroups.size(),
                       " param groups but this optimizer has ", groups.size());
  std::vector<GroupOptions> out;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& jg = jgroups[gi];
    const auto& names = jg.at("params").as_array("param_groups.params");
    COLOSSAL_CHECK_INPUT(names.size() == groups[gi].names.size(), "optimizer state group ", gi,
                         " has ", names.size(), " params but this optimizer's group has ",
                         groups[gi].names.size());
    for (size_t k = 0; k < names.size(); ++k)
      COLOSSAL_CHECK_INPUT(names[k].as_string("param name") == groups[gi].names[k],
                           "optimizer state group ", gi, " param ", k, " is '",
                           names[k].as_string(), "' but this optimizer has '", groups[gi].names[k],
                           "'");
    GroupOptions o = groups[gi].options;
    o.lr = jg.at("lr").as_double("lr");
    o.weight_decay = jg.at("weight_decay").as_double("weight_decay");
    o.beta1 = jg.at("beta1").as_double("beta1");
    o.beta2 = jg.at("beta2").as_double("beta2");
    o.eps = jg.at("eps").as_double("eps");
    o.momentum = jg.at("momentum").as_double("momentum");
    o.dampening = jg.at("dampening").as_double("dampening");
    o.nesterov = jg.at("nesterov").as_bool("nesterov");
    out.push_back(o);
  }
  return out;
}

StateDictSource::StateDictSource(const StateDict& sd) : sd_(sd) {
  for (auto& [n, t] : sd.tensors) by_name_[n] = &t;
}

bool StateDictSource::find(const std::string& name, std::vector<int64_t>* shape) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return false;
  if (shape) *shape = it->second->sizes().vec();
  return true;
}

void StateDictSource::read(const std::string& name, int64_t begin, const at::Tensor& out) const {
  auto it = by_name_.find(name);
  COLOSSAL_CHECK_INPUT(it != by_name_.end(), "optimizer state lacks tensor '", name, "'");
  at::Tensor flat = it->second->reshape({-1}).narrow(0, begin, out.numel());
  out.copy_(flat.view(out.sizes()));
}

void Optimizer::load_state_dict(const StateDict& sd) {
  load_state(StateDictSource(sd));
}

void Optimizer::load_state(const StateSource& src) {
  c10::NoGradGuard no_grad;
  StateDict header;
  header.scalars = src.scalars();
  std::vector<GroupOptions> new_opts = read_state_groups(header, *this);
  const json::Value& steps = header.scalars.at("steps");
  // Every name and shape first: nothing changes unless the whole state fits.
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    auto& g = groups_[gi];
    for (size_t i = 0; i < g.names.size(); ++i) {
      const std::string& n = g.names[i];
      auto check = [&](const std::string& key) {
        std::vector<int64_t> shape;
        COLOSSAL_CHECK_INPUT(src.find(n + "." + key, &shape), "optimizer state lacks tensor '", n,
                             ".", key, "'");
        COLOSSAL_CHECK_INPUT(at::IntArrayRef(shape) == g.params[i].sizes(),
                             "optimizer state tensor '", n, ".", key, "' has shape ",
                             at::IntArrayRef(shape), " but parameter '", n, "' needs ",
                             g.params[i].sizes());
      };
      if (masters_.count(n) && src.find(n + ".master", nullptr)) check("master");
      const json::Value* st = steps.find(n);
      if (!st) continue;
      st->as_int("steps." + n);
      for (const auto& key : state_keys(new_opts[gi])) check(key);
    }
  }
  std::map<std::string, ParamState> new_state;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    auto& g = groups_[gi];
    for (size_t i = 0; i < g.names.size(); ++i) {
      const std::string& n = g.names[i];
      const at::Tensor& p = g.params[i];
      auto m = masters_.find(n);
      at::Tensor target = m != masters_.end() ? m->second : p.detach();
      if (m != masters_.end()) {
        if (src.find(n + ".master", nullptr))
          src.read(n + ".master", 0, m->second);
        else
          m->second.copy_(p.detach());  // a checkpoint without masters
      }
      const json::Value* st = steps.find(n);
      if (!st) continue;  // never stepped
      ParamState ps;
      ps.step = st->as_int("steps." + n);
      auto old = state_.find(n);
      for (const auto& key : state_keys(new_opts[gi])) {
        // Read into the tensor this state already has (no second copy of the state).
        at::Tensor dst;
        if (old != state_.end()) {
          auto t = old->second.tensors.find(key);
          if (t != old->second.tensors.end() && t->second.sizes() == target.sizes() &&
              t->second.scalar_type() == target.scalar_type() &&
              t->second.device() == target.device() && t->second.is_contiguous())
            dst = t->second;
        }
        if (!dst.defined()) dst = at::empty(target.sizes(), target.options());
        src.read(n + "." + key, 0, dst);
        ps.tensors[key] = dst;
      }
      new_state[n] = std::move(ps);
    }
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) groups_[gi].options = new_opts[gi];
  state_ = std::move(new_state);
  // Working params follow their restored masters.
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      auto m = masters_.find(g.names[i]);
      if (m != masters_.end()) g.params[i].detach().copy_(m->second);
    }
}

}  // namespace colossal::optim
