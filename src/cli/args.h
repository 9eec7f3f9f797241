// Command-line flags for the `colossal` subcommands: declared with their help and defaults,
// parsed strictly (an unknown flag, a missing value or a value of the wrong type is an
// InputError naming the flag). `--a_b` and `--a-b` are the same flag.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace colossal::cli {

class Args {
 public:
  Args(std::string prog, std::string summary)
      : prog_(std::move(prog)), summary_(std::move(summary)) {}

  // A boolean switch (`--flag`, or `--flag=true|false`).
  Args& flag(const std::string& name, const std::string& help, const std::string& alias = "");
  // An option taking a value. Empty default + required=false means "unset unless given".
  Args& option(const std::string& name, const std::string& help, const std::string& def = "",
               bool required = false, const std::string& alias = "");
  // Everything from the first non-flag argument on (e.g. the command `colossal run` starts).
  Args& rest(const std::string& name, const std::string& help);

  // Parses argv[1..]; on --help prints usage and exits 0. Throws InputError.
  void parse(int argc, char** argv);

  bool has(const std::string& name) const;    // given on the command line, or has a default
  bool given(const std::string& name) const;  // given on the command line
  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double f64(const std::string& name) const;
  // A flag, or an option whose value is true or false (anything else is an InputError).
  bool on(const std::string& name) const;
  const std::vector<std::string>& rest_args() const { return rest_values_; }
  std::string usage() const;

 private:
  struct Spec {
    std::string name, help, def, alias;
    bool is_flag = false, required = false;
  };
  const Spec* lookup(const std::string& name) const;
  static std::string norm(const std::string& s);
  std::string prog_, summary_;
  std::vector<Spec> specs_;
  std::string rest_name_, rest_help_;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
  std::vector<std::string> rest_values_;
};

}  // namespace colossal::cli
