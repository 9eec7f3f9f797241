// `colossal <command> [options]`: dispatches to the registered subcommands and turns errors into
// one clear line and an exit code (2 for bad input, 1 for other failures).
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "cli/command.h"
#include "colossal/core/error.h"
#include "colossal/core/version.h"
#include "colossal/kernels/attention.h"

namespace colossal::cli {

std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}
bool register_command(const Command& c) {
  registry().push_back(c);
  return true;
}
const std::vector<Command>& commands() {
  return registry();
}

}  // namespace colossal::cli

namespace {
void print_help() {
  std::printf("colossal %s: ColossalAI's large-model training system in C++\n\n",
              colossal::version().c_str());
  std::printf(
      "usage: colossal <command> [options]   (colossal <command> --help for its "
      "options)\n\ncommands:\n");
  auto cmds = colossal::cli::commands();
  std::sort(cmds.begin(), cmds.end(),
            [](auto& a, auto& b) { return std::strcmp(a.name, b.name) < 0; });
  for (const auto& c : cmds) std::printf("  %-10s %s\n", c.name, c.summary);
}
// A CUDA error after one of our kernels stopped a hung wait: say which wait it was.
void report_kernel_hang(const char* name) {
  const std::string hang = colossal::kernels::attention_hang_report();
  if (!hang.empty()) std::fprintf(stderr, "colossal %s: %s\n", name, hang.c_str());
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("%s\n", colossal::version().c_str());
    return 0;
  }
  const char* name = argv[1];
  for (const auto& c : colossal::cli::commands()) {
    if (std::strcmp(c.name, name) != 0) continue;
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const colossal::InputError& e) {
      std::fprintf(stderr, "colossal %s: error: %s\n", name, e.what());
      return 2;
    } catch (const colossal::Error& e) {
      std::fprintf(stderr, "colossal %s: error: %s\n", name, e.what());
      return 1;
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "colossal %s: error: %s\n", name, e.what_without_backtrace());
      report_kernel_hang(name);
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "colossal %s: error: %s\n", name, e.what());
      report_kernel_hang(name);
      return 1;
    }
  }
  std::fprintf(stderr, "colossal: unknown command '%s' (see colossal --help)\n", name);
  return 2;
}
