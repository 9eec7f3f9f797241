#include "colossal/core/options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "colossal/core/error.h"

namespace colossal {
namespace {
std::string norm(std::string s) {
  for (auto& c : s)
    if (c == '-') c = '_';
  return s;
}
template <class T>
std::string repr(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
}  // namespace

OptionSet& OptionSet::add_opt(Opt o) {
  o.name = norm(o.name);
  COLOSSAL_CHECK(find(o.name) == nullptr, "option '", o.name,
                 "' registered twice (or is an alias)");
  opts_.push_back(std::move(o));
  return *this;
}
OptionSet& OptionSet::add(const std::string& s, const std::string& n, int64_t* t,
                          const std::string& h) {
  return add_opt({s, n, h, t, {}, false, false, 0, 0, repr(*t), {}});
}
OptionSet& OptionSet::add(const std::string& s, const std::string& n, int* t,
                          const std::string& h) {
  return add_opt({s, n, h, t, {}, false, false, 0, 0, repr(*t), {}});
}
OptionSet& OptionSet::add(const std::string& s, const std::string& n, double* t,
                          const std::string& h) {
  return add_opt({s, n, h, t, {}, false, false, 0, 0, repr(*t), {}});
}
OptionSet& OptionSet::add(const std::string& s, const std::string& n, bool* t,
                          const std::string& h) {
  return add_opt({s, n, h, t, {}, false, false, 0, 0, *t ? "true" : "false", {}});
}
OptionSet& OptionSet::add(const std::string& s, const std::string& n, std::string* t,
                          const std::string& h, std::vector<std::string> choices) {
  return add_opt({s, n, h, t, std::move(choices), false, false, 0, 0, *t, {}});
}
OptionSet& OptionSet::min(const std::string& name, double lo) {
  Opt* o = find(name);
  COLOSSAL_CHECK(o, "min(): unknown option ", name);
  o->has_min = true;
  o->lo = lo;
  return *this;
}
OptionSet& OptionSet::max(const std::string& name, double hi) {
  Opt* o = find(name);
  COLOSSAL_CHECK(o, "max(): unknown option ", name);
  o->has_max = true;
  o->hi = hi;
  return *this;
}

OptionSet& OptionSet::alias(const std::string& name, const std::string& alias) {
  Opt* o = find(name);
  COLOSSAL_CHECK(o, "alias(): unknown option ", name);
  const bool is_short = alias.size() >= 2 && alias[0] == '-' && alias[1] != '-';
  const std::string a =
      is_short ? alias : norm(alias.rfind("--", 0) == 0 ? alias.substr(2) : alias);
  COLOSSAL_CHECK(find(a) == nullptr, "alias '", alias, "' of option '", o->name,
                 "' is already an option or alias");
  o->aliases.push_back(a);
  return *this;
}
OptionSet& OptionSet::default_text(const std::string& name, const std::string& text) {
  Opt* o = find(name);
  COLOSSAL_CHECK(o, "default_text(): unknown option ", name);
  o->default_repr = text;
  return *this;
}

OptionSet::Opt* OptionSet::find(const std::string& name) {
  // Short aliases ("-p") are matched as written, names and long aliases normalised.
  const bool is_short = name.size() >= 2 && name[0] == '-' && name[1] != '-';
  std::string n = is_short ? name : norm(name);
  for (auto& o : opts_) {
    if (o.name == n) return &o;
    for (const auto& a : o.aliases)
      if (a == n) return &o;
  }
  return nullptr;
}

std::string OptionSet::display_name(const Opt& o) {
  if (o.aliases.empty()) return "'" + o.name + "'";
  std::string out = "'" + o.name + "' (";
  for (size_t i = 0; i < o.aliases.size(); ++i) {
    const std::string& a = o.aliases[i];
    out += (i ? ", " : "") + (a[0] == '-' ? a : "--" + a);
  }
  return out + ")";
}
const OptionSet::Opt* OptionSet::find(const std::string& name) const {
  return const_cast<OptionSet*>(this)->find(name);
}

void OptionSet::set_from_json(Opt& o, const json::Value& v, const std::string& where) {
  std::string what = where + ": option '" + o.name + "'";
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          *p = v.as_bool(what);
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = v.as_string(what);
        } else if constexpr (std::is_same_v<T, double>) {
          // TOML has inf and nan; a flag refuses them, and so must a file: an lr of inf is
          // found otherwise only as a NaN loss after the first step.
          const double x = v.as_double(what);
          COLOSSAL_CHECK_INPUT(std::isfinite(x), what, " must be a finite number, got ", x);
          *p = x;
        } else {
          int64_t x = v.as_int(what);
          if constexpr (std::is_same_v<T, int>) {
            COLOSSAL_CHECK_INPUT(x >= INT32_MIN && x <= INT32_MAX, what, " is out of range: ", x);
          }
          *p = static_cast<T>(x);
        }
      },
      o.target);
  set_[o.name] = where;
}

