// `colossal train`'s run (see trainer.h): the config's options, and a Trainer that builds the
// pieces, resumes, steps, logs and saves.
#include "colossal/app/trainer.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "colossal/app/report.h"
#include "colossal/app/run_dir.h"
#include "colossal/app/tensorboard.h"
#include "colossal/booster/booster.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/data/dataloader.h"
#include "colossal/data/documents.h"
#include "colossal/data/sampler.h"
#include "colossal/data/token_file.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/config.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/attention.h"
#include "colossal/nn/checkpointing.h"
#include "colossal/nn/fp8_linear.h"
#include "colossal/nn/init.h"
#include "colossal/nn/lora.h"
#include "colossal/nn/quantized_linear.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/lr_scheduler.h"

namespace colossal::app {

using namespace booster;

void TrainConfig::register_options(OptionSet& s) {
  s.add("model", "model", &model, "preset (tiny|100m|1b|7b|13b|70b) or path to an HF config.json")
      .add("model", "init", &init, "HF model folder to start from (its config and weights)")
      .add("data", "data", &data, "token file: llm.c .bin, or raw uint16/uint32 (see README)")
      .add("data", "data_format", &data_format, "token file format",
           {"auto", "u16", "u32", "llmc", "llmc-llama3"})
      .add("data", "seq_len", &seq_len, "sequence length S")
      .add("data", "shuffle", &shuffle, "shuffle samples (a permutation seeded by seed and epoch)")
      .add("data", "doc_mask", &doc_mask,
           "keep each document of <data>.docs to itself: positions restart, attention stays "
           "inside it, no target crosses into it (a loss mask <data>.mask is always honoured)")
      .add("lora", "lora_r", &lora_r,
           "LoRA rank: train adapters on lora_targets with the base frozen (0: off)")
      .add("lora", "lora_alpha", &lora_alpha, "LoRA alpha (scaling alpha / r)")
      .add("lora", "lora_dropout", &lora_dropout, "dropout on the adapters' input")
      .add("lora", "lora_targets", &lora_targets,
           "comma-separated linear layers to adapt (last name components, as PEFT's "
           "target_modules)")
      .add("lora", "lora_rslora", &lora_rslora, "rank-stabilised scaling alpha / sqrt(r)")
      .add("lora", "lora_adapter", &lora_adapter,
           "start from this PEFT adapter folder (adapter_config.json + "
           "adapter_model.safetensors); its own r, alpha and targets apply")
      .add("lora", "quantize", &quantize,
           "QLoRA: store the frozen base's linear layers (all but lm_head) quantized on the "
           "training device, quantized as they are loaded (needs LoRA)",
           {"none", "nf4", "fp8"})
      .add("model", "grad_checkpoint", &grad_checkpoint,
           "activation checkpointing: recompute every decoder layer in backward (ckpt_mode)")
      .add("model", "ckpt_mode", &ckpt_mode,
           "what grad_checkpoint recomputes: full (each decoder layer) or attention (its core "
           "attention only)",
           {"full", "attention"})
      .add("model", "use_fp8", &use_fp8,
           "FP8 GEMMs in the linear layers (current scaling; emulated on the CPU)")
      .add("model", "fp8_recipe", &fp8_recipe,
           "FP8 scaling: tensorwise (one scale per tensor, all GEMMs in FP8) or rowwise (one "
           "per row, weight gradients in the working precision)",
           {"tensorwise", "rowwise"})
      .add("model", "fp8_exclude", &fp8_exclude,
           "comma-separated: linear layers whose path contains one of these stay out of FP8")
      .add("model", "attn_backend", &attn_backend,
           "core attention: sdpa (LibTorch) or own (our sm_90a kernels; SDPA where they do not "
           "apply, counted at the end)",
           {"sdpa", "own"})
      .add("model", "deterministic", &deterministic,
           "attn_backend own: a bitwise repeatable attention backward (dQ summed in order)")
      .add("train", "micro_batch", &micro_batch, "sequences per rank per micro-step (B)")
      .add("train", "accumulation", &accumulation, "micro-steps per optimizer step")
      .add("train", "steps", &steps, "optimizer steps in total")
      .add("train", "seed", &seed, "seed of initialization and data order")
      .add("train", "device", &device, "device", {"cpu", "cuda"})
      .add("train", "log_every", &log_every,
           "log a line every N steps (when no progress bar is drawn)")
      .add("train", "fused_ce", &fused_ce,
           "loss by chunked fused linear + cross-entropy (no full logits)")
      .add("train", "ce_chunk_tokens", &ce_chunk_tokens,
           "tokens per chunk of the fused cross-entropy")
      .add("train", "max_nonfinite_steps", &max_nonfinite_steps,
           "stop with an error after N consecutive steps whose loss or gradient norm is not "
           "finite (fp16 overflow skips count only with a non-finite loss or the loss scale at "
           "its floor) (0: never)")
      .add("optim", "lr", &lr, "peak learning rate")
      .add("optim", "schedule", &schedule, "learning-rate schedule",
           {"constant", "linear", "cosine"})
      .add("optim", "warmup", &warmup, "warmup steps")
      .add("optim", "min_lr_ratio", &min_lr_ratio, "final lr as a fraction of lr (linear, cosine)")
      .add("optim", "weight_decay", &weight_decay, "AdamW weight decay (matrices only)")
      .add("optim", "beta1", &beta1, "AdamW beta1")
      .add("optim", "beta2", &beta2, "AdamW beta2")
      .add("optim", "eps", &eps, "AdamW epsilon")
      .add("optim", "max_grad_norm", &max_grad_norm, "clip the global gradient norm (0: off)");
  plugin.register_options(s);
  s.add("checkpoint", "save_dir", &save_dir, "folder for training checkpoints (step-N/ and latest)")
      .add("checkpoint", "save_every", &save_every,
           "save every N optimizer steps (0: at the end only)")
      .add("checkpoint", "async_save", &async_save,
           "write checkpoints in a background thread while training goes on (needs host memory "
           "for what each rank writes)")
      .add("checkpoint", "resume", &resume,
           "continue from a checkpoint folder (a step-N/ or a save_dir)")
      .add("checkpoint", "metrics_file", &metrics_file,
           "append one JSON line per optimizer step (rank 0); lines after the step a run starts "
           "from (0, or the resumed step) are dropped first")
      .add("checkpoint", "tensorboard", &tensorboard,
           "write TensorBoard event files into this folder (rank 0): the metrics file's loss, "
           "lr, grad_norm, loss_scale, tok_s and memory figures as scalars train/<name>, one "
           "point per optimizer step (view with `tensorboard --logdir DIR`)")
      .add("checkpoint", "report", &report,
           "at the end, write report.html (plots of the metrics file, summary, configuration) "
           "into save_dir, or next to metrics_file without one")
      .add("checkpoint", "overwrite", &overwrite,
           "a fresh run into a save_dir that holds a run: delete its checkpoints and start over "
           "(refused without it)")
      .add("checkpoint", "keep_last", &keep_last,
           "keep only the newest N checkpoints in save_dir (0: keep all)");
  s.min("seq_len", 1)
      .min("micro_batch", 1)
      .min("accumulation", 1)
      .min("steps", 1)
      .min("seed", 0)
      .min("log_every", 1);
  s.min("lr", 0)
      .min("warmup", 0)
      .min("min_lr_ratio", 0)
      .max("min_lr_ratio", 1)
      .min("weight_decay", 0);
  s.min("beta1", 0).max("beta1", 0.999999).min("beta2", 0).max("beta2", 0.99999999).min("eps", 0);
  s.min("max_grad_norm", 0).min("save_every", 0).min("ce_chunk_tokens", 1);
  s.min("keep_last", 0).min("max_nonfinite_steps", 0);
  s.min("lora_r", 0).min("lora_alpha", 0).min("lora_dropout", 0).max("lora_dropout", 0.999999);
}

void TrainConfig::validate() const {
  COLOSSAL_CHECK_INPUT(!data.empty(), "option 'data' is required: a token file to train on");
  COLOSSAL_CHECK_INPUT(warmup <= steps, "option 'warmup' (", warmup, ") must not exceed 'steps' (",
                       steps, ")");
  COLOSSAL_CHECK_INPUT(save_every == 0 || !save_dir.empty(),
                       "option 'save_every' needs 'save_dir'");
  COLOSSAL_CHECK_INPUT(keep_last == 0 || !save_dir.empty(), "option 'keep_last' needs 'save_dir'");
  COLOSSAL_CHECK_INPUT(!report || !metrics_file.empty(),
                       "option 'report' needs 'metrics_file' (the report plots its rows)");
  COLOSSAL_CHECK_INPUT(
      tensorboard.empty() || tensorboard_available(), "option 'tensorboard' (", tensorboard,
      "): this build has no protobuf support, so it cannot write TensorBoard event "
      "files (install libprotobuf-dev and protobuf-compiler, then rebuild)");
  COLOSSAL_CHECK_INPUT(!overwrite || resume.empty(),
                       "options 'overwrite' and 'resume' contradict each other: overwrite starts "
                       "a fresh run, resume continues one");
  plugin.validate();
  const bool lora = lora_r > 0 || !lora_adapter.empty();
  COLOSSAL_CHECK_INPUT(lora_r == 0 || lora_adapter.empty(),
                       "options 'lora_r' and 'lora_adapter' contradict each other: an adapter "
                       "folder brings its own rank; give one of them");
  COLOSSAL_CHECK_INPUT(
      !grad_checkpoint || !is_hybrid_plugin(plugin.name) || plugin.hybrid.pp_size == 1,
      "option 'grad_checkpoint' under plugin '", plugin.name, "' with pp_size ",
      plugin.hybrid.pp_size,
      ": the pipeline stages recompute what num_ckpt_layers_per_stage says; "
      "give that instead");
  COLOSSAL_CHECK_INPUT(quantize == "none" || !is_hybrid_plugin(plugin.name), "option 'quantize' (",
                       quantize, ") under plugin '", plugin.name,
                       "' is not supported: quantized bases are not sharded or split into "
                       "pipeline stages; use none, ddp, low_level_zero, zero1, zero2 or gemini");
  COLOSSAL_CHECK_INPUT(!deterministic || attn_backend == "own",
                       "option 'deterministic' applies to our attention kernels: it needs "
                       "attn_backend = \"own\", not \"",
                       attn_backend, "\"");
  COLOSSAL_CHECK_INPUT(!use_fp8 || !lora,
                       "options 'use_fp8' and LoRA (lora_r / lora_adapter) cannot be combined "
                       "yet: the adapters' base GEMMs would not run in FP8");
  COLOSSAL_CHECK_INPUT(quantize == "none" || lora, "option 'quantize' (", quantize,
                       ") needs LoRA (lora_r or lora_adapter): a quantized base is frozen, so "
                       "only adapters can train on it");
  static const std::set<std::string> kLoraPlugins{
      "none", "ddp", "low_level_zero", "zero1", "zero2", "gemini", "gemini_auto", "hybrid", "3d"};
  COLOSSAL_CHECK_INPUT(
      !lora || kLoraPlugins.count(plugin.name), "LoRA under plugin '", plugin.name,
      "' is not supported yet; use none, ddp, low_level_zero, zero1, zero2, gemini, "
      "gemini_auto, hybrid or 3d");
}

namespace {

namespace fs = std::filesystem;

void write_text_atomic(const std::string& path, const std::string& text) {
  checkpoint::write_file_atomic(
      path, [&](int fd) { checkpoint::write_all(fd, text.data(), text.size(), path); });
}

// SIGTERM / SIGUSR1 (what schedulers send before a kill) and SIGINT ask for a checkpoint at the
// next step boundary: the handler only records the signal; the loop agrees on it across ranks
// (a MAX all-reduce per step, ranks get the signal at slightly different times), saves and
// exits with 128 + signo. A second signal (a second Ctrl-C) stops at once: the default action.
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
  // Only async-signal-safe calls here: a fixed text through write(2). Before the first step
  // (a long load, a resume) nothing else would show that the signal was taken.
  static const char kMsg[] =
      "colossal train: stop signal received: saving at the next step boundary, then exiting "
      "(send it again to stop at once)\n";
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
}

const int kStopSignals[] = {SIGTERM, SIGUSR1, SIGINT};

// Installs on_stop_signal for the life of the loop; the previous handlers come back after it.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART;  // collectives and writes in flight carry on
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      ::sigaction(kStopSignals[i], &sa, &old_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      ::sigaction(kStopSignals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_[std::size(kStopSignals)]{};
};

const char* stop_signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGINT:
      return "SIGINT";
    default:
      return "a signal";
  }
}

