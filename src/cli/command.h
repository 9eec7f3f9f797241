// Subcommand registry of the `colossal` tool: each src/cli/cmd_<name>.cpp registers itself with
// COLOSSAL_COMMAND, so adding a command never edits a shared list.
#pragma once

#include <string>
#include <vector>

namespace colossal::cli {

// argv[0] is the command's own name ("run", "check", ...).
using CommandFn = int (*)(int argc, char** argv);

struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
};

bool register_command(const Command& c);
const std::vector<Command>& commands();

}  // namespace colossal::cli

#define COLOSSAL_COMMAND(NAME, SUMMARY, FN)        \
  static const bool colossal_cmd_registered_##FN = \
      ::colossal::cli::register_command({NAME, SUMMARY, FN})