void OptionSet::set_from_string(Opt& o, const std::string& v, const std::string& what) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          COLOSSAL_CHECK_INPUT(v == "true" || v == "false" || v == "1" || v == "0", what,
                               " takes true or false, got '", v, "'");
          *p = (v == "true" || v == "1");
        } else if constexpr (std::is_same_v<T, std::string>) {
          *p = v;
        } else if constexpr (std::is_same_v<T, double>) {
          char* end = nullptr;
          errno = 0;
          double x = std::strtod(v.c_str(), &end);
          COLOSSAL_CHECK_INPUT(!v.empty() && *end == '\0' && errno != ERANGE, what,
                               " expects a number, got '", v, "'");
          COLOSSAL_CHECK_INPUT(std::isfinite(x), what, " must be a finite number, got '", v, "'");
          *p = x;
        } else {
          char* end = nullptr;
          errno = 0;
          long long x = std::strtoll(v.c_str(), &end, 10);
          COLOSSAL_CHECK_INPUT(!v.empty() && *end == '\0' && errno == 0, what,
                               " expects an integer, got '", v, "'");
          if constexpr (std::is_same_v<T, int>) {
            COLOSSAL_CHECK_INPUT(x >= INT32_MIN && x <= INT32_MAX, what, " is out of range: ", v);
          }
          *p = static_cast<T>(x);
        }
      },
      o.target);
  set_[o.name] = what;
}

void OptionSet::apply(const json::Value& config, const std::string& source) {
  COLOSSAL_CHECK_INPUT(config.is_object(), source, ": expected a table of options");
  // Where each option was given in this file: one option given
  // twice (at top level and in its [section], or under two of its names) is an error naming both
  // places, not whichever the parser happened to read last.
  std::map<std::string, std::string> given;
  auto set = [&](Opt& o, const json::Value& v, const std::string& section, const std::string& key) {
    std::string place = section.empty() ? "at top level" : "in [" + section + "]";
    if (key != o.name) place += " as '" + key + "'";
    auto [it, fresh] = given.emplace(o.name, place);
    COLOSSAL_CHECK_INPUT(fresh, source, ": option ", display_name(o), " is given twice, ",
                         it->second, " and ", place, "; keep one");
    set_from_json(o, v, section.empty() ? source : source + " [" + section + "]");
  };
  for (const auto& [key, value] : config.as_object()) {
    if (value.is_object()) {
      bool known_section = false;
      for (const auto& o : opts_) known_section |= (o.section == key);
      COLOSSAL_CHECK_INPUT(known_section, source, ": unknown section [", key, "]");
      for (const auto& [k2, v2] : value.as_object()) {
        Opt* o = find(k2);
        COLOSSAL_CHECK_INPUT(o && o->section == key, source, ": unknown option '", k2, "' in [",
                             key, "]");
        set(*o, v2, key, k2);
      }
      continue;
    }
    Opt* o = find(key);
    COLOSSAL_CHECK_INPUT(o, source, ": unknown option '", key, "'");
    set(*o, value, "", key);
  }
}