// What identifies the token file beyond its path: its size and an FNV-1a hash of its first and
// last MiB (a changed, regenerated or different file with the same name is caught; reading 2 MiB
// costs nothing next to a run).
json::Value data_fingerprint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  COLOSSAL_CHECK_INPUT(f, "option 'data': cannot read ", path);
  f.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(f.tellg());
  const int64_t piece = 1 << 20;
  uint64_t h = 1469598103934665603ull;
  std::vector<char> buf;
  for (int64_t off : {int64_t{0}, std::max<int64_t>(0, size - piece)}) {
    buf.resize(static_cast<size_t>(std::min(piece, size)));
    f.seekg(off);
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    COLOSSAL_CHECK_INPUT(f, "option 'data': cannot read ", path);
    for (char ch : buf) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  }
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  json::Value v = json::Value::object();
  v.set("size", size);
  v.set("fnv1a_head_tail", std::string(hex));
  return v;
}

// An option's value for a message: numbers in their shortest exact form (0.003, not JSON's
// 0.0030000000000000001).
std::string show(const json::Value& v) {
  if (v.is_number() && !v.is_int()) {
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof buf, v.as_double());
    return std::string(buf, r.ptr);
  }
  return v.dump();
}

bool same_folder(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  fs::path pa = fs::weakly_canonical(a, ea), pb = fs::weakly_canonical(b, eb);
  return !ea && !eb && pa == pb;
}

