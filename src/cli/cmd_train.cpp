// `colossal train --config run.toml [--option value ...]`: every option of the run config is
// also a flag that overrides the file (see `colossal train --help`).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/command.h"
#include "colossal/app/trainer.h"
#include "colossal/core/error.h"
#include "colossal/core/options.h"
#include "colossal/core/toml.h"
#include "colossal/dist/runtime.h"

namespace {

int cmd_train(int argc, char** argv) {
  colossal::app::TrainConfig cfg;
  colossal::OptionSet options;
  cfg.register_options(options);
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string config_file;
  std::vector<std::string> flags;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      std::printf(
          "usage: colossal train [--config run.toml] [--option value ...]\n"
          "Trains a causal LM; every option below can be set in the TOML file (under its "
          "[section]\n"
          "or at top level) and overridden by a flag.\n%s",
          options.help().c_str());
      return 0;
    }
    if (args[i] == "--config" || args[i].rfind("--config=", 0) == 0) {
      if (args[i] == "--config") {
        if (i + 1 >= args.size()) throw colossal::InputError("option --config needs a value");
        config_file = args[++i];
      } else {
        config_file = args[i].substr(std::strlen("--config="));
      }
      continue;
    }
    flags.push_back(args[i]);
  }
  if (!config_file.empty()) options.apply(colossal::toml::parse_file(config_file), config_file);
  options.apply_flags(flags);
  options.validate();
  if (options.was_set("init") && options.was_set("model"))
    throw colossal::InputError(
        "give either --model (a preset or config.json) or --init (an HF folder), not both");

  colossal::dist::Session session;
  auto result = colossal::app::train(cfg, options.to_json());
  if (colossal::dist::rank() == 0) {
    std::fprintf(stderr, "%s: %lld steps, final loss %.4f%s%s\n",
                 result.stop_signal ? "stopped by a signal" : "done",
                 static_cast<long long>(result.steps_done), result.last_loss,
                 result.last_checkpoint.empty() ? "" : ", checkpoint ",
                 result.last_checkpoint.c_str());
  }
  // Stopped by SIGTERM/SIGUSR1/SIGINT after saving: the exit code a kill by it would give.
  return result.stop_signal ? 128 + result.stop_signal : 0;
}

}  // namespace

COLOSSAL_COMMAND("train", "train a causal LM from a TOML config and flags (any plugin)", cmd_train);
