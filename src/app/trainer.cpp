#include "colossal/app/trainer.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

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
#include "colossal/dist/runtime.h"
#include "colossal/nn/causal_lm.h"
#include "colossal/nn/config.h"
#include "colossal/nn/init.h"
#include "colossal/optim/adamw.h"
#include "colossal/optim/lr_scheduler.h"

namespace colossal::booster {

void TrainConfig::register_options(OptionSet& s) {
  s.add("model", "model", &model, "preset (tiny|100m|1b|7b|13b|70b) or path to an HF config.json")
      .add("model", "init", &init, "HF model folder to start from (its config and weights)")
      .add("data", "data", &data, "token file: llm.c .bin, or raw uint16/uint32 (see README)")
      .add("data", "data_format", &data_format, "token file format", {"auto", "u16", "u32", "llmc", "llmc-llama3"})
      .add("data", "seq_len", &seq_len, "sequence length S")
      .add("data", "shuffle", &shuffle, "shuffle samples (a permutation seeded by seed and epoch)")
      .add("train", "micro_batch", &micro_batch, "sequences per rank per micro-step (B)")
      .add("train", "accumulation", &accumulation, "micro-steps per optimizer step")
      .add("train", "steps", &steps, "optimizer steps in total")
      .add("train", "seed", &seed, "seed of initialization and data order")
      .add("train", "device", &device, "device", {"cpu", "cuda"})
      .add("train", "log_every", &log_every, "log a line every N steps (when no progress bar is drawn)")
      .add("train", "fused_ce", &fused_ce, "loss by chunked fused linear + cross-entropy (no full logits)")
      .add("train", "ce_chunk_tokens", &ce_chunk_tokens, "tokens per chunk of the fused cross-entropy")
      .add("optim", "lr", &lr, "peak learning rate")
      .add("optim", "schedule", &schedule, "learning-rate schedule", {"constant", "linear", "cosine"})
      .add("optim", "warmup", &warmup, "warmup steps")
      .add("optim", "min_lr_ratio", &min_lr_ratio, "final lr as a fraction of lr (linear, cosine)")
      .add("optim", "weight_decay", &weight_decay, "AdamW weight decay (matrices only)")
      .add("optim", "beta1", &beta1, "AdamW beta1")
      .add("optim", "beta2", &beta2, "AdamW beta2")
      .add("optim", "eps", &eps, "AdamW epsilon")
      .add("optim", "max_grad_norm", &max_grad_norm, "clip the global gradient norm (0: off)")
      .add("plugin", "plugin", &plugin, "parallel strategy (zero1/zero2: low_level_zero at that stage)",
           {"none", "ddp", "low_level_zero", "zero1", "zero2", "gemini"});
  ddp.register_options(s);
  zero.register_options(s);
  gemini.register_options(s);
  s.add("checkpoint", "save_dir", &save_dir, "folder for training checkpoints (step-N/ and latest)")
      .add("checkpoint", "save_every", &save_every, "save every N optimizer steps (0: at the end only)")
      .add("checkpoint", "resume", &resume, "continue from a checkpoint folder (a step-N/ or a save_dir)")
      .add("checkpoint", "metrics_file", &metrics_file, "append one JSON line per optimizer step (rank 0)");
  s.min("seq_len", 1).min("micro_batch", 1).min("accumulation", 1).min("steps", 1).min("seed", 0).min("log_every", 1);
  s.min("lr", 0).min("warmup", 0).min("min_lr_ratio", 0).max("min_lr_ratio", 1).min("weight_decay", 0);
  s.min("beta1", 0).max("beta1", 0.999999).min("beta2", 0).max("beta2", 0.99999999).min("eps", 0);
  s.min("max_grad_norm", 0).min("save_every", 0).min("ce_chunk_tokens", 1);
}

void TrainConfig::validate() const {
  COLOSSAL_CHECK_INPUT(!data.empty(), "option 'data' is required: a token file to train on");
  COLOSSAL_CHECK_INPUT(warmup <= steps, "option 'warmup' (", warmup, ") must not exceed 'steps' (", steps, ")");
  COLOSSAL_CHECK_INPUT(save_every == 0 || !save_dir.empty(), "option 'save_every' needs 'save_dir'");
  precision_from_string(ddp.precision);
  COLOSSAL_CHECK_INPUT(!(plugin == "zero1" && zero.stage != 1), "--plugin zero1 contradicts --stage ", zero.stage);
}

namespace {

namespace fs = std::filesystem;

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

void write_text_atomic(const std::string& path, const std::string& text) {
  checkpoint::write_file_atomic(path, [&](int fd) { checkpoint::write_all(fd, text.data(), text.size(), path); });
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
    COLOSSAL_CHECK_INPUT(fs::exists(step + "/trainer_state.json"), "checkpoint ", step, " (named by ", dir,
                         "/latest) has no trainer_state.json");
    return step;
  }
  throw InputError(str("resume: ", dir, " is not a training checkpoint (no trainer_state.json and no latest)"));
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
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600), (long long)(t / 60 % 60), (long long)(t % 60));
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
  std::snprintf(line, sizeof line, "\rstep %lld/%lld [%s] loss %.4f | lr %.2e | %s tok/s | ETA %s   ",
                (long long)step, (long long)total, bar.c_str(), loss, lr, human_count(tok_s).c_str(),
                human_time(eta).c_str());
  std::fputs(line, stderr);
  std::fflush(stderr);
}

}  // namespace