std::string human_count(double x) {
  char buf[32];
  if (x >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", x / 1e6);
  else if (x >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) s = 0;
  int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600),
                  (long long)(t / 60 % 60), (long long)(t % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", (long long)(t / 60), (long long)(t % 60));
  return buf;
}

// Progress on a terminal: one line redrawn with '\r'. `colossal run` sets COLOSSAL_TTY=1 in
// the ranks when its own stderr is a terminal (the ranks' stderr is then a pipe).
bool draw_progress_bar() {
  const char* v = std::getenv("COLOSSAL_TTY");
  if (v) return std::string(v) == "1";
  return ::isatty(STDERR_FILENO) == 1;
}

void draw_bar(int64_t step, int64_t total, double loss, double lr, double tok_s, double eta) {
  const int width = 24;
  int filled = static_cast<int>(width * static_cast<double>(step) / static_cast<double>(total));
  std::string bar(static_cast<size_t>(filled), '#');
  bar += std::string(static_cast<size_t>(width - filled), '.');
  char line[256];
  std::snprintf(line, sizeof line,
                "\rstep %lld/%lld [%s] loss %.4f | lr %.2e | %s tok/s | ETA %s   ", (long long)step,
                (long long)total, bar.c_str(), loss, lr, human_count(tok_s).c_str(),
                human_time(eta).c_str());
  std::fputs(line, stderr);
  std::fflush(stderr);
}

// One run, built once and then stepped (torchtitan's Trainer): the constructor builds plugin,
// model, data, optimizer and scheduler and boosts them; run() resumes, steps, logs and saves.
class Trainer {
 public:
  Trainer(const TrainConfig& c, const json::Value& config_json);
  TrainResult run();

 private:
  struct StepStats {
    double loss = 0, lr = 0, seconds = 0;
    bool stepped = true;
  };
  void build_model();
  void build_quantized_model();
  void build_lora();  // --lora_r / --lora_adapter through Booster::enable_lora, before boost
  void build_data();
  std::shared_ptr<optim::AdamW> build_optimizer() const;
  void check_tokens(const at::Tensor& inputs, const at::Tensor& targets) const;
  void prepare_save_dir();
  void claim_save_dir();  // rank 0's part of prepare_save_dir
  void delete_old_run();  // rank 0, --overwrite: right before step 1
  void on_rank0_shared(const std::function<void()>& fn, const std::string& what);
  int64_t resume(const std::string& checkpoint);  // returns the step it continues from
  void check_resume_config(const std::string& dir, const json::Value& state) const;
  void apply_new_hyperparameters(const std::vector<optim::GroupOptions>& groups,
                                 const json::Value& base_lrs);
  void open_metrics();
  void write_metrics_line(const std::string& line);
  void open_tensorboard();
  StepStats train_step();
  void log_step(int64_t done, const StepStats& st, double elapsed);
  void check_finite_step(int64_t done, const StepStats& st);
  int agreed_stop_signal() const;
  bool model_is_finite() const;
  std::string save(int64_t step);
  void write_trainer_state(const std::string& path, int64_t step) const;
  json::Value run_facts() const;
  void write_report() const;
  // --async_save: waits until the previous checkpoint is written and published (rethrows its
  // error); then queues this save's publication (commit_async).
  void finish_async_save();
  void commit_async(std::unique_ptr<checkpoint::StagedDirectory> staged, const std::string& path,
                    int64_t step);

  const TrainConfig& c_;
  const json::Value& config_json_;
  const bool distributed_, rank0_;
  // SIGTERM / SIGUSR1 / SIGINT are caught from the start of construction, before the first
  // collective: a signal that comes while the ranks are still setting up or resuming is held
  // and acted on at the first step boundary (save, exit 128+signo) on every rank, instead of
  // killing a rank that had not yet installed the handler.
  StopSignals stop_signals_;
  // rank 0: save_dir is this job's from before step 1 to exit. Declared before booster_, so it is
  // released after it: a Trainer unwinding from an error destroys the Booster, whose AsyncWriter
  // still finishes (and may publish) the save in flight, and that must happen while the folder
  // is still this job's, not after another job has claimed it.
  std::unique_ptr<RunDirLock> lock_;
  std::string old_run_;  // rank 0: what --overwrite deletes (empty: nothing)
  std::shared_ptr<dist::ParallelDims> dims_;
  std::shared_ptr<Plugin> plugin_;
  std::shared_ptr<models::CausalLM> model_;
  std::shared_ptr<nn::OwnAttention> own_attention_;  // attn_backend own: its counts
  std::shared_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<Booster> booster_;
  Boosted boosted_;
  at::Device device_{at::kCPU};
  int64_t G_ = 0;  // global batch (sequences per optimizer step)
  int64_t start_ = 0;
  double run_seconds_ = 0;
  std::FILE* metrics_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;  // rank 0, --tensorboard
  bool bar_ = false;
  mutable json::Value data_fingerprint_;  // of c_.data, read once (null until then)
  std::optional<nn::LoraConfig> lora_;    // the adapters' config when training LoRA
  int64_t nonfinite_run_ = 0;             // consecutive non-finite steps so far
};

Trainer::Trainer(const TrainConfig& c, const json::Value& config_json)
    : c_(c),
      config_json_(config_json),
      distributed_(dist::is_initialized()),
      rank0_(!distributed_ || dist::rank() == 0) {
  prepare_save_dir();
  build_model();
  // The run's layout: the hybrid plugin's degrees (tp, pp, sp from its options, dp the rest,
  // checked against the model's heads and layers), every rank data parallel for the other
  // plugins, which take their dp axis from it. make_plugin checks that the device is there.
  if (distributed_) {
    dist::ParallelDegrees degrees;
    degrees.dp = dist::world_size();
    dist::ModelFacts facts;
    if (is_hybrid_plugin(c.plugin.name)) {
      degrees = c.plugin.hybrid.degrees(dist::world_size());
      const models::ModelConfig& mc = model_->config();
      facts.num_attention_heads = mc.num_attention_heads;
      facts.num_key_value_heads = mc.num_key_value_heads;
      facts.num_layers = mc.num_hidden_layers;
      facts.vocab_size = mc.vocab_size;
    }
    dims_ = std::make_shared<dist::ParallelDims>(degrees, facts);
    plugin_ = make_plugin(c.plugin, c.device, dims_);
  } else {
    plugin_ = make_plugin(c.plugin, c.device);
  }
  booster_ = std::make_unique<Booster>(plugin_);
  build_lora();
  build_data();
  auto adamw = build_optimizer();
  optim::LRScheduleOptions so;
  so.kind = optim::schedule_kind_from_string(c.schedule);
  so.warmup_steps = c.warmup;
  so.total_steps = c.steps;
  so.min_lr_ratio = c.min_lr_ratio;
  auto lr_scheduler = std::make_shared<optim::LRScheduler>(*adamw, so);

  G_ = c.micro_batch * plugin_->dp_size() * c.accumulation;
  auto loader = plugin_->prepare_dataloader(dataset_, c.micro_batch, c.shuffle,
                                            static_cast<uint64_t>(c.seed), c.accumulation);
  boosted_ = booster_->boost(model_, adamw, {}, loader, lr_scheduler);
  if (c.device == "cuda") device_ = Accelerator::cuda().device();
}

// QLoRA's base: the linear layers quantized on the training device as each weight is read (an
// HF folder) or initialised (by name, as the plain model: the quantization of the same weights),
// the other parameters in fp32 on the host like build_model's.
void Trainer::build_quantized_model() {
  nn::QuantizeConfig qc;
  qc.kind = c_.quantize;
  const at::Device qdev = c_.device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);
  if (!c_.init.empty()) {
    checkpoint::PretrainedOptions po;
    po.quantize = qc;
    po.quantize_device = qdev;
    model_ = checkpoint::load_pretrained(c_.init, po);
    return;
  }
  models::ModelConfig cfg = fs::exists(c_.model) ? models::ModelConfig::from_file(c_.model)
                                                 : models::ModelConfig::preset(c_.model);
  model_ = std::make_shared<models::CausalLM>(cfg, at::TensorOptions().device(at::kMeta));
  const auto paths = nn::quantize_linears(*model_, qc);
  nn::InitOptions io;
  io.seed = static_cast<uint64_t>(c_.seed);
  io.std = cfg.initializer_range;
  nn::init_parameters(*model_, io);
  const int64_t bytes = nn::init_quantized_weights(*model_, io, qdev);
  log_info("model ", c_.model, ": ", paths.size(), " linear layers quantized to ", c_.quantize,
           " on ", qdev, " (", static_cast<double>(bytes) / (1 << 30), " GiB)");
}

// An HF folder, or a preset / config.json initialised by name (same weights for any layout).
void Trainer::build_model() {
  if (c_.quantize != "none") {
    build_quantized_model();
  } else if (!c_.init.empty()) {
    model_ = checkpoint::load_pretrained(c_.init);
    log_info("model from ", c_.init);
  } else {
    models::ModelConfig cfg = fs::exists(c_.model) ? models::ModelConfig::from_file(c_.model)
                                                   : models::ModelConfig::preset(c_.model);
    // Every rank builds the whole model on the host in fp32 before the plugin places it.
    models::check_fits_memory(cfg, at::Device(at::kCPU), 4, "model " + c_.model);
    model_ = std::make_shared<models::CausalLM>(cfg);
    nn::InitOptions io;
    io.seed = static_cast<uint64_t>(c_.seed);
    io.std = cfg.initializer_range;
    nn::init_parameters(*model_, io);
  }
  if (c_.grad_checkpoint)
    model_->set_activation_checkpointing(nn::checkpoint_mode_from_string(c_.ckpt_mode));
  if (c_.use_fp8) {
    nn::Fp8Config fc;
    fc.recipe = c_.fp8_recipe;
    fc.keep_weight_casts = c_.accumulation > 1;  // one cast per step either way
    fc.exclude = split_list(c_.fp8_exclude);
    const at::Device dev =
        c_.device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);
    const auto paths = nn::convert_to_fp8(*model_, fc, dev);
    log_info("FP8 (", fc.recipe, dev.is_cpu() ? ", emulated on the CPU" : "", "): ", paths.size(),
             " linear layers; kept out: ", c_.fp8_exclude.empty() ? "none" : c_.fp8_exclude);
  }
  if (c_.attn_backend == "own") {
    const auto [own, slots] = nn::use_own_attention(*model_, c_.deterministic);
    own_attention_ = own;
    log_info("attention: our kernels in ", slots, " core-attention slots",
             c_.deterministic ? " (deterministic backward)" : "");
  }
  const models::ModelConfig& mcfg = model_->config();
  COLOSSAL_CHECK_INPUT(c_.seq_len <= mcfg.max_position_embeddings, "seq_len ", c_.seq_len,
                       " exceeds the model's max_position_embeddings ",
                       mcfg.max_position_embeddings);
}

