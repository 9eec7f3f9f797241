// Optimizer base: named parameters in groups, step(), zero_grad(), optional fp32 master copies
// for bf16/fp16 working parameters, and state export/import as full-shape tensors keyed by
// parameter NAME (so a checkpoint loads into any layout) plus JSON scalars (step counts, group
// hyper-parameters).
//
// The update math lives in free functions (adamw.h, sgd.h) over plain lists of tensors, so
// ZeRO and Gemini can run it on flat shards without this class.
#pragma once

#include <ATen/core/Tensor.h>
#include <colossal/core/json.h>
#include <colossal/kernels/adamw_hyper.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace colossal::optim {

// Hyper-parameters of one group. Fields an optimizer does not use are ignored by it. lr and
// weight_decay (shared with SGD) and AdamW's beta1, beta2, eps come from kernels::AdamWHyper, the
// one definition of AdamW's hyper-parameters: a group is passed to the AdamW math as it is.
struct GroupOptions : kernels::AdamWHyper {
  double momentum = 0.0, dampening = 0.0;  // SGD
  bool nesterov = false;                   // SGD
};

struct NamedParam {
  std::string name;
  at::Tensor param;
};

struct ParamGroup {
  GroupOptions options;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
};

// Per-parameter state: named tensors (e.g. "exp_avg") of the parameter's full shape, in fp32
// when master weights are used, plus the number of steps this parameter has taken.
struct ParamState {
  std::map<std::string, at::Tensor> tensors;
  int64_t step = 0;
};

// An exported optimizer state: tensors named "<param name>.<state key>" (the fp32 master of a
// half-precision parameter is exported as "<param name>.master"), and scalars
// {"type", "param_groups": [{"lr", ..., "params": [names]}], "steps": {name: n}}.
struct StateDict {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  json::Value scalars;
};

// A full-shape state (StateDict's names and shapes) read tensor by tensor, so a load holds one
// tensor (or one rank's slice of it) beyond the optimizer's own memory: a memory-mapped
// checkpoint file (booster::FileStateSource), or a StateDict (StateDictSource).
class StateSource {
 public:
  virtual ~StateSource() = default;
  virtual const json::Value& scalars() const = 0;
  // Whether tensor `name` is present; fills its shape.
  virtual bool find(const std::string& name, std::vector<int64_t>* shape) const = 0;
  // Copies elements [begin, begin + out.numel()) of tensor `name`, flattened, into `out`
  // (converting dtype and device).
  virtual void read(const std::string& name, int64_t begin, const at::Tensor& out) const = 0;
};

class StateDictSource : public StateSource {
 public:
  explicit StateDictSource(const StateDict& sd);
  const json::Value& scalars() const override { return sd_.scalars; }
  bool find(const std::string& name, std::vector<int64_t>* shape) const override;
  void read(const std::string& name, int64_t begin, const at::Tensor& out) const override;

 private:
  const StateDict& sd_;
  std::map<std::string, const at::Tensor*> by_name_;
};

struct OptimizerOptions {
  // Keep fp32 master copies of bf16/fp16 parameters: the step updates the master and writes
  // working = master.to(working dtype). Without it half parameters are updated in place.
  bool master_weights = true;
};

class Optimizer;

// The header of a saved state checked against `opt`: the optimizer type, the number of param
// groups and each group's parameter names in order (InputError naming the first mismatch).
// Returns each group's saved hyper-parameters. Shared by Optimizer::load_state_dict and the
// ZeRO / Gemini optimizers, which lay the state tensors out their own way.
std::vector<GroupOptions> read_state_groups(const StateDict& sd, const Optimizer& opt);

class Optimizer {
 public:
  explicit Optimizer(OptimizerOptions options = {}) : options_(options) {}
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Registers parameters (names must be unique across groups).
  void add_param_group(std::vector<NamedParam> params, GroupOptions options);

  // One update with each parameter's .grad(); parameters without a gradient are skipped (their
  // step count does not advance), as in torch.optim.
  void step() { step(1.0); }
  // The same with every gradient divided by `grad_divisor` inside the update (loss-scale
  // unscaling and clipping fused into the step: no separate pass over the gradients).
  void step(double grad_divisor);

