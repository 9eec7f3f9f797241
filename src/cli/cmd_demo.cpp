// The demo's two helpers: `colossal demo-data` writes the built-in sort-task data, and
// `colossal demo-eval` measures exact-match accuracy of a trained model on held-out inputs and
// prints a few generated samples.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli/args.h"
#include "cli/command.h"
#include "colossal/checkpoint/pretrained.h"
#include "colossal/core/logging.h"
#include "colossal/data/sort_task.h"
#include "colossal/data/token_file.h"
#include "colossal/models/llama/model.h"

namespace {

using colossal::data::SortTask;

int cmd_demo_data(int argc, char** argv) {
  colossal::cli::Args args(
      "demo-data", "Writes the demo's synthetic sort-task token file (uint16, llm.c format).");
  args.option("out", "output folder", "", true)
      .option("tokens", "training tokens", "1000000")
      .option("length", "digits per example", "6")
      .option("seed", "seed", "1");
  args.parse(argc, argv);
  SortTask task;
  task.length = args.i64("length");
  int64_t n = args.i64("tokens");
  COLOSSAL_CHECK_INPUT(n > task.example_tokens(), "--tokens must exceed one example (",
                       task.example_tokens(), ")");
  std::string out = args.str("out");
  std::filesystem::create_directories(out);
  auto stream = task.training_stream(n, static_cast<uint64_t>(args.i64("seed")));
  colossal::data::write_token_file(out + "/train.bin", stream,
                                   colossal::data::TokenFormat::LlmcGpt2);
  colossal::log_info("wrote ", out, "/train.bin: ", n, " tokens of the sort task (", task.length,
                     " digits; inputs divisible by 7 held out)");
  return 0;
}

std::string resolve_model(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(dir + "/config.json")) return dir;
  if (fs::exists(dir + "/latest")) {
    std::ifstream f(dir + "/latest");
    std::string step;
    f >> step;
    return dir + "/" + step + "/model";
  }
  throw colossal::InputError(colossal::str(
      dir, " holds no model (no config.json) and no training checkpoints (no latest)"));
}

std::string show(const std::vector<int64_t>& toks) {
  static const char* names[] = {"<pad>", "<bos>", "|", "<eos>"};
  std::string s;
  for (int64_t t : toks) {
    if (!s.empty()) s += ' ';
    s += t < SortTask::kDigit0 ? names[t] : std::to_string(t - SortTask::kDigit0);
  }
  return s;
}

int cmd_demo_eval(int argc, char** argv) {
  colossal::cli::Args args(
      "demo-eval",
      "Exact-match accuracy of a model on held-out sort-task inputs (never seen in training).");
  args.option("model", "HF model folder, or a training save_dir (its latest checkpoint)", "", true)
      .option("examples", "held-out inputs to score", "500")
      .option("length", "digits per example", "6")
      .option("show", "samples to print", "3");
  args.parse(argc, argv);
  SortTask task;
  task.length = args.i64("length");
  int64_t n = args.i64("examples");
  COLOSSAL_CHECK_INPUT(n >= 1, "--examples must be >= 1");
  auto model = colossal::checkpoint::load_pretrained(resolve_model(args.str("model")));
  c10::NoGradGuard no_grad;
  auto digits = task.draw(n, /*seed=*/777, /*held_out=*/true);
  std::vector<int64_t> flat;
  for (auto& d : digits) {
    auto p = task.prompt(d);
    flat.insert(flat.end(), p.begin(), p.end());
  }
  at::Tensor prompts = at::tensor(flat, at::kLong).view({n, task.length + 2});
  at::Tensor out = colossal::models::generate_greedy(*model, prompts, task.length);
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto row = out[i];
    std::vector<int64_t> got(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
    bool ok = got == task.answer(digits[static_cast<size_t>(i)]);
    correct += ok;
    if (i < args.i64("show"))
      std::printf("sample: %s  ->  %s   %s\n",
                  show(task.prompt(digits[static_cast<size_t>(i)])).c_str(), show(got).c_str(),
                  ok ? "(correct)" : "(wrong)");
  }
  std::printf("held-out exact match: %lld/%lld = %.1f%%\n", static_cast<long long>(correct),
              static_cast<long long>(n),
              100.0 * static_cast<double>(correct) / static_cast<double>(n));
  return 0;
}

}  // namespace

COLOSSAL_COMMAND("demo-data", "write the demo's built-in synthetic training data", cmd_demo_data);
COLOSSAL_COMMAND("demo-eval", "score a model on the demo task's held-out inputs", cmd_demo_eval);