// The adapters go on before the optimizer is built (it takes what trains) and before boost
// (the plugin places and wraps them with the rest); the Booster keeps their config for
// save_lora_as_pretrained.
void Trainer::build_lora() {
  std::vector<std::string> adapted;  // the paths enable_lora adapted
  if (!c_.lora_adapter.empty()) {
    adapted = booster_->enable_lora(model_, c_.lora_adapter);
    log_info("LoRA adapter from ", c_.lora_adapter);
  } else if (c_.lora_r > 0) {
    nn::LoraConfig lc;
    lc.r = c_.lora_r;
    lc.lora_alpha = c_.lora_alpha;
    lc.lora_dropout = c_.lora_dropout;
    lc.use_rslora = c_.lora_rslora;
    lc.target_modules = split_list(c_.lora_targets);
    adapted = booster_->enable_lora(model_, lc, static_cast<uint64_t>(c_.seed));
  }
  if (const nn::LoraConfig* applied = booster_->lora_config(*model_)) lora_ = *applied;
  if (lora_) {
    int64_t trainable = 0, total = 0;
    for (const auto& p : model_->parameters()) {
      total += p.numel();
      if (p.requires_grad()) trainable += p.numel();
    }
    // A QLoRA base's quantized weights are not parameters: counted as the model's all the same.
    total += nn::quantized_weight_count(*model_);
    std::string targets;
    for (const auto& t : lora_->target_modules) targets += (targets.empty() ? "" : ",") + t;
    log_info("LoRA: r ", lora_->r, ", alpha ", lora_->lora_alpha, " on ", adapted.size(),
             " layers (", targets, "); ", trainable, " of ", total, " parameters train");
  }
}

void Trainer::build_data() {
  auto file =
      std::make_shared<data::TokenFile>(c_.data, data::token_format_from_string(c_.data_format));
  dataset_ = std::make_shared<data::TokenDataset>(file, c_.seq_len);
  COLOSSAL_CHECK_INPUT(dataset_->num_samples() >= 1, c_.data, " holds ", file->size(),
                       " tokens: too few for one sample of seq_len ", c_.seq_len, " (needs ",
                       c_.seq_len + 1, ")");
  // What `colossal prepare` writes next to the tokens: the loss mask is always honoured (it is
  // part of the data: SFT prompts must not be trained on), the document index under doc_mask.
  const std::string mask_path = c_.data + ".mask", docs_path = c_.data + ".docs";
  std::error_code ec;
  if (fs::exists(mask_path, ec)) {
    dataset_->set_loss_mask(std::make_shared<data::LossMaskFile>(mask_path));
    if (rank0_) {
      const int64_t on = dataset_->loss_mask()->trained();
      log_info("loss mask ", mask_path, ": ", on, " of ", file->size(), " tokens (",
               100.0 * static_cast<double>(on) / static_cast<double>(file->size()),
               " %) are trained targets",
               dataset_->loss_mask()->packed_seq_len() > 0
                   ? str(", packed for seq_len ", dataset_->loss_mask()->packed_seq_len())
                   : std::string());
    }
  }
  if (c_.doc_mask) {
    COLOSSAL_CHECK_INPUT(fs::exists(docs_path, ec), "option 'doc_mask' needs the document index ",
                         docs_path, " (colossal prepare writes it next to the token file)");
    COLOSSAL_CHECK_INPUT(!plugin_->support_pipeline(),
                         "option 'doc_mask' is not supported with pipeline parallelism yet "
                         "(pp_size > 1)");
    dataset_->set_documents(data::read_doc_index(docs_path), docs_path);
    dataset_->set_document_mask(true);
  }
  // The whole file once, now: an id past the vocabulary would otherwise surface only when its
  // batch comes up (check_tokens), possibly hours in and without its position.
  const int64_t vocab = model_->config().vocab_size;
  const int64_t bad = file->first_at_or_above(vocab);
  COLOSSAL_CHECK_INPUT(bad < 0, c_.data, ": token id ", bad < 0 ? 0 : file->token(bad),
                       " at position ", bad, " (of ", file->size(),
                       " tokens) is outside the model's vocabulary (vocab_size ", vocab,
                       "); was the file made with another tokenizer?");
}

// AdamW; weight decay on matrices only.
std::shared_ptr<optim::AdamW> Trainer::build_optimizer() const {
  auto adamw = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> decay, no_decay;
  for (auto& item : model_->named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    (item.value().dim() >= 2 ? decay : no_decay).push_back({item.key(), item.value()});
  }
  optim::GroupOptions g;
  g.lr = c_.lr;
  g.beta1 = c_.beta1;
  g.beta2 = c_.beta2;
  g.eps = c_.eps;
  g.weight_decay = c_.weight_decay;
  if (!decay.empty()) adamw->add_param_group(decay, g);
  g.weight_decay = 0.0;
  if (!no_decay.empty()) adamw->add_param_group(no_decay, g);
  return adamw;
}

// Before step 1 (before the model is even built): every rank writes into the staging folder of
// a save (pipeline stages write their own files), so every rank checks that it can write there;
// rank 0 then takes the folder for this job. Rank 0's verdict is shared, so the other ranks stop
// with it rather than at their first collective with a rank that is gone.
void Trainer::prepare_save_dir() {
  if (c_.save_dir.empty()) return;
  probe_writable_dir(c_.save_dir, "save_dir");
  on_rank0_shared([&] { claim_save_dir(); }, str("option 'save_dir' (", c_.save_dir, ")"));
}

