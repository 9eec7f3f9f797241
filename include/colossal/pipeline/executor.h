// The pipeline interpreter: one loop that runs any schedule (pipeline/schedule.h) on one
// pipeline rank. It knows nothing of models: the stage it drives is given as functions (forward
// of a micro-batch through one chunk, the chunk's parameters, the loss scaling), so GPipe, 1F1B,
// interleaved, ZB-H1, ZB-V and a user's table all run through the same code.
//
// Activations. F(m, c) runs the chunk on a detached copy of its input that requires grad (the
// stage boundary), keeps (input, output) until the backward frees them, and hands the output on:
// to the next chunk on this rank directly, or to a SendF. The last virtual stage's output is the
// micro-batch's loss (already divided by the number of micro-batches by the caller's forward);
// its backward starts from scale_loss(loss) (fp16 loss scaling).
// Backward. BW(m, c) is one autograd backward from the output with the received gradient: the
// parameters accumulate their .grad and the input's gradient is handed back. B and W split it
// (ExecutorOptions::weight_grad_store): with the store, B is the whole backward with a
// WeightGradStore open, so layers that defer (nn::Linear::set_defer_weight_grad, what the hybrid
// plugin sets for split schedules) leave their dW = dy^T x GEMMs for W, which runs exactly those;
// without it (any stage), B is autograd::grad into the input (graph kept) and W a second backward
// into the chunk's parameters, which re-walks the input-gradient chain above each weight.
// Point-to-point. Consecutive Send/Recv instructions are posted as one batch
// (Communicator::batch_p2p, asynchronously: a received tensor is waited for only by the compute
// that reads it, sends only at the end of the step). The first message of each channel (kind,
// sending virtual stage) in a step carries its metadata (dtype and shape) first, on a second
// communicator over the same ranks, so a receiver can allocate its buffer; later micro-batches
// reuse it (ColossalAI's enable_metadata_cache; off: every message carries it). Sends post their
// metadata and payload together; a receive whose metadata is not cached waits for it before
// posting its payload, and so do the later receives on the same link in that batch, keeping
// every link's payloads in instruction order on both sides (what NCCL's in-order matching needs).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "colossal/dist/communicator.h"
#include "colossal/pipeline/schedule.h"

namespace colossal::pipeline {

struct StageFunctions {
  // Forward of micro-batch `mb` through local chunk `chunk`. `input` is the received activation,
  // or undefined at virtual stage 0 (the callee reads its micro-batch's tokens). Returns the
  // chunk's output; at the last virtual stage the micro-batch's loss (a scalar, weighted for the
  // step).
  std::function<at::Tensor(int mb, int chunk, const at::Tensor& input)> forward;
  // The parameters of a chunk that receive gradients (W's targets).
  std::function<std::vector<at::Tensor>(int chunk)> parameters;
  // What the last virtual stage's backward starts from (fp16: loss * scale). Empty: the loss.
  std::function<at::Tensor(const at::Tensor& loss)> scale_loss;
};

struct ExecutorOptions {
  bool enable_metadata_cache = true;  // ColossalAI's name
  bool record_timings = false;        // keep per-instruction wall times (last_timings())
  // How B and W split the backward. true: B runs the whole backward with a WeightGradStore open
  // (layers that defer, nn::Linear::set_defer_weight_grad, leave their dW GEMMs there) and W
  // runs the stored GEMMs: W costs exactly the weight GEMMs, and everything else, including the
  // parameters no layer defers, gets its gradient in B. false: B is autograd::grad into the
  // input (graph kept) and W a second backward into the chunk's parameters, which works for any
  // stage but re-walks the input-gradient chain above each weight.
  bool weight_grad_store = false;
  at::Device device = at::kCPU;  // where received tensors are allocated
};

// One executed instruction's wall time (seconds from the start of the step).
struct InstrTiming {
  Instr instr;
  double start = 0, end = 0;
};

class Executor {
 public:
  // `pp`: the pipeline group, in stage order (its rank r runs schedule.ranks[r]). The schedule
  // is validated here (an invalid one is an InputError naming its first bad instruction).
  // Collective over `pp` (every member constructs its executor: the groups connect here).
  Executor(Schedule schedule, dist::Communicator pp, StageFunctions stage,
           ExecutorOptions options = {});

  // Runs this rank's instruction list once (one step). Returns the detached loss of every
  // micro-batch on the rank holding the last virtual stage (in micro-batch order), empty on the
  // others. Every held activation is freed by the end (a leftover is an Error).
  std::vector<at::Tensor> run();

  // Replaces the stage functions (e.g. bound to the next step's micro-batches).
  void set_stage(StageFunctions stage);

  const Schedule& schedule() const { return schedule_; }
  int rank() const { return rank_; }
  bool holds_last() const;  // this rank holds the last virtual stage (where the loss is)
  const std::vector<InstrTiming>& last_timings() const { return timings_; }
  double last_run_seconds() const { return run_seconds_; }  // wall time of the last run()
  // Most micro-batch chunks alive at once during the last run (F done, not yet freed).
  int last_peak_activations() const { return peak_; }

 private:
  struct Slot;  // one (mb, chunk)'s tensors
  Schedule schedule_;
  dist::Communicator pp_, meta_;
  StageFunctions stage_;
  ExecutorOptions options_;
  int rank_ = 0;
  std::vector<InstrTiming> timings_;
  int peak_ = 0;
  double run_seconds_ = 0;
};

}  // namespace colossal::pipeline
