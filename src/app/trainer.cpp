// `colossal train`'s run (see trainer.h): the config's options, and a Trainer that builds the
// pieces, resumes, steps, logs and saves.
#include "colossal/app/trainer.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "colossal/booster/booster.h"
#include "colossal/checkpoint/atomic.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/checkpoint/safetensors.h"
#include "colossal/core/accelerator.h"
#include "colossal/core/logging.h"
#include "colossal/core/options.h"
#include "colossal/data/dataloader.h"
#include "colossal/data/sampler.h"
#include "colossal/data/token_file.h"
#include "colossal/dist/parallel_dims.h"
#include "colossal/dist/runtime.h"
#include "colossal/models/llama/config.h"
#include "colossal/models/llama/model.h"
#include "colossal/nn/init.h"
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
           "append one JSON line per optimizer step (rank 0)");
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
}

void TrainConfig::validate() const {
  COLOSSAL_CHECK_INPUT(!data.empty(), "option 'data' is required: a token file to train on");
  COLOSSAL_CHECK_INPUT(warmup <= steps, "option 'warmup' (", warmup, ") must not exceed 'steps' (",
                       steps, ")");
  COLOSSAL_CHECK_INPUT(save_every == 0 || !save_dir.empty(),
                       "option 'save_every' needs 'save_dir'");
  plugin.validate();
}

