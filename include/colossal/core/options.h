// Typed options: a struct's fields registered once (name, section, help, default, validation)
// become both the keys of a TOML/JSON config file and command-line flags, Megatron-style. The
// struct stays the single source of truth; an unknown key, a wrong type or an impossible value is
// an InputError naming it and where it came from.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "colossal/core/json.h"

namespace colossal {

class OptionSet {
 public:
  // `name` is the flag (--name, '-' and '_' equivalent) and the key in the file; `section` is
  // the TOML table it may also appear under ([section] name = ...). Each add() returns *this.
  OptionSet& add(const std::string& section, const std::string& name, int64_t* target,
                 const std::string& help);
  OptionSet& add(const std::string& section, const std::string& name, int* target,
                 const std::string& help);
  OptionSet& add(const std::string& section, const std::string& name, double* target,
                 const std::string& help);
  OptionSet& add(const std::string& section, const std::string& name, bool* target,
                 const std::string& help);
  OptionSet& add(const std::string& section, const std::string& name, std::string* target,
                 const std::string& help, std::vector<std::string> choices = {});
  // Range checks applied by validate(); messages name the option and the value.
  OptionSet& min(const std::string& name, double lo);
  OptionSet& max(const std::string& name, double hi);
  // Another name for option `name`: a long one ("prefetch_num": --prefetch_num on the command
  // line, a key in a file) or a short flag ("-p"), so a program keeps the flag names its users
  // know (ColossalAI's) while the struct field keeps one name.
  OptionSet& alias(const std::string& name, const std::string& alias);
  // What help() shows as the default when the field's initial value is not it (a default that
  // is decided later, e.g. "bf16 on cuda, fp32 on cpu").
  OptionSet& default_text(const std::string& name, const std::string& text);

  // A config object (parsed TOML or JSON). Unknown keys/sections, non-finite numbers and an
  // option given twice in it (top level and its [section], or two of its names) are errors
  // naming `source`.
  void apply(const json::Value& config, const std::string& source);
  // Flags: --name value | --name=value | -a value (a short alias) | --flag (bools; also
  // --flag true|false, and without allow_rest any word after a bool flag is its value, so
  // `--flag maybe` is an error naming the flag). Returns the arguments it did not consume only
  // when allow_rest; otherwise an unknown flag is an error.
  std::vector<std::string> apply_flags(const std::vector<std::string>& args,
                                       bool allow_rest = false);
  // Checks min/max/choices and finiteness of every option (call after apply/apply_flags); the
  // message names the file or flag the value came from.
  void validate() const;
  bool was_set(const std::string& name) const;  // by file or flag (any of its names)
  std::string help() const;
  // Current values as a JSON object grouped by section (what a run actually used).
  json::Value to_json() const;

 private:
  using Target = std::variant<int64_t*, int*, double*, bool*, std::string*>;
  struct Opt {
    std::string section, name, help;
    Target target;
    std::vector<std::string> choices;
    bool has_min = false, has_max = false;
    double lo = 0, hi = 0;
    std::string default_repr;
    std::vector<std::string> aliases;  // long ones normalised ("prefetch_num"), short with '-'
  };
  Opt* find(const std::string& name);
  const Opt* find(const std::string& name) const;
  void set_from_json(Opt& o, const json::Value& v, const std::string& where);
  // `what` names the option as the user wrote it ("flag --prefetch_num", "flag -b").
  void set_from_string(Opt& o, const std::string& v, const std::string& what);
  static std::string display_name(const Opt& o);  // "'name'" or "'name' (-w, --warmup_ratio)"
  OptionSet& add_opt(Opt o);
  std::vector<Opt> opts_;
  std::map<std::string, std::string> set_;  // option -> where it was set ("flag --lr")
};

// The items of a comma-separated option value ("q_proj,v_proj"), empty items dropped.
std::vector<std::string> split_list(const std::string& value);

}  // namespace colossal