  // step(grad_divisor) in two halves, so the update of some parameters can run later or on
  // another stream (booster's overlap_step). plan_step() does the host bookkeeping of a step now:
  // each parameter with a gradient has its step count advanced and its state created, and is
  // put, with its gradient and a copy of its group's hyper-parameters, into the plan of bucket
  // bucket_of(param) (< buckets). run_update() launches the update kernels of one bucket's plan
  // on the current stream. Running every bucket's plan, in any order, equals step(): a
  // parameter's update reads only its own tensors. Until a plan has run, nothing may change the
  // optimizer's parameters, state or hyper-parameters it holds (run or drop it first).
  struct GroupUpdate {  // one group's share of one bucket
    GroupOptions options;
    std::vector<at::Tensor> params, grads;  // updated in place (no master)
    std::vector<ParamState*> states;
    std::vector<at::Tensor> masters, master_grads, working;  // fp32 master, working written
    std::vector<ParamState*> master_states;
  };
  struct UpdatePlan {
    double grad_divisor = 1.0;
    std::vector<GroupUpdate> groups;
    bool empty() const;
  };
  std::vector<UpdatePlan> plan_step(double grad_divisor,
                                    const std::function<size_t(const at::Tensor&)>& bucket_of,
                                    size_t buckets);
  void run_update(UpdatePlan& plan);

  // Sets grads to undefined (set_to_none) or zeroes them in place.
  void zero_grad(bool set_to_none = true);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  void set_lr(double lr);  // every group

  // The fp32 master of a half parameter (undefined when it has none).
  at::Tensor master(const std::string& name) const;
  // Re-copies every master from its working parameter (after a model checkpoint load).
  void sync_masters_from_params();
  // Takes fp32 masters for parameters that were cast to bf16/fp16 after they were added (the
  // Booster casts the model at boost time): `masters` holds (name, fp32 value before the cast).
  // Names that are not half parameters of this optimizer are ignored. An fp32 tensor already on
  // its parameter's device is taken over, not copied: the caller must not write to it after.
  void adopt_masters(const std::vector<std::pair<std::string, at::Tensor>>& masters);

  const ParamState* state(const std::string& name) const;
  // Keeps only the parameters `keep` says yes to (by tensor), dropping the others with their
  // state and masters; groups stay (possibly empty), so schedulers see the same groups. A
  // pipeline stage holds only its blocks' parameters of an optimizer built over the whole model.
  void retain_params(const std::function<bool(const at::Tensor&)>& keep);

  virtual const char* type() const = 0;
  StateDict state_dict() const;
  // Loads a state exported by state_dict() of an optimizer of the same type over parameters
  // with the same names and shapes (any device). Missing or mismatched entries are InputErrors.
  void load_state_dict(const StateDict& state);
  // The same, read tensor by tensor: existing state tensors are overwritten in place, so the
  // load needs no second copy of the state. Every name and shape is checked before anything
  // changes; only a failing read() can leave the state partly loaded.
  void load_state(const StateSource& source);

 protected:
  // Updates the given parameters of `group`: `params` are the tensors to write (fp32 masters
  // where present), `grads` their gradients in the same dtype, `states` their states (step
  // already incremented).
  virtual void update(const GroupOptions& group, std::vector<at::Tensor>& params,
                      std::vector<at::Tensor>& grads, std::vector<ParamState*>& states) = 0;
  // The master-weight path in one pass where the optimizer has a kernel for it: updates the fp32
  // `masters` from `grads` in the parameters' own dtype (bf16/fp16/fp32, not upcast) and writes
  // `working` (the model's parameters) from the new masters. Returns false to take the generic
  // path instead (grads upcast to fp32, update(), working.copy_(master)).
  virtual bool update_masters_fused(const GroupOptions& group,
                                    const std::vector<at::Tensor>& masters,
                                    const std::vector<at::Tensor>& grads,
                                    std::vector<ParamState*>& states,
                                    const std::vector<at::Tensor>& working) {
    return false;
  }
  // State keys this optimizer keeps for every parameter that has stepped.
  virtual std::vector<std::string> state_keys(const GroupOptions& group) const = 0;
  // The divisor of the step in progress (1 = none); update() implementations apply it.
  double grad_divisor() const { return grad_divisor_; }

 private:
  OptimizerOptions options_;
  std::vector<ParamGroup> groups_;
  std::map<std::string, ParamState> state_;
  std::map<std::string, at::Tensor> masters_;
  double grad_divisor_ = 1.0;
};

}  // namespace colossal::optim
