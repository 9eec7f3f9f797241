// `colossal train`: a complete training run driven by one typed config (TOML file + flags):
// model from a preset, a config.json or an HF folder; token-file data in a layout-independent
// sample order; AdamW with warmup + schedule; any plugin through the Booster; progress, metrics
// lines, atomic training checkpoints and exact resume. The app layer: above the Booster, it
// builds the pieces, picks the plugin by name (booster::make_plugin) and runs the loop.
#pragma once

#include <cstdint>
#include <string>

#include "colossal/booster/plugins/factory.h"
#include "colossal/core/json.h"

namespace colossal {
class OptionSet;
}

namespace colossal::app {

struct TrainConfig {
  // [model]
  std::string model = "tiny";  // preset name or path to an HF config.json
  std::string init;            // HF model folder to start from (config + weights)
  // [data]
  std::string data;  // token file (see data/token_file.h)
  std::string data_format = "auto";
  int64_t seq_len = 256;
  bool shuffle = true;
  // Packed documents keep to themselves: positions restart and attention stays inside each
  // document of <data>.docs, and no target predicts a document's first token from the one
  // before (data::TokenDataset). A loss mask <data>.mask, when present, is always honoured.
  bool doc_mask = false;
  // [lora] LoRA fine-tuning (nn/lora.h): the base frozen, only the adapters trained. lora_r > 0
  // adapts the layers named in lora_targets (comma-separated last name components) from our
  // initialisation; lora_adapter starts from a PEFT adapter folder (its own r, alpha, targets).
  // The adapter of the last checkpoint is written to <save_dir>/adapter in PEFT's format at the
  // end.
  int64_t lora_r = 0;
  double lora_alpha = 16;
  double lora_dropout = 0;
  std::string lora_targets = "q_proj,k_proj,v_proj,o_proj";
  bool lora_rslora = false;
  std::string lora_adapter;
  // QLoRA (nn/quantized_linear.h): the frozen base's linear layers (all but lm_head) stored as
  // nf4 or fp8 on the training device, quantized tensor by tensor as the model is loaded or
  // initialised. Needs LoRA. Checkpoints then hold the adapters and the unquantized tensors;
  // a resumed run quantizes its base again from init (deterministic: the same codes).
  std::string quantize = "none";
  // Activation checkpointing of the decoder layers (ColossalAI's grad_checkpoint): full
  // recomputes every layer in backward, attention only its core attention. Under hybrid with
  // pp_size > 1 the plugin's num_ckpt_layers_per_stage decides instead.
  bool grad_checkpoint = false;
  // FP8 training (nn/fp8_linear.h, ColossalAI's use_fp8): the linear layers' GEMMs in FP8 with
  // current scaling, by recipe; layers whose path contains one of fp8_exclude (comma-separated)
  // stay in the working precision. On the CPU the FP8 arithmetic is emulated.
  bool use_fp8 = false;
  std::string fp8_recipe = "tensorwise";
  std::string fp8_exclude = "lm_head";
  std::string ckpt_mode = "full";
  // The core attention: sdpa (LibTorch's) or own (our sm_90a kernels, nn::OwnAttention; SDPA
  // where they do not apply, counted and logged at the end); deterministic (own only): a bitwise
  // repeatable attention backward.
  std::string attn_backend = "sdpa";
  bool deterministic = false;
  // [train]
  int64_t micro_batch = 4;
  int64_t accumulation = 1;
  int64_t steps = 100;
  int64_t seed = 1024;
  std::string device = "cpu";
  int64_t log_every = 10;
  // Loss straight from the hidden states (nn::fused_linear_cross_entropy): the [B, S, vocab]
  // logits are never materialised, only ce_chunk_tokens rows of them at a time. 1024 rows keep
  // the extra memory at ~1024 * vocab * 8 bytes (0.26 GB at a 32k vocab, 1 GB at 128k) while each
  // chunk's GEMM (1024 x hidden x vocab) is still large enough to run at full speed.
  bool fused_ce = true;
  int64_t ce_chunk_tokens = 1024;
  // [optim]
  double lr = 3e-4;
  std::string schedule = "cosine";
  int64_t warmup = 0;
  double min_lr_ratio = 0.0;
  double weight_decay = 0.1;  // matrices only (dim >= 2)
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double max_grad_norm = 1.0;  // 0: no clipping
  // [plugin]: the name and every plugin's options (precision and loss scale: ddp's fields,
  // communication_dtype: zero's); booster::make_plugin builds it on `device`.
  booster::PluginOptions plugin;
  // [checkpoint]
  std::string save_dir;
  int64_t save_every = 0;  // optimizer steps; 0: only at the end
  // Write checkpoints in the background (Booster use_async): training goes on once the state is
  // staged in host memory; `latest` moves when every rank's files are written.
  bool async_save = false;
  std::string resume;  // a step folder, or a save_dir (its `latest`)
  std::string metrics_file;
  // TensorBoard event files (colossal/app/tensorboard.h) written into this folder by rank 0:
  // the metrics row's figures as scalars, one point per optimizer step (empty: none).
  std::string tensorboard;
  // At the end of the run, write report.html (colossal/app/report.h) into save_dir, or next to
  // metrics_file without one.
  bool report = false;
  // A fresh run (no resume) into a save_dir that holds a run is refused unless this is set; then
  // the old run's step-N folders and `latest` are deleted before step 1.
  bool overwrite = false;
  int64_t keep_last = 0;  // after each save, delete step folders older than the newest N (0: none)
  // Stop (non-zero exit) after this many consecutive steps whose loss or gradient norm is not
  // finite, or (fp16) whose loss scale sits at its floor while skipping; 0: never stop.
  int64_t max_nonfinite_steps = 10;

  void register_options(OptionSet& set);
  // Cross-option checks (after file + flags); InputError naming the option.
  void validate() const;
};

struct TrainResult {
  int64_t steps_done = 0;
  double last_loss = 0.0;
  std::string last_checkpoint;
  // SIGTERM / SIGUSR1 / SIGINT stopped the run (after saving at a step boundary): the signal,
  // whose 128 + signo is the exit code. 0: the run went to its end.
  int stop_signal = 0;
};

// Runs the whole training described by `config` on this rank (dist::init() done by the caller,
// or a single process). `config_json` is what gets recorded in checkpoints.
TrainResult train(const TrainConfig& config, const json::Value& config_json);

}  // namespace colossal::app