namespace {

namespace fs = std::filesystem;

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

void write_text_atomic(const std::string& path, const std::string& text) {
  checkpoint::write_file_atomic(
      path, [&](int fd) { checkpoint::write_all(fd, text.data(), text.size(), path); });
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  COLOSSAL_CHECK_INPUT(f, "cannot read ", path);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// A step folder, or a save_dir whose `latest` names one.
std::string resolve_checkpoint(const std::string& dir) {
  if (fs::exists(dir + "/trainer_state.json")) return dir;
  if (fs::exists(dir + "/latest")) {
    std::string step = dir + "/" + read_text(dir + "/latest");
    COLOSSAL_CHECK_INPUT(fs::exists(step + "/trainer_state.json"), "checkpoint ", step,
                         " (named by ", dir, "/latest) has no trainer_state.json");
    return step;
  }
  throw InputError(
      str("resume: ", dir, " is not a training checkpoint (no trainer_state.json and no latest)"));
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
  void build_data();
  std::shared_ptr<optim::AdamW> build_optimizer() const;
  void check_tokens(const at::Tensor& inputs, const at::Tensor& targets) const;
  int64_t resume(const std::string& checkpoint);  // returns the step it continues from
  StepStats train_step();
  void log_step(int64_t done, const StepStats& st, double elapsed);
  std::string save(int64_t step);
  // --async_save: waits until the previous checkpoint is written and published (rethrows its
  // error); then queues this save's publication (commit_async).
  void finish_async_save();
  void commit_async(std::unique_ptr<checkpoint::StagedDirectory> staged, const std::string& path,
                    int64_t step);

  const TrainConfig& c_;
  const json::Value& config_json_;
  const bool distributed_, rank0_;
  std::shared_ptr<dist::ParallelDims> dims_;
  std::shared_ptr<Plugin> plugin_;
  std::shared_ptr<models::CausalLM> model_;
  std::shared_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<Booster> booster_;
  Boosted boosted_;
  at::Device device_{at::kCPU};
  int64_t G_ = 0;  // global batch (sequences per optimizer step)
  int64_t start_ = 0;
  double run_seconds_ = 0;
  std::FILE* metrics_ = nullptr;
  bool bar_ = false;
};

Trainer::Trainer(const TrainConfig& c, const json::Value& config_json)
    : c_(c),
      config_json_(config_json),
      distributed_(dist::is_initialized()),
      rank0_(!distributed_ || dist::rank() == 0) {
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
  booster_ = std::make_unique<Booster>(plugin_);
  boosted_ = booster_->boost(model_, adamw, {}, loader, lr_scheduler);
  if (c.device == "cuda") device_ = Accelerator::cuda().device();
}

// An HF folder, or a preset / config.json initialised by name (same weights for any layout).
void Trainer::build_model() {
  if (!c_.init.empty()) {
    model_ = checkpoint::load_pretrained(c_.init);
    log_info("model from ", c_.init);
  } else {
    models::ModelConfig cfg = fs::exists(c_.model) ? models::ModelConfig::from_file(c_.model)
                                                   : models::ModelConfig::preset(c_.model);
    model_ = std::make_shared<models::CausalLM>(cfg);
    nn::InitOptions io;
    io.seed = static_cast<uint64_t>(c_.seed);
    io.std = cfg.initializer_range;
    nn::init_parameters(*model_, io);
  }
  const models::ModelConfig& mcfg = model_->config();
  COLOSSAL_CHECK_INPUT(c_.seq_len <= mcfg.max_position_embeddings, "seq_len ", c_.seq_len,
                       " exceeds the model's max_position_embeddings ",
                       mcfg.max_position_embeddings);
}

void Trainer::build_data() {
  auto file =
      std::make_shared<data::TokenFile>(c_.data, data::token_format_from_string(c_.data_format));
  dataset_ = std::make_shared<data::TokenDataset>(file, c_.seq_len);
  COLOSSAL_CHECK_INPUT(dataset_->num_samples() >= 1, c_.data, " holds ", file->size(),
                       " tokens: too few for one sample of seq_len ", c_.seq_len, " (needs ",
                       c_.seq_len + 1, ")");
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

int64_t Trainer::resume(const std::string& checkpoint) {
  const int64_t S = c_.seq_len;
  std::string dir = resolve_checkpoint(checkpoint);
  json::Value state = json::parse_file(dir + "/trainer_state.json");
  int64_t ck_g = state.at("global_batch").as_int("global_batch"),
          ck_s = state.at("seq_len").as_int("seq_len");
  COLOSSAL_CHECK_INPUT(ck_g == G_ && ck_s == S, "resume: checkpoint ", dir,
                       " was trained with global batch ", ck_g, " x seq_len ", ck_s,
                       ", this run uses ", G_, " x ", S,
                       " (micro_batch * ranks * accumulation must match to continue the same run)");
  booster_->load_model(*boosted_.model, dir + "/model", /*strict=*/true, boosted_.optimizer.get());
  booster_->load_optimizer(*boosted_.optimizer, dir);
  booster_->load_lr_scheduler(*boosted_.lr_scheduler, dir + "/scheduler.json");
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
  for (int64_t a = 0; a < A; ++a) {
    if (plugin_->support_pipeline()) {
      // Pipeline stages: the plugin's schedule runs forward and backward over micro-batches of
      // this batch; the loss of the step comes back from the last stage on every rank.
      std::unique_ptr<NoSyncGuard> guard;
      if (a + 1 < A) guard = booster_->no_sync(mw, &opt);
      BatchIterator next = [&] {
        auto [inputs, targets] = dataloader.next();
        check_tokens(inputs, targets);
        return std::make_pair(inputs.to(device_), targets.to(device_));
      };
      Criterion criterion;
      if (!c_.fused_ce)
        criterion = [](const at::Tensor& logits, const at::Tensor& targets) {
          return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                        targets.reshape({-1}));
        };
      PipelineStep ps;
      ps.loss_weight = 1.0 / static_cast<double>(A);
      ps.ce_chunk_tokens = c_.fused_ce ? c_.ce_chunk_tokens : 0;
      PipelineOutput out = booster_->execute_pipeline(next, mw, criterion, &opt, true, false, ps);
      local_loss += out.loss.item<double>();
      continue;
    }
    auto [inputs, targets] = dataloader.next();
    check_tokens(inputs, targets);
    inputs = inputs.to(device_);
    targets = targets.to(device_);
    std::unique_ptr<NoSyncGuard> guard;
    if (a + 1 < A) guard = booster_->no_sync(mw, &opt);
    // This rank's part (a sequence shard under sequence parallelism); the loss below is the
    // mean over its own targets (what is reported; averaged over the ranks).
    LocalBatch lb = plugin_->local_batch(inputs, targets);
    models::ForwardOptions fo;
    fo.seq_offset = lb.seq_offset;
    fo.global_seq_len = lb.global_seq_len;
    if (lb.positions.defined()) fo.positions = lb.positions.to(lb.inputs.device());
    at::Tensor loss;
    // A head sharded over the vocabulary (the tensor-parallel plan's) returns sharded logits:
    // its loss is always the vocab-parallel one (one chunk of every token without fused_ce).
    const bool vocab_head = model_->vocab_parallel_head();
    if (c_.fused_ce || vocab_head) {
      loss = model_->forward_loss(lb.inputs, lb.targets, c_.fused_ce ? c_.ce_chunk_tokens : 0, fo) /
             static_cast<double>(A);
    } else {
      at::Tensor logits = model_->forward(lb.inputs, fo);
      loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                    lb.targets.reshape({-1})) /
             static_cast<double>(A);
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
  if (device_.is_cuda()) Accelerator::cuda().synchronize();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// Rank 0: the metrics line, and the progress bar or a log line.
void Trainer::log_step(int64_t done, const StepStats& st, double elapsed) {
  if (!rank0_) return;
  const int64_t S = c_.seq_len;
  OptimizerWrapper& opt = *boosted_.optimizer;
  const double tok_s = static_cast<double>(G_ * S) / st.seconds;
  if (metrics_) {
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
    std::string line = m.dump() + "\n";
    std::fputs(line.c_str(), metrics_);
    std::fflush(metrics_);
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

// A training checkpoint in save_dir/step-N (staged, then renamed) and `latest` naming it.
std::string Trainer::save(int64_t step) {
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
    json::Value st = json::Value::object();
    st.set("step", step);
    st.set("global_batch", G_);
    st.set("seq_len", c_.seq_len);
    st.set("sampler", boosted_.dataloader->state_dict());
    st.set("config", config_json_);
    write_text_atomic(path + "/trainer_state.json", st.dump(2));
    checkpoint::TensorList rng{{"cpu", Accelerator::cpu().get_rng_state()}};
    if (device_.is_cuda())
      rng.emplace_back("cuda", Accelerator::cuda().get_rng_state().to(at::kCPU));
    checkpoint::save_safetensors(path + "/rng.safetensors", rng, {{"format", "colossal-rng"}});
  }
  if (c_.async_save) {
    capture.reset();
    commit_async(std::move(staged), path, step);
    return target;
  }
  if (rank0_) {
    staged->commit();
    write_text_atomic(c_.save_dir + "/latest", step_dir_name(step) + "\n");
    log_info("saved checkpoint ", target);
  }
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
  booster_->async_writer().enqueue([=, commits = std::move(commits), save_dir = c_.save_dir] {
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
    st->commit();
    write_text_atomic(save_dir + "/latest", step_dir_name(step) + "\n");
    log_info("saved checkpoint ", st->target(), " (written in the background)");
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
  if (rank0_ && !c_.metrics_file.empty()) {
    metrics_ = std::fopen(c_.metrics_file.c_str(), "a");
    COLOSSAL_CHECK_INPUT(metrics_, "cannot open metrics file ", c_.metrics_file);
  }
  bar_ = rank0_ && draw_progress_bar();

  TrainResult result;
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
    if (!c_.save_dir.empty() && c_.save_every > 0 && done % c_.save_every == 0 && done < c_.steps)
      result.last_checkpoint = save(done);
  }
  if (bar_) std::fputs("\n", stderr);
  if (metrics_) std::fclose(metrics_);
  metrics_ = nullptr;
  if (!c_.save_dir.empty() && (start_ < c_.steps || c_.resume.empty()))
    result.last_checkpoint = save(c_.steps);
  if (c_.async_save) {
    finish_async_save();  // the last checkpoint is on disk and published before the run ends
    if (distributed_ && dist::world_size() > 1) dist::world_cpu().barrier();
  }
  return result;
}

}  // namespace

TrainResult train(const TrainConfig& c, const json::Value& config_json) {
  c.validate();
  return Trainer(c, config_json).run();
}

}  // namespace colossal::app