// Runs `fn` on rank 0 and shares whether it threw: rank 0 rethrows, the others stop with an
// error pointing at rank 0's (rather than at their next collective with a rank that is gone).
void Trainer::on_rank0_shared(const std::function<void()>& fn, const std::string& what) {
  std::exception_ptr failed;
  if (rank0_) {
    try {
      fn();
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (distributed_ && dist::world_size() > 1) {
    at::Tensor t = at::full({1}, failed ? 1.0 : 0.0, at::kDouble);
    dist::world_cpu().all_reduce(t, dist::ReduceOp::Max);
    if (!rank0_ && t.item<double>() != 0.0)
      throw InputError(str(what, ": rank 0 failed (its error says why)"));
  }
  if (failed) std::rethrow_exception(failed);
}

// The lock, the leftovers of interrupted saves, and the rule for a folder that holds a run: a
// resume of that run continues it; a fresh run is refused unless --overwrite, which deletes the
// old run's checkpoints before step 1 (delete_old_run: after everything else has been built, so
// a run that fails to start loses nothing). Keeping them until the first save instead would
// leave two runs' steps side by side, and a resume could pick the old run's newer step.
void Trainer::claim_save_dir() {
  const std::string& dir = c_.save_dir;
  lock_ = std::make_unique<RunDirLock>(dir);
  for (const auto& name : remove_stale_temporaries(dir))
    log_info("removed ", dir, "/", name, ", left by an interrupted save");
  if (!holds_run(dir)) return;
  if (!c_.resume.empty()) {
    const bool step_folder = fs::exists(c_.resume + "/trainer_state.json");
    const std::string run = step_folder ? fs::path(c_.resume).parent_path().string() : c_.resume;
    if (same_folder(run, dir)) return;
  }
  std::vector<StepDir> steps = complete_steps(dir);
  old_run_ = steps.empty() ? std::string("a latest file or step folders")
                           : str(steps.size(), " checkpoint(s), the newest ", steps.back().name);
  COLOSSAL_CHECK_INPUT(c_.overwrite, "option 'save_dir' (", dir, ") already holds a run (",
                       old_run_, "): resume it with --resume ", dir,
                       ", choose another save_dir, or pass --overwrite to delete it and start "
                       "over");
}

void Trainer::delete_old_run() {
  if (old_run_.empty()) return;
  const std::string& dir = c_.save_dir;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // report.html (--report) describes the deleted run too.
    if (name != "latest" && name != "report.html" && name.rfind("step-", 0) != 0) continue;
    std::string err;
    if (!checkpoint::remove_tree(dir + "/" + name, &err))
      throw Error(str("--overwrite: cannot remove ", dir, "/", name, ": ", err));
  }
  log_warn("--overwrite: deleted the previous run in ", dir, " (", old_run_, ")");
  old_run_.clear();
}

int64_t Trainer::resume(const std::string& checkpoint) {
  const int64_t S = c_.seq_len;
  std::string why;
  std::string dir = resolve_checkpoint(checkpoint, &why);
  if (!why.empty() && rank0_) log_warn("resume: ", why);
  json::Value state = json::parse_file(dir + "/trainer_state.json");
  int64_t ck_g = state.at("global_batch").as_int("global_batch"),
          ck_s = state.at("seq_len").as_int("seq_len");
  COLOSSAL_CHECK_INPUT(ck_g == G_ && ck_s == S, "resume: checkpoint ", dir,
                       " was trained with global batch ", ck_g, " x seq_len ", ck_s,
                       ", this run uses ", G_, " x ", S,
                       " (micro_batch * ranks * accumulation must match to continue the same run)");
  check_resume_config(dir, state);
  // The optimizer's hyper-parameters as this run's options set them: the checkpoint's
  // optimizer state restores its own (per group), and the options win (check_resume_config
  // said which differ).
  std::vector<optim::GroupOptions> groups;
  for (const auto& g : boosted_.optimizer->optimizer().param_groups()) groups.push_back(g.options);
  json::Value base_lrs = boosted_.lr_scheduler->state_dict().at("base_lrs");
  booster_->load_model(*boosted_.model, dir + "/model", /*strict=*/true, boosted_.optimizer.get());
  booster_->load_optimizer(*boosted_.optimizer, dir);
  booster_->load_lr_scheduler(*boosted_.lr_scheduler, dir + "/scheduler.json");
  apply_new_hyperparameters(groups, base_lrs);
  boosted_.dataloader->load_state_dict(state.at("sampler"));
  // RNG state (nothing in this loop draws from it today, but dropout and custom models may).
  if (fs::exists(dir + "/rng.safetensors")) {
    for (auto& [name, t] : checkpoint::load_safetensors(dir + "/rng.safetensors")) {
      if (name == "cpu") Accelerator::cpu().set_rng_state(t.clone());
      if (name == "cuda" && device_.is_cuda()) Accelerator::cuda().set_rng_state(t.clone());
    }
  }
  const int64_t start = state.at("step").as_int("step");
  COLOSSAL_CHECK_INPUT(start <= c_.steps, "resume: checkpoint is at step ", start,
                       ", beyond steps ", c_.steps);
  log_info("resumed from ", dir, " at step ", start);
  return start;
}

// This run's options against the ones the checkpoint recorded. The rule, per option:
// - what defines the sample stream and the model (model, init, data and its format, seq_len,
//   shuffle, seed) must match: a resume with another one is not a continuation of that run, so
//   it is refused, naming every difference (train a new run with --init to start from its
//   weights). The data file is identified by size and content fingerprint: the same file at
//   another path is fine, another file (or a changed one) at the same path is not.
// - everything else (the optimizer and schedule: lr, weight_decay, betas, eps, max_grad_norm,
//   schedule, warmup, min_lr_ratio, steps; the layout and plugin, as long as the global batch
//   matches, checked above; logging and saving) takes this run's value, and each difference is
//   printed.
void Trainer::check_resume_config(const std::string& dir, const json::Value& state) const {
  const json::Value* old_config = state.find("config");
  if (!old_config || !old_config->is_object()) {
    if (rank0_)
      log_warn("resume: ", dir, " records no config; the options of this run are not checked");
    return;
  }
  static const char* const kMustMatch[] = {"model",   "init",    "data", "data_format",
                                           "seq_len", "shuffle", "seed"};
  static const char* const kNotCompared[] = {"resume", "overwrite"};
  auto in = [](const auto& list, const std::string& name) {
    return std::find(std::begin(list), std::end(list), name) != std::end(list);
  };
  std::vector<std::string> refused, applied;
  for (const auto& [section, opts] : config_json_.as_object()) {
    const json::Value* old_section = old_config->find(section);
    if (!opts.is_object() || !old_section || !old_section->is_object()) continue;
    for (const auto& [name, now] : opts.as_object()) {
      const json::Value* was = old_section->find(name);
      if (!was || *was == now || in(kNotCompared, name)) continue;
      std::string d = str(name, ": ", show(*was), " in the checkpoint, ", show(now), " now");
      if (name == "data") {
        // Another path to the same bytes is the same data.
        const json::Value* fp = state.find("data");
        if (fp && *fp == data_fingerprint(c_.data)) {
          applied.push_back(d + " (the same content)");
          continue;
        }
      }
      (in(kMustMatch, name) ? refused : applied).push_back(d);
    }
  }
  const json::Value* old_data = old_config->find("data");
  const json::Value* old_path =
      old_data && old_data->is_object() ? old_data->find("data") : nullptr;
  const json::Value* fp = state.find("data");
  if (fp && old_path && old_path->is_string() && old_path->as_string() == c_.data) {
    json::Value now = data_fingerprint(c_.data);
    if (!(*fp == now))
      refused.push_back(str("data: ", c_.data, " has changed since the checkpoint (", fp->dump(),
                            " then, ", now.dump(), " now)"));
  }
  if (!refused.empty()) {
    std::string list;
    for (const auto& r : refused) list += "\n  " + r;
    throw InputError(str("resume: ", dir,
                         " belongs to a run with other data or another model; --resume continues "
                         "the same run (start a new one, e.g. with --init <hf folder>). "
                         "Differences:",
                         list));
  }
  if (rank0_)
    for (const auto& a : applied) log_warn("resume: option ", a, ": using the new value");
}

// After the checkpoint's optimizer and scheduler states are loaded: each group's
// hyper-parameters and the schedule's base lrs as this run's options built them.
void Trainer::apply_new_hyperparameters(const std::vector<optim::GroupOptions>& groups,
                                        const json::Value& base_lrs) {
  auto& now = boosted_.optimizer->optimizer().param_groups();
  COLOSSAL_CHECK(now.size() == groups.size(), "resume: the optimizer has ", now.size(),
                 " param groups after loading, ", groups.size(), " before");
  for (size_t i = 0; i < now.size(); ++i) now[i].options = groups[i];
  json::Value sched = boosted_.lr_scheduler->state_dict();
  sched.set("base_lrs", base_lrs);
  boosted_.lr_scheduler->load_state_dict(sched);  // applies base_lr * factor(step) to each group
}

void Trainer::check_tokens(const at::Tensor& inputs, const at::Tensor& targets) const {
  const int64_t vocab = model_->config().vocab_size;
  int64_t max_id = inputs.max().item<int64_t>();
  int64_t last = targets.select(1, c_.seq_len - 1).max().item<int64_t>();
  COLOSSAL_CHECK_INPUT(std::max(max_id, last) < vocab, c_.data, ": token id ",
                       std::max(max_id, last), " is outside the model's vocabulary (", vocab, ")");
}

// One optimizer step: `accumulation` micro-steps (gradient sync on the last only), clipping,
// the update and the schedule; the loss averaged over the ranks.
Trainer::StepStats Trainer::train_step() {
  ModelWrapper& mw = *boosted_.model;
  OptimizerWrapper& opt = *boosted_.optimizer;
  data::DataLoader& dataloader = *boosted_.dataloader;
  const int64_t A = c_.accumulation;
  StepStats st;
  auto t0 = std::chrono::steady_clock::now();
  st.lr = boosted_.lr_scheduler->lrs().front();
  double local_loss = 0.0;
  int64_t counted = -1;  // targets that count in the global batch; -1: every target counts
  for (int64_t a = 0; a < A; ++a) {
    if (a == 0 && dataset_->masks_targets()) counted = dataloader.counted_targets_of_step();
    if (plugin_->support_pipeline()) {
      // Pipeline stages: the plugin's schedule runs forward and backward over micro-batches of
      // this batch; the loss of the step comes back from the last stage on every rank.
      std::unique_ptr<NoSyncGuard> guard;
      if (a + 1 < A) guard = booster_->no_sync(mw, &opt);
      BatchIterator next = [&] {
        data::Batch b = dataloader.next_batch();  // targets -100 where the mask says
        check_tokens(b.inputs, b.targets);
        return std::make_pair(b.inputs.to(device_), b.targets.to(device_));
      };
      Criterion criterion;
      if (!c_.fused_ce && counted < 0)
        criterion = [](const at::Tensor& logits, const at::Tensor& targets) {
          return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                        targets.reshape({-1}));
        };
      PipelineStep ps;
      ps.loss_weight = 1.0 / static_cast<double>(A);
      ps.ce_chunk_tokens = c_.fused_ce ? c_.ce_chunk_tokens : 0;
      ps.counted_targets = counted;
      ps.global_targets = G_ * c_.seq_len;
      PipelineOutput out = booster_->execute_pipeline(next, mw, criterion, &opt, true, false, ps);
      local_loss += out.loss.item<double>();
      continue;
    }
    data::Batch b = dataloader.next_batch();
    check_tokens(b.inputs, b.targets);
    at::Tensor inputs = b.inputs.to(device_), targets = b.targets.to(device_);
    std::unique_ptr<NoSyncGuard> guard;
    if (a + 1 < A) guard = booster_->no_sync(mw, &opt);
    // This rank's part (a sequence shard under sequence parallelism); the loss below is the
    // mean over its own targets (what is reported; averaged over the ranks).
    LocalBatch lb = plugin_->local_batch(inputs, targets);
    models::ForwardOptions fo;
    fo.seq_offset = lb.seq_offset;
    fo.global_seq_len = lb.global_seq_len;
    if (lb.positions.defined()) fo.positions = lb.positions.to(lb.inputs.device());
    if (b.document_ids.defined()) {
      COLOSSAL_CHECK_INPUT(
          lb.global_seq_len == 0 && !lb.positions.defined() && lb.loss_weight == 1.0,
          "option 'doc_mask' needs whole sequences on every rank: it is not "
          "supported with sequence parallelism yet");
      fo.position_ids = b.position_ids.to(device_);
      fo.document_ids = b.document_ids;  // CPU: the model builds the document layout from it
    }
    // Masked targets: the loss is the sum over this rank's counted targets divided so that,
    // after the gradient averaging of the layout and over the ranks, it is the mean over the
    // `counted` targets of the global batch (the unmasked form: the mean over G*S targets,
    // each rank's mean over its own n_local).
    double divisor = 0;
    if (counted >= 0) {
      const double n_local = static_cast<double>(lb.targets.numel());
      divisor = counted > 0
                    ? n_local * static_cast<double>(counted) / static_cast<double>(G_ * c_.seq_len)
                    : n_local;  // nothing counts: the sum is 0 whatever divides it
      fo.loss_divisor = divisor;
    }
    at::Tensor loss;
    // A head sharded over the vocabulary (the tensor-parallel plan's) returns sharded logits:
    // its loss is always the vocab-parallel one (one chunk of every token without fused_ce).
    const bool vocab_head = model_->vocab_parallel_head();
    if (c_.fused_ce || vocab_head) {
      loss = model_->forward_loss(lb.inputs, lb.targets, c_.fused_ce ? c_.ce_chunk_tokens : 0, fo) /
             static_cast<double>(A);
    } else {
      at::Tensor logits = model_->forward(lb.inputs, fo);
      at::Tensor flat = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
      loss = divisor > 0 ? at::cross_entropy_loss(flat, lb.targets.reshape({-1}), std::nullopt,
                                                  at::Reduction::Sum) /
                               divisor
                         : at::cross_entropy_loss(flat, lb.targets.reshape({-1}));
      loss = loss / static_cast<double>(A);
    }
    // This rank's share of the loss of the ranks holding parts of the same sequences.
    booster_->backward(lb.loss_weight == 1.0 ? loss : loss * lb.loss_weight, opt);
    local_loss += loss.detach().item<double>();
  }
  if (c_.max_grad_norm > 0) opt.clip_grad_by_norm(c_.max_grad_norm);
  st.stepped = opt.step();
  opt.zero_grad(true);
  boosted_.lr_scheduler->step();

  st.loss = local_loss;
  if (distributed_ && dist::world_size() > 1) {
    at::Tensor t = at::full({1}, local_loss, at::kDouble);
    dist::world_cpu().all_reduce(t, dist::ReduceOp::Avg);
    st.loss = t.item<double>();
  }
  // Under overlap_step the current stream only: the update runs on a side stream into the next
  // step's forward, which waits for each layer's share (a device-wide wait would serialise it).
  if (device_.is_cuda()) {
    if (c_.plugin.ddp.overlap_step)
      Accelerator::cuda().synchronize_stream();
    else
      Accelerator::cuda().synchronize();
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// Rank 0: the metrics line, and the progress bar or a log line.
void Trainer::log_step(int64_t done, const StepStats& st, double elapsed) {
  if (!rank0_) return;
  const int64_t S = c_.seq_len;
  OptimizerWrapper& opt = *boosted_.optimizer;
  const double tok_s = static_cast<double>(G_ * S) / st.seconds;
  if (metrics_ || tb_) {
    json::Value m = json::Value::object();
    m.set("step", done);
    m.set("loss", st.loss);
    m.set("lr", st.lr);
    m.set("grad_norm", opt.last_grad_norm());
    m.set("tokens", done * G_ * S);
    m.set("tok_s", tok_s);
    m.set("elapsed_s", elapsed);
    m.set("skipped", !st.stepped);
    m.set("loss_scale", opt.loss_scale());
    m.set("host_rss_bytes", Accelerator::cpu().memory_stats().allocated);
    if (device_.is_cuda()) {
      const MemoryStats ms = Accelerator::cuda().memory_stats();
      m.set("device_allocated_bytes", ms.allocated);
      m.set("device_peak_allocated_bytes", ms.peak_allocated);
    }
    if (metrics_) write_metrics_line(m.dump() + "\n");
    if (tb_) {
      // The metrics row's figures, one scalar each, flushed per step for a live TensorBoard.
      const double wall = TensorBoardWriter::now();
      for (const char* key : {"loss", "lr", "grad_norm", "loss_scale", "tok_s", "host_rss_bytes",
                              "device_allocated_bytes", "device_peak_allocated_bytes"})
        if (m.contains(key) && m.at(key).is_number())
          tb_->add_scalar(str("train/", key), m.at(key).as_double(key), done, wall);
      tb_->flush();
    }
  }
  double eta =
      run_seconds_ / static_cast<double>(done - start_) * static_cast<double>(c_.steps - done);
  if (bar_) {
    draw_bar(done, c_.steps, st.loss, st.lr, tok_s, eta);
  } else if (done % c_.log_every == 0 || done == c_.steps || done == start_ + 1) {
    log_info("step ", done, "/", c_.steps, " loss ", st.loss, " lr ", st.lr, " grad_norm ",
             opt.last_grad_norm(), " ", human_count(tok_s), " tok/s",
             st.stepped ? "" : " (skipped)");
  }
}

// Rank 0. The metrics file describes this run: lines after the step it starts from (0, or the
// resumed step: written after that checkpoint by a run that died) are dropped, by writing the
// kept lines to a new file renamed over it, so a resumed run's steps are not there twice.
void Trainer::open_metrics() {
  if (!rank0_ || c_.metrics_file.empty()) return;
  const std::string& path = c_.metrics_file;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    std::ifstream f(path);
    COLOSSAL_CHECK_INPUT(f, "option 'metrics_file' (", path,
                         "): cannot read it: ", std::strerror(errno));
    std::string kept, line;
    int64_t dropped = 0;
    while (std::getline(f, line)) {
      bool keep = false;
      try {
        json::Value m = json::parse(line);
        keep = m.is_object() && m.contains("step") && m.at("step").as_int("step") <= start_;
      } catch (const std::exception&) {
        keep = false;  // a line cut by a crash
      }
      if (keep)
        kept += line + "\n";
      else
        ++dropped;
    }
    if (dropped > 0) {
      write_text_atomic(path, kept);
      log_warn("metrics file ", path, ": dropped ", dropped, " line(s) after step ", start_,
               " (from an earlier or interrupted run)");
    }
  }
  metrics_ = std::fopen(path.c_str(), "a");
  COLOSSAL_CHECK_INPUT(metrics_, "option 'metrics_file' (", path,
                       "): cannot open it: ", std::strerror(errno));
}

// Rank 0, --tensorboard: a new event file in the folder, opened by a SessionLog START at the
// run's first step. TensorBoard takes every START after the folder's first as a restart and drops
// the points of that step and later read before it: what an earlier attempt wrote after the
// checkpoint a run resumes from, or all of an older run when a fresh one starts there (as the
// metrics file drops its lines).
void Trainer::open_tensorboard() {
  if (!rank0_ || c_.tensorboard.empty()) return;
  tb_ = std::make_unique<TensorBoardWriter>(c_.tensorboard);
  tb_->session_start(start_ + 1);
  tb_->flush();
  log_info("TensorBoard event file: ", tb_->path());
}

// Every line is flushed and checked: a full disk or a broken file stops the run at once,
// naming the file, rather than cutting the record silently.
void Trainer::write_metrics_line(const std::string& line) {
  if (std::fputs(line.c_str(), metrics_) < 0 || std::fflush(metrics_) != 0)
    throw Error(str("cannot write the metrics file ", c_.metrics_file, ": ", std::strerror(errno)));
}

// A step is non-finite when its loss or gradient norm is inf/nan (fp32 and bf16 then skip the
// update, logged, and the run would go on learning nothing), except an fp16 step that the loss
// scaler skipped while it still had room to back off (warm-up overflows are normal); with the
// scale at its floor a skip counts. After max_nonfinite_steps in a row the run stops.
void Trainer::check_finite_step(int64_t done, const StepStats& st) {
  OptimizerWrapper& opt = *boosted_.optimizer;
  bool bad = !std::isfinite(st.loss) || !std::isfinite(opt.last_grad_norm());
  // fp16: an overflow skip (a non-finite gradient norm) is bad only when the loss itself is not
  // finite or the scale cannot back off any further.
  if (!st.stepped && opt.scaler())
    bad = !std::isfinite(st.loss) || opt.loss_scale() <= opt.scaler()->options().min_scale;
  if (!bad) {
    nonfinite_run_ = 0;
    return;
  }
  ++nonfinite_run_;
  if (nonfinite_run_ == 1 && rank0_)
    log_warn("step ", done, ": loss ", st.loss, ", grad norm ", opt.last_grad_norm(),
             st.stepped ? "" : str(", skipped at loss scale ", opt.loss_scale()), ": not finite");
  if (c_.max_nonfinite_steps > 0 && nonfinite_run_ >= c_.max_nonfinite_steps) {
    std::string latest;
    if (!c_.save_dir.empty() && fs::exists(c_.save_dir + "/latest"))
      latest = str("; ", c_.save_dir, "/latest still names the last finite checkpoint");
    throw Error(str("training diverged: ", nonfinite_run_,
                    " consecutive steps with a non-finite loss or gradient norm (steps ",
                    done - nonfinite_run_ + 1, "-", done, ", last loss ", st.loss, ", grad norm ",
                    opt.last_grad_norm(), "); stopped by max_nonfinite_steps ",
                    c_.max_nonfinite_steps, latest,
                    ". Lower the lr, raise warmup or clip gradients (max_grad_norm)"));
  }
}

// The stop signal as every rank sees it: the MAX over the ranks of what each has received, so
// all of them stop (and save) at the same step.
int Trainer::agreed_stop_signal() const {
  int sig = g_stop_signal;
  if (distributed_ && dist::world_size() > 1) {
    at::Tensor t = at::full({1}, static_cast<double>(sig), at::kDouble);
    dist::world_cpu().all_reduce(t, dist::ReduceOp::Max);
    sig = static_cast<int>(t.item<double>());
  }
  return sig;
}

// Whether every parameter this rank holds (then on all ranks) is finite: a checkpoint of a
// diverged model must never become `latest`. (A step whose gradients are not finite is skipped
// by the optimizer wrapper, so only finite updates reach the weights: what can break them is an
// update out of range, which this catches.)
bool Trainer::model_is_finite() const {
  std::vector<at::Tensor> bad;
  for (const auto& p : model_->parameters(true)) {
    if (!p.defined() || p.numel() == 0 || !p.has_storage()) continue;
    // Gemini points the parameters of chunks it has released at an expanded NaN placeholder
    // (one element of storage): their values live in the chunks, not there.
    if (p.storage().nbytes() < static_cast<size_t>(p.numel()) * p.element_size()) continue;
    bad.push_back(at::isfinite(p.detach()).all().logical_not().to(at::kCPU));
  }
  double any = bad.empty() ? 0.0 : at::stack(bad).any().item<bool>() ? 1.0 : 0.0;
  if (distributed_ && dist::world_size() > 1) {
    at::Tensor t = at::full({1}, any, at::kDouble);
    dist::world_cpu().all_reduce(t, dist::ReduceOp::Max);
    any = t.item<double>();
  }
  return any == 0.0;
}

// Rank 0: trainer_state.json (with the config and the data's fingerprint, which a resume checks)
// and the RNG state, into the staging folder `path`.
void Trainer::write_trainer_state(const std::string& path, int64_t step) const {
  json::Value st = json::Value::object();
  st.set("step", step);
  st.set("global_batch", G_);
  st.set("seq_len", c_.seq_len);
  st.set("sampler", boosted_.dataloader->state_dict());
  st.set("config", config_json_);
  // What `colossal report` shows of the run besides the options, and where its metrics are.
  st.set("run", run_facts());
  if (!c_.metrics_file.empty()) st.set("metrics_file", fs::absolute(c_.metrics_file).string());
  if (data_fingerprint_.is_null()) data_fingerprint_ = data_fingerprint(c_.data);
  st.set("data", data_fingerprint_);
  write_text_atomic(path + "/trainer_state.json", st.dump(2));
  checkpoint::TensorList rng{{"cpu", Accelerator::cpu().get_rng_state()}};
  if (device_.is_cuda()) rng.emplace_back("cuda", Accelerator::cuda().get_rng_state().to(at::kCPU));
  checkpoint::save_safetensors(path + "/rng.safetensors", rng, {{"format", "colossal-rng"}});
}

// Rank 0, once every file of step-N is written (at once, or on the async writer's thread): the
// staged folder becomes step-N, `latest` names it, then --keep_last prunes (after `latest`, so
// the newest is never a candidate; the lock is rank 0's for the whole run).
void publish_step(checkpoint::StagedDirectory& staged, const std::string& save_dir, int64_t step,
                  int64_t keep_last, const std::string& how) {
  staged.commit();
  write_text_atomic(save_dir + "/latest", step_dir_name(step) + "\n");
  log_info("saved checkpoint ", staged.target(), how);
  for (const auto& name : prune_steps(save_dir, keep_last))
    log_info("keep_last ", keep_last, ": removed ", save_dir, "/", name);
}

// A training checkpoint in save_dir/step-N (staged, then renamed) and `latest` naming it; then
// --keep_last's pruning. Refused (Error, every rank) when the model is not finite.
std::string Trainer::save(int64_t step) {
  if (!model_is_finite()) {
    throw Error(str("refusing to save step ", step, " to ", c_.save_dir,
                    ": the model's parameters are not all finite (the run diverged); latest "
                    "keeps naming the last finite checkpoint"));
  }
  if (c_.async_save) finish_async_save();  // one checkpoint in host memory at a time
  std::string target = c_.save_dir + "/" + step_dir_name(step);
  std::unique_ptr<checkpoint::StagedDirectory> staged;
  // Every rank writes into the same staging folder (pipeline stages write their own files);
  // rank 0 makes it here, and the checkpoint IO's barrier orders the others after that.
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  std::string path = target + ".staging";
  if (rank0_) {
    fs::create_directories(c_.save_dir);
    staged = std::make_unique<checkpoint::StagedDirectory>(target);
    COLOSSAL_CHECK(staged->path() == path, "checkpoint staging folder ", staged->path(),
                   " is not the one every rank writes to (", path, ")");
  }
  // --async_save: every file below is staged in memory and written by the Booster's writer.
  std::optional<checkpoint::WriteCapture> capture;
  if (c_.async_save) capture.emplace(booster_->async_writer());
  booster_->save_model(*boosted_.model, path + "/model");
  booster_->save_optimizer(*boosted_.optimizer, path);
  booster_->save_lr_scheduler(*boosted_.lr_scheduler, path + "/scheduler.json");
  if (rank0_) {
    write_trainer_state(path, step);
  }
  if (c_.async_save) {
    capture.reset();
    commit_async(std::move(staged), path, step);
    return target;
  }
  if (rank0_) publish_step(*staged, c_.save_dir, step, c_.keep_last, "");
  if (distributed_ && dist::world_size() > 1) dist::world_cpu().barrier();
  return target;
}

// ---- --async_save ----

void Trainer::finish_async_save() {
  booster_->async_writer().wait();
}

// Queued behind this rank's files: a marker that they are written; rank 0 then waits for every
// rank's marker (files of several ranks share the folder), drops the markers, publishes the
// folders the IO staged and the step folder, and moves `latest`. A rank killed before its marker
// leaves the step unpublished and the previous `latest` intact.
void Trainer::commit_async(std::unique_ptr<checkpoint::StagedDirectory> staged,
                           const std::string& path, int64_t step) {
  const int rank = distributed_ ? dist::rank() : 0;
  const int world = distributed_ ? dist::world_size() : 1;
  const auto timeout = distributed_ ? dist::world().timeout() : std::chrono::milliseconds(0);
  auto commits = booster_->async_writer().take_deferred_commits();
  std::shared_ptr<checkpoint::StagedDirectory> st(std::move(staged));
  auto marker = [path](int r) { return str(path, "/.written-rank", r); };
  checkpoint::AsyncWriter* writer = &booster_->async_writer();
  booster_->async_writer().enqueue(
      [=, commits = std::move(commits), save_dir = c_.save_dir, keep_last = c_.keep_last] {
        write_text_atomic(marker(rank), "");
        if (rank != 0 && commits.empty()) return;
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (int r = 0; r < world; ++r) {
          while (!fs::exists(marker(r))) {
            COLOSSAL_CHECK(std::chrono::steady_clock::now() < deadline || world == 1,
                           "asynchronous save of step ", step, ": rank ", r,
                           " did not finish writing its files; the checkpoint is not published");
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }
        if (rank != 0) {
          for (const auto& c : commits) c();
          return;
        }
        for (int r = 0; r < world; ++r) fs::remove(marker(r));
        for (const auto& c : commits) c();
        publish_step(*st, save_dir, step, keep_last,
                     str(" (in the background; rank 0: ", writer->take_stats().describe(), ")"));
      });
}

TrainResult Trainer::run() {
  if (!c_.resume.empty()) start_ = resume(c_.resume);
  if (rank0_) {
    log_info("training ", model_->config().model_type, " (",
             human_count(static_cast<double>(nn::count_parameters(*model_))),
             " parameters) with plugin ", plugin_->name(), " on ", plugin_->dp_size(),
             " data-parallel rank(s)", dims_ ? " (" + dims_->degrees().describe() + ")" : "", ", ",
             to_string(plugin_->precision()), ", global batch ", G_, " x ", c_.seq_len, " tokens, ",
             c_.steps, " steps");
  }
  if (!c_.save_dir.empty()) on_rank0_shared([&] { delete_old_run(); }, "--overwrite");
  open_metrics();
  // Every rank stops with the error when rank 0 cannot open the folder (not at a collective).
  if (!c_.tensorboard.empty()) on_rank0_shared([&] { open_tensorboard(); }, "option 'tensorboard'");
  bar_ = rank0_ && draw_progress_bar();

  TrainResult result;
  const int64_t recomputes_before = nn::checkpoint_recompute_count();
  auto t_start = std::chrono::steady_clock::now();
  for (int64_t s = start_; s < c_.steps; ++s) {
    StepStats st = train_step();
    run_seconds_ += st.seconds;
    double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    int64_t done = s + 1;
    result.steps_done = done;
    result.last_loss = st.loss;
    log_step(done, st, elapsed);
    check_finite_step(done, st);
    bool saved = false;
    if (!c_.save_dir.empty() && c_.save_every > 0 && done % c_.save_every == 0 && done < c_.steps) {
      result.last_checkpoint = save(done);
      saved = true;
    }
    if (done < c_.steps) {
      if (int sig = agreed_stop_signal(); sig != 0) {
        if (bar_) std::fputs("\n", stderr);
        if (rank0_)
          log_warn("received ", stop_signal_name(sig), ": stopping after step ", done,
                   c_.save_dir.empty() ? " (no save_dir: nothing saved)" : ", saving first");
        if (!c_.save_dir.empty() && !saved) result.last_checkpoint = save(done);
        result.stop_signal = sig;
        break;
      }
    }
  }
  if (bar_ && result.stop_signal == 0) std::fputs("\n", stderr);
  // What --grad_checkpoint did, counted where it happens (nn::checkpoint's backward re-runs).
  if (c_.grad_checkpoint && rank0_)
    log_info("activation checkpointing (", c_.ckpt_mode,
             "): ", nn::checkpoint_recompute_count() - recomputes_before, " block recomputes in ",
             result.steps_done - start_, " steps");
  if (metrics_) {
    const bool ok = std::fclose(metrics_) == 0;
    metrics_ = nullptr;
    if (!ok)
      throw Error(
          str("cannot write the metrics file ", c_.metrics_file, ": ", std::strerror(errno)));
  }
  if (tb_) {
    tb_->close();
    tb_.reset();
  }
  if (result.stop_signal == 0 && !c_.save_dir.empty() && (start_ < c_.steps || c_.resume.empty()))
    result.last_checkpoint = save(c_.steps);
  if (c_.async_save) {
    // The last checkpoint (also a signal's) is on disk and published before the run ends.
    finish_async_save();
    if (distributed_ && dist::world_size() > 1) dist::world_cpu().barrier();
  }
  // The adapter in PEFT's format beside the checkpoints, with the values of the last one (the
  // model has not changed since): gathered from the plugin's layout (Gemini's chunks, ZeRO's
  // gathers) by every rank, written by rank 0.
  if (lora_ && !result.last_checkpoint.empty()) {
    const std::string dir = c_.save_dir + "/adapter";
    booster_->save_lora_as_pretrained(*boosted_.model, dir, c_.init);
    if (rank0_) log_info("LoRA adapter (as in ", result.last_checkpoint, "): ", dir);
  }
  if (own_attention_ && rank0_) log_info("attention kernels: ", own_attention_->summary());
  if (c_.report && rank0_) write_report();
  return result;
}

json::Value Trainer::run_facts() const {
  json::Value r = json::Value::object();
  // The whole model's, from its config: under tensor or pipeline parallelism rank 0 holds a part.
  r.set("parameters", models::parameter_count(model_->config()));
  r.set("world_size", distributed_ ? dist::world_size() : 1);
  r.set("global_batch", G_);
  return r;
}

// --report: rank 0, after the last checkpoint, from the metrics file as written.
void Trainer::write_report() const {
  ReportInput in;
  in.metrics_file = c_.metrics_file;
  in.rows = read_metrics(c_.metrics_file);
  in.config = config_json_;
  in.run = run_facts();
  in.source = c_.save_dir.empty() ? c_.metrics_file : c_.save_dir;
  const std::string path = c_.save_dir.empty()
                               ? (fs::path(c_.metrics_file).parent_path() / "report.html").string()
                               : c_.save_dir + "/report.html";
  app::write_report(in, path);
  log_info("report: ", path);
}

}  // namespace

TrainResult train(const TrainConfig& c, const json::Value& config_json) {
  c.validate();
  return Trainer(c, config_json).run();
}

}  // namespace colossal::app
