#include "cli/args.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "colossal/core/error.h"

namespace colossal::cli {

std::string Args::norm(const std::string& s) {
  std::string out = s;
  for (auto& c : out)
    if (c == '-') c = '_';
  return out;
}

Args& Args::flag(const std::string& name, const std::string& help, const std::string& alias) {
  specs_.push_back({norm(name), help, "false", alias, true, false});
  return *this;
}
Args& Args::option(const std::string& name, const std::string& help, const std::string& def,
                   bool required, const std::string& alias) {
  specs_.push_back({norm(name), help, def, alias, false, required});
  return *this;
}
Args& Args::rest(const std::string& name, const std::string& help) {
  rest_name_ = name;
  rest_help_ = help;
  return *this;
}

const Args::Spec* Args::lookup(const std::string& name) const {
  std::string n = norm(name);
  for (const auto& s : specs_)
    if (s.name == n || (!s.alias.empty() && s.alias == name)) return &s;
  return nullptr;
}

std::string Args::usage() const {
  std::string u = "usage: colossal " + prog_ + " [options]";
  if (!rest_name_.empty()) u += " " + rest_name_ + " ...";
  u += "\n" + summary_ + "\n\noptions:\n";
  for (const auto& s : specs_) {
    std::string line = "  ";
    if (!s.alias.empty()) line += s.alias + ", ";
    line += "--" + s.name;
    if (!s.is_flag) line += " VALUE";
    if (line.size() < 30) line.append(30 - line.size(), ' ');
    line += " " + s.help;
    if (s.required)
      line += " (required)";
    else if (!s.is_flag && !s.def.empty())
      line += " [default: " + s.def + "]";
    u += line + "\n";
  }
  if (!rest_name_.empty()) u += "  " + rest_name_ + ": " + rest_help_ + "\n";
  return u;
}

void Args::parse(int argc, char** argv) {
  for (const auto& s : specs_)
    if (!s.def.empty() || s.is_flag) values_[s.name] = s.def;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    if (a == "--") {
      ++i;
      break;
    }
    if (a.size() < 2 || a[0] != '-') break;  // first positional: the rest
    std::string key = a, value;
    bool has_value = false;
    if (a.rfind("--", 0) == 0) {
      key = a.substr(2);
      auto eq = key.find('=');
      if (eq != std::string::npos) {
        value = key.substr(eq + 1);
        key = key.substr(0, eq);
        has_value = true;
      }
    }
    const Spec* s = a.rfind("--", 0) == 0 ? lookup(key) : lookup(a);
    if (!s) {
      throw InputError(colossal::str("colossal ", prog_, ": unknown option '", a,
                                     "' (see colossal ", prog_, " --help)"));
    }
    if (s->is_flag) {
      if (has_value && value != "true" && value != "false")
        throw InputError(
            colossal::str("option --", s->name, " takes true or false, got '", value, "'"));
      values_[s->name] = has_value ? value : "true";
    } else {
      if (!has_value) {
        if (i + 1 >= argc) throw InputError(colossal::str("option --", s->name, " needs a value"));
        value = argv[++i];
      }
      values_[s->name] = value;
    }
    given_[s->name] = true;
  }
  for (; i < argc; ++i) {
    if (rest_name_.empty())
      throw InputError(colossal::str("colossal ", prog_, ": unexpected argument '", argv[i], "'"));
    rest_values_.push_back(argv[i]);
  }
  for (const auto& s : specs_)
    if (s.required && !given_.count(s.name))
      throw InputError(colossal::str("colossal ", prog_, ": option --", s.name, " is required"));
}

bool Args::has(const std::string& name) const {
  return values_.count(norm(name)) > 0;
}
bool Args::given(const std::string& name) const {
  return given_.count(norm(name)) > 0;
}

std::string Args::str(const std::string& name) const {
  auto it = values_.find(norm(name));
  if (it == values_.end()) throw Error(colossal::str("option --", name, " has no value"));
  return it->second;
}

int64_t Args::i64(const std::string& name) const {
  std::string v = str(name);
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0)
    throw InputError(colossal::str("option --", norm(name), " expects an integer, got '", v, "'"));
  return x;
}

double Args::f64(const std::string& name) const {
  std::string v = str(name);
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0)
    throw InputError(colossal::str("option --", norm(name), " expects a number, got '", v, "'"));
  return x;
}

bool Args::on(const std::string& name) const {
  const std::string v = str(name);
  if (v != "true" && v != "false")
    throw InputError(colossal::str("option --", norm(name), " takes true or false, got '", v, "'"));
  return v == "true";
}

}  // namespace colossal::cli