std::vector<std::string> OptionSet::apply_flags(const std::vector<std::string>& args,
                                                bool allow_rest) {
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool is_long = a.rfind("--", 0) == 0;
    const bool is_short = !is_long && a.size() >= 2 && a[0] == '-';
    if (!is_long && !is_short) {
      COLOSSAL_CHECK_INPUT(allow_rest, "unexpected argument '", a, "'");
      rest.push_back(a);
      continue;
    }
    std::string key = is_long ? a.substr(2) : a, value;
    bool has_value = false;
    auto eq = key.find('=');
    if (is_long && eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
      has_value = true;
    }
    Opt* o = find(key);
    if (!o) {
      COLOSSAL_CHECK_INPUT(allow_rest, "unknown option '", a, "' (see --help)");
      rest.push_back(a);
      continue;
    }
    if (!has_value) {
      if (std::holds_alternative<bool*>(o->target)) {
        // `--flag`, or `--flag true|false` as a separate word (any word without allow_rest:
        // `--flag maybe` is then an error naming the flag, not a stray argument).
        const bool next_is_value =
            i + 1 < args.size() && (args[i + 1] == "true" || args[i + 1] == "false" ||
                                    (!allow_rest && args[i + 1].rfind('-', 0) != 0));
        value = next_is_value ? args[++i] : "true";
      } else {
        COLOSSAL_CHECK_INPUT(i + 1 < args.size(), "option ", is_long ? "--" + norm(key) : key,
                             " needs a value");
        value = args[++i];
      }
    }
    set_from_string(*o, value, "flag " + (is_long ? "--" + norm(key) : key));
  }
  return rest;
}

void OptionSet::validate() const {
  // " (from run.toml [optim] lr)": which file or flag gave the bad value.
  auto from = [&](const Opt& o) -> std::string {
    auto it = set_.find(o.name);
    return it == set_.end() ? std::string(" (the default)") : " (from " + it->second + ")";
  };
  for (const auto& o : opts_) {
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) {
            if (!o.choices.empty()) {
              bool ok = false;
              std::string list;
              for (const auto& c : o.choices) {
                ok |= (c == *p);
                list += (list.empty() ? "" : ", ") + c;
              }
              COLOSSAL_CHECK_INPUT(ok, "option ", display_name(o), " must be one of {", list,
                                   "}, got '", *p, "'");
            }
          } else if constexpr (!std::is_same_v<T, bool>) {
            double x = static_cast<double>(*p);
            COLOSSAL_CHECK_INPUT(std::isfinite(x), "option ", display_name(o),
                                 " must be a finite number, got ", *p, from(o));
            COLOSSAL_CHECK_INPUT(!o.has_min || x >= o.lo, "option ", display_name(o),
                                 " must be >= ", o.lo, ", got ", *p, from(o));
            COLOSSAL_CHECK_INPUT(!o.has_max || x <= o.hi, "option ", display_name(o),
                                 " must be <= ", o.hi, ", got ", *p, from(o));
          }
        },
        o.target);
  }
}

bool OptionSet::was_set(const std::string& name) const {
  const Opt* o = find(name);
  return o && set_.count(o->name) > 0;
}

std::string OptionSet::help() const {
  std::string out;
  std::string section;
  for (const auto& o : opts_) {
    if (o.section != section) {
      section = o.section;
      out += "\n[" + section + "]\n";
    }
    std::string line = "  ";
    for (const auto& a : o.aliases)
      if (a[0] == '-') line += a + ", ";
    line += "--" + o.name;
    for (const auto& a : o.aliases)
      if (a[0] != '-') line += ", --" + a;
    if (line.size() < 28) line.append(28 - line.size(), ' ');
    line += " " + o.help;
    if (!o.choices.empty()) {
      line += " {";
      for (size_t i = 0; i < o.choices.size(); ++i) line += (i ? "|" : "") + o.choices[i];
      line += "}";
    }
    line += " [" + o.default_repr + "]\n";
    out += line;
  }
  return out;
}

json::Value OptionSet::to_json() const {
  json::Value out = json::Value::object();
  auto& sections = out.as_object_mut();
  for (const auto& o : opts_) {
    json::Value v;
    std::visit([&](auto* p) { v = json::Value(*p); }, o.target);
    auto it = std::find_if(sections.begin(), sections.end(),
                           [&](const auto& kv) { return kv.first == o.section; });
    if (it == sections.end()) {
      sections.emplace_back(o.section, json::Value::object());
      it = sections.end() - 1;
    }
    it->second.set(o.name, std::move(v));
  }
  return out;
}

std::vector<std::string> split_list(const std::string& value) {
  std::vector<std::string> out;
  std::stringstream ss(value);
  for (std::string t; std::getline(ss, t, ',');)
    if (!t.empty()) out.push_back(t);
  return out;
}

}  // namespace colossal