TrainResult train(const TrainConfig& c, const json::Value& config_json) {
  c.validate();
  const bool distributed = dist::is_initialized();
  const int rank = distributed ? dist::rank() : 0;
  const bool rank0 = rank == 0;

  // Plugin.
  DDPOptions ddp = c.ddp;
  ddp.device = c.device;
  std::shared_ptr<Plugin> plugin;
  if (c.plugin == "ddp") {
    plugin = std::make_shared<DDPPlugin>(ddp);
  } else if (c.plugin == "low_level_zero" || c.plugin == "zero1" || c.plugin == "zero2") {
    // Precision and loss-scale flags are shared with ddp (so `colossal train` defaults to fp32,
    // not ColossalAI's fp16, and to the initial scale 2**16).
    ZeroOptions zero = c.zero;
    if (c.plugin == "zero2") zero.stage = 2;
    zero.precision = ddp.precision;
    zero.device = c.device;
    zero.loss_scale = ddp.loss_scale;
    plugin = std::make_shared<LowLevelZeroPlugin>(zero);
  } else if (c.plugin == "gemini") {
    GeminiPluginOptions gemini = c.gemini;
    gemini.precision = ddp.precision;
    gemini.device = c.device;
    gemini.loss_scale = ddp.loss_scale;
    gemini.communication_dtype = c.zero.communication_dtype;
    plugin = std::make_shared<GeminiPlugin>(gemini);
  } else {
    plugin = std::make_shared<NonePlugin>(ddp.precision, c.device, ddp.loss_scale);
  }

  // Model: an HF folder, or a preset / config.json initialised by name (same weights for any layout).
  std::shared_ptr<nn::CausalLM> model;
  if (!c.init.empty()) {
    model = checkpoint::load_pretrained(c.init);
    log_info("model from ", c.init);
  } else {
    nn::ModelConfig cfg = fs::exists(c.model) ? nn::ModelConfig::from_file(c.model) : nn::ModelConfig::preset(c.model);
    model = std::make_shared<nn::CausalLM>(cfg);
    nn::InitOptions io;
    io.seed = static_cast<uint64_t>(c.seed);
    io.std = cfg.initializer_range;
    nn::init_parameters(*model, io);
  }
  const nn::ModelConfig& mcfg = model->config();
  COLOSSAL_CHECK_INPUT(c.seq_len <= mcfg.max_position_embeddings, "seq_len ", c.seq_len,
                       " exceeds the model's max_position_embeddings ", mcfg.max_position_embeddings);

  // Data.
  auto file = std::make_shared<data::TokenFile>(c.data, data::token_format_from_string(c.data_format));
  auto dataset = std::make_shared<data::TokenDataset>(file, c.seq_len);
  COLOSSAL_CHECK_INPUT(dataset->num_samples() >= 1, c.data, " holds ", file->size(), " tokens: too few for one sample of seq_len ",
                       c.seq_len, " (needs ", c.seq_len + 1, ")");

  // Optimizer: weight decay on matrices only.
  auto adamw = std::make_shared<optim::AdamW>();
  std::vector<optim::NamedParam> decay, no_decay;
  for (auto& item : model->named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    (item.value().dim() >= 2 ? decay : no_decay).push_back({item.key(), item.value()});
  }
  optim::GroupOptions g;
  g.lr = c.lr;
  g.beta1 = c.beta1;
  g.beta2 = c.beta2;
  g.eps = c.eps;
  g.weight_decay = c.weight_decay;
  if (!decay.empty()) adamw->add_param_group(decay, g);
  g.weight_decay = 0.0;
  if (!no_decay.empty()) adamw->add_param_group(no_decay, g);

  optim::LRScheduleOptions so;
  so.kind = optim::schedule_kind_from_string(c.schedule);
  so.warmup_steps = c.warmup;
  so.total_steps = c.steps;
  so.min_lr_ratio = c.min_lr_ratio;
  auto lr_scheduler = std::make_shared<optim::LRScheduler>(*adamw, so);

  const int64_t B = c.micro_batch, D = plugin->dp_size(), A = c.accumulation, S = c.seq_len;
  const int64_t G = B * D * A;
  auto loader = plugin->prepare_dataloader(dataset, B, c.shuffle, static_cast<uint64_t>(c.seed), A);

  Booster booster(plugin);
  Boosted boosted = booster.boost(model, adamw, {}, loader, lr_scheduler);
  ModelWrapper& mw = *boosted.model;
  OptimizerWrapper& opt = *boosted.optimizer;
  optim::LRScheduler& scheduler = *boosted.lr_scheduler;
  data::DataLoader& dataloader = *boosted.dataloader;
  const at::Device device = c.device == "cuda" ? Accelerator::cuda().device() : at::Device(at::kCPU);

  int64_t start = 0;
  if (!c.resume.empty()) {
    std::string dir = resolve_checkpoint(c.resume);
    json::Value state = json::parse_file(dir + "/trainer_state.json");
    int64_t ck_g = state.at("global_batch").as_int("global_batch"), ck_s = state.at("seq_len").as_int("seq_len");
    COLOSSAL_CHECK_INPUT(ck_g == G && ck_s == S, "resume: checkpoint ", dir, " was trained with global batch ", ck_g,
                         " x seq_len ", ck_s, ", this run uses ", G, " x ", S,
                         " (micro_batch * ranks * accumulation must match to continue the same run)");
    booster.load_model(mw, dir + "/model", /*strict=*/true, &opt);
    booster.load_optimizer(opt, dir);
    booster.load_lr_scheduler(scheduler, dir + "/scheduler.json");
    dataloader.load_state_dict(state.at("sampler"));
    // RNG state (nothing in this loop draws from it today, but dropout and custom models may).
    if (fs::exists(dir + "/rng.safetensors")) {
      for (auto& [name, t] : checkpoint::load_safetensors(dir + "/rng.safetensors")) {
        if (name == "cpu") Accelerator::cpu().set_rng_state(t.clone());
        if (name == "cuda" && device.is_cuda()) Accelerator::cuda().set_rng_state(t.clone());
      }
    }
    start = state.at("step").as_int("step");
    COLOSSAL_CHECK_INPUT(start <= c.steps, "resume: checkpoint is at step ", start, ", beyond steps ", c.steps);
    log_info("resumed from ", dir, " at step ", start);
  }

  if (rank0) {
    log_info("training ", mcfg.model_type, " (", human_count(static_cast<double>(nn::count_parameters(*model))),
             " parameters) with plugin ", plugin->name(), " on ", D, " rank(s), ", to_string(plugin->precision()),
             ", global batch ", G, " x ", S, " tokens, ", c.steps, " steps");
  }

  std::FILE* metrics = nullptr;
  if (rank0 && !c.metrics_file.empty()) {
    metrics = std::fopen(c.metrics_file.c_str(), "a");
    COLOSSAL_CHECK_INPUT(metrics, "cannot open metrics file ", c.metrics_file);
  }
  const bool bar = rank0 && draw_progress_bar();

  auto save = [&](int64_t step) -> std::string {
    std::string target = c.save_dir + "/" + step_dir_name(step);
    std::unique_ptr<checkpoint::StagedDirectory> staged;
    std::string path = target;
    if (rank0) {
      fs::create_directories(c.save_dir);
      staged = std::make_unique<checkpoint::StagedDirectory>(target);
      path = staged->path();
    }
    booster.save_model(mw, path + "/model");
    booster.save_optimizer(opt, path);
    booster.save_lr_scheduler(scheduler, path + "/scheduler.json");
    if (rank0) {
      json::Value st = json::Value::object();
      st.set("step", step);
      st.set("global_batch", G);
      st.set("seq_len", S);
      st.set("sampler", dataloader.state_dict());
      st.set("config", config_json);
      write_text_atomic(path + "/trainer_state.json", st.dump(2));
      checkpoint::TensorList rng{{"cpu", Accelerator::cpu().get_rng_state()}};
      if (device.is_cuda()) rng.emplace_back("cuda", Accelerator::cuda().get_rng_state().to(at::kCPU));
      checkpoint::save_safetensors(path + "/rng.safetensors", rng, {{"format", "colossal-rng"}});
      staged->commit();
      write_text_atomic(c.save_dir + "/latest", step_dir_name(step) + "\n");
      log_info("saved checkpoint ", target);
    }
    if (distributed && dist::world_size() > 1) dist::world_cpu().barrier();
    return target;
  };

  TrainResult result;
  auto t_start = std::chrono::steady_clock::now();
  double run_seconds = 0.0;
  for (int64_t s = start; s < c.steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    const double lr = scheduler.lrs().front();
    double local_loss = 0.0;
    for (int64_t a = 0; a < A; ++a) {
      auto [inputs, targets] = dataloader.next();
      int64_t max_id = inputs.max().item<int64_t>();
      int64_t last = targets.select(1, S - 1).max().item<int64_t>();
      COLOSSAL_CHECK_INPUT(std::max(max_id, last) < mcfg.vocab_size, c.data, ": token id ", std::max(max_id, last),
                           " is outside the model's vocabulary (", mcfg.vocab_size, ")");
      inputs = inputs.to(device);
      targets = targets.to(device);
      std::unique_ptr<NoSyncGuard> guard;
      if (a + 1 < A) guard = booster.no_sync(mw, &opt);
      at::Tensor loss;
      if (c.fused_ce) {
        loss = model->forward_loss(inputs, targets, c.ce_chunk_tokens) / static_cast<double>(A);
      } else {
        at::Tensor logits = model->forward(inputs);
        loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1})) /
               static_cast<double>(A);
      }
      booster.backward(loss, opt);
      local_loss += loss.detach().item<double>();
    }
    if (c.max_grad_norm > 0) opt.clip_grad_by_norm(c.max_grad_norm);
    bool stepped = opt.step();
    opt.zero_grad(true);
    scheduler.step();

    double loss = local_loss;
    if (distributed && dist::world_size() > 1) {
      at::Tensor t = at::full({1}, local_loss, at::kDouble);
      dist::world_cpu().all_reduce(t, dist::ReduceOp::Avg);
      loss = t.item<double>();
    }
    if (device.is_cuda()) Accelerator::cuda().synchronize();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run_seconds += dt;
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    double tok_s = static_cast<double>(G * S) / dt;
    int64_t done = s + 1;
    result.steps_done = done;
    result.last_loss = loss;

    if (rank0) {
      if (metrics) {
        json::Value m = json::Value::object();
        m.set("step", done);
        m.set("loss", loss);
        m.set("lr", lr);
        m.set("grad_norm", opt.last_grad_norm());
        m.set("tokens", done * G * S);
        m.set("tok_s", tok_s);
        m.set("elapsed_s", elapsed);
        m.set("skipped", !stepped);
        m.set("loss_scale", opt.loss_scale());
        std::string line = m.dump() + "\n";
        std::fputs(line.c_str(), metrics);
        std::fflush(metrics);
      }
      double eta = run_seconds / static_cast<double>(done - start) * static_cast<double>(c.steps - done);
      if (bar) {
        draw_bar(done, c.steps, loss, lr, tok_s, eta);
      } else if (done % c.log_every == 0 || done == c.steps || done == start + 1) {
        log_info("step ", done, "/", c.steps, " loss ", loss, " lr ", lr, " grad_norm ", opt.last_grad_norm(), " ",
                 human_count(tok_s), " tok/s", stepped ? "" : " (skipped)");
      }
    }
    if (!c.save_dir.empty() && c.save_every > 0 && done % c.save_every == 0 && done < c.steps)
      result.last_checkpoint = save(done);
  }
  if (bar) std::fputs("\n", stderr);
  if (metrics) std::fclose(metrics);
  if (!c.save_dir.empty() && (start < c.steps || c.resume.empty())) result.last_checkpoint = save(c.steps);
  return result;
}

}  // namespace colossal::booster
