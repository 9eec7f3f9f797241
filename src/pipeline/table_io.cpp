// Schedule tables: CSV (`rank,op,mb,chunk` rows under a `# key=value ...` header) and JSON.
#include <cctype>
#include <fstream>
#include <sstream>

#include "colossal/core/error.h"
#include "colossal/core/json.h"
#include "colossal/pipeline/schedule.h"

namespace colossal::pipeline {
namespace {

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

// Line breaks would end the CSV header line: written as spaces.
std::string one_line(std::string s) {
  for (char& ch : s)
    if (ch == '\n' || ch == '\r') ch = ' ';
  return s;
}

// A non-negative decimal integer, or -1.
long parse_count(const std::string& s) {
  if (s.empty() || s.size() > 9) return -1;
  long v = 0;
  for (char ch : s) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) return -1;
    v = v * 10 + (ch - '0');
  }
  return v;
}

// "F3.1" -> {F, 3, 1}; `where` prefixes errors.
Instr parse_instr(const std::string& text, const std::string& where) {
  size_t i = 0;
  while (i < text.size() && std::isalpha(static_cast<unsigned char>(text[i]))) ++i;
  const size_t dot = text.find('.', i);
  COLOSSAL_CHECK_INPUT(i > 0 && dot != std::string::npos, where, ": '", text,
                       "' is not an instruction like F3.0 (op, micro-batch, '.', chunk)");
  Instr in;
  try {
    in.op = parse_op(text.substr(0, i));
  } catch (const InputError& e) {
    throw InputError(where + ": " + e.what());
  }
  const long m = parse_count(text.substr(i, dot - i)), c = parse_count(text.substr(dot + 1));
  COLOSSAL_CHECK_INPUT(m >= 0 && c >= 0, where, ": '", text,
                       "' needs a non-negative micro-batch and chunk");
  in.mb = static_cast<int>(m);
  in.chunk = static_cast<int>(c);
  return in;
}

void check_header(const Schedule& s, const std::string& what) {
  COLOSSAL_CHECK_INPUT(s.stages >= 1 && s.stages <= 4096, what, ": stages must be in 1..4096, got ",
                       s.stages);
  COLOSSAL_CHECK_INPUT(s.microbatches >= 1 && s.microbatches <= 1000000, what,
                       ": microbatches must be in 1..1000000, got ", s.microbatches);
  COLOSSAL_CHECK_INPUT(s.chunks >= 1 && s.chunks <= 1024, what, ": chunks must be in 1..1024, got ",
                       s.chunks);
}

Schedule parse_csv(const std::string& text, const std::string& what) {
  Schedule s;
  s.name = "table";
  bool have_stages = false, have_mb = false, header_done = false;
  std::istringstream in(text);
  std::string raw;
  int lineno = 0;
  auto start_rows = [&](const std::string& at) {
    if (header_done) return;
    COLOSSAL_CHECK_INPUT(have_stages && have_mb, at,
                         ": the header must give stages= and microbatches= before the rows "
                         "(`# stages=4 microbatches=8 chunks=1 placement=loop name=mine`)");
    check_header(s, what);
    s.ranks.assign(s.stages, {});
    header_done = true;
  };
  while (std::getline(in, raw)) {
    ++lineno;
    const std::string at = str(what, " line ", lineno);
    const std::string line = trim(raw);
    if (line.empty()) continue;
    if (line[0] == '#') {
      COLOSSAL_CHECK_INPUT(!header_done, at, ": header lines must come before the rows");
      std::istringstream words(line.substr(1));
      std::string word;
      while (words >> word) {
        const size_t eq = word.find('=');
        COLOSSAL_CHECK_INPUT(eq != std::string::npos, at, ": expected key=value, got '", word, "'");
        const std::string key = word.substr(0, eq), value = word.substr(eq + 1);
        auto count = [&]() {
          const long v = parse_count(value);
          COLOSSAL_CHECK_INPUT(v >= 0, at, ": ", key, " must be a non-negative integer, got '",
                               value, "'");
          return static_cast<int>(v);
        };
        if (key == "stages") {
          s.stages = count();
          have_stages = true;
        } else if (key == "microbatches") {
          s.microbatches = count();
          have_mb = true;
        } else if (key == "chunks") {
          s.chunks = count();
        } else if (key == "placement") {
          try {
            s.placement = parse_placement(value);
          } catch (const InputError& e) {
            throw InputError(at + ": " + e.what());
          }
        } else if (key == "name") {
          // The rest of the line: a name may hold spaces (to_csv writes it last).
          std::string rest;
          std::getline(words, rest);
          s.name = trim(value + rest);
        } else {
          throw InputError(at + ": unknown header key '" + key +
                           "' (stages, microbatches, chunks, placement, name)");
        }
      }
      continue;
    }
    if (line.rfind("rank", 0) == 0) continue;  // the column names
    start_rows(at);
    std::vector<std::string> cols;
    std::stringstream ss(line);
    std::string col;
    while (std::getline(ss, col, ',')) cols.push_back(trim(col));
    COLOSSAL_CHECK_INPUT(cols.size() == 4, at, ": expected 4 columns rank,op,mb,chunk, got ",
                         cols.size(), " in '", line, "'");
    const long r = parse_count(cols[0]), m = parse_count(cols[2]), c = parse_count(cols[3]);
    COLOSSAL_CHECK_INPUT(r >= 0 && r < s.stages, at, ": rank '", cols[0], "' is not in 0..",
                         s.stages - 1);
    COLOSSAL_CHECK_INPUT(m >= 0, at, ": micro-batch '", cols[2], "' is not a non-negative integer");
    COLOSSAL_CHECK_INPUT(c >= 0, at, ": chunk '", cols[3], "' is not a non-negative integer");
    Instr ins;
    try {
      ins.op = parse_op(cols[1]);
    } catch (const InputError& e) {
      throw InputError(at + ": " + e.what());
    }
    ins.mb = static_cast<int>(m);
    ins.chunk = static_cast<int>(c);
    s.ranks[r].push_back(ins);
  }
  start_rows(str(what, " line ", lineno));
  return s;
}

Schedule parse_json(const std::string& text, const std::string& what) {
  const json::Value v = json::parse(text, what);
  COLOSSAL_CHECK_INPUT(v.is_object(), what, ": a JSON schedule must be an object");
  for (const auto& [k, _] : v.as_object())
    COLOSSAL_CHECK_INPUT(k == "name" || k == "stages" || k == "microbatches" || k == "chunks" ||
                             k == "placement" || k == "ranks",
                         what, ": unknown key '", k,
                         "' (name, stages, microbatches, chunks, placement, ranks)");
  Schedule s;
  s.name = v.contains("name") ? v.at("name").as_string(what + ".name") : "table";
  auto count = [&](const char* key, int def) {
    if (!v.contains(key)) return def;
    const int64_t x = v.at(key).as_int(what + "." + key);
    COLOSSAL_CHECK_INPUT(x >= 0 && x <= 1000000, what, ".", key, ": out of range: ", x);
    return static_cast<int>(x);
  };
  COLOSSAL_CHECK_INPUT(v.contains("stages") && v.contains("microbatches") && v.contains("ranks"),
                       what, ": needs stages, microbatches and ranks");
  s.stages = count("stages", 1);
  s.microbatches = count("microbatches", 1);
  s.chunks = count("chunks", 1);
  if (v.contains("placement")) {
    try {
      s.placement = parse_placement(v.at("placement").as_string(what + ".placement"));
    } catch (const InputError& e) {
      throw InputError(what + ".placement: " + e.what());
    }
  }
  check_header(s, what);
  const auto& ranks = v.at("ranks").as_array(what + ".ranks");
  COLOSSAL_CHECK_INPUT(static_cast<int>(ranks.size()) == s.stages, what, ".ranks: ", ranks.size(),
                       " lists for stages=", s.stages);
  s.ranks.assign(s.stages, {});
  for (int r = 0; r < s.stages; ++r) {
    const auto& list = ranks[r].as_array(str(what, " rank ", r));
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string at = str(what, " rank ", r, ", entry ", i);
      s.ranks[r].push_back(parse_instr(list[i].as_string(at), at));
    }
  }
  return s;
}

}  // namespace

std::string to_csv(const Schedule& s) {
  std::ostringstream os;
  os << "# stages=" << s.stages << " microbatches=" << s.microbatches << " chunks=" << s.chunks
     << " placement=" << to_string(s.placement) << " name=" << one_line(s.name) << "\n";
  os << "rank,op,mb,chunk\n";
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (const auto& i : s.ranks[r])
      os << r << "," << to_string(i.op) << "," << i.mb << "," << i.chunk << "\n";
  return os.str();
}

std::string to_json(const Schedule& s) {
  json::Value v = json::Value::object();
  v.set("name", s.name);
  v.set("stages", s.stages);
  v.set("microbatches", s.microbatches);
  v.set("chunks", s.chunks);
  v.set("placement", to_string(s.placement));
  json::Value ranks = json::Value::array();
  for (const auto& list : s.ranks) {
    json::Value l = json::Value::array();
    for (const auto& i : list) l.push_back(to_string(i));
    ranks.push_back(std::move(l));
  }
  v.set("ranks", std::move(ranks));
  // One rank per line: readable and diff-friendly.
  std::string out = "{\"name\": " + json::Value(s.name).dump() +
                    ", \"stages\": " + std::to_string(s.stages) +
                    ", \"microbatches\": " + std::to_string(s.microbatches) +
                    ", \"chunks\": " + std::to_string(s.chunks) + ", \"placement\": \"" +
                    to_string(s.placement) + "\",\n \"ranks\": [\n";
  const auto& arr = v.at("ranks").as_array();
  for (size_t r = 0; r < arr.size(); ++r)
    out += "  " + arr[r].dump() + (r + 1 < arr.size() ? ",\n" : "\n");
  out += " ]}\n";
  return out;
}

Schedule parse_schedule_table(const std::string& text, const std::string& what) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  Schedule s = first != std::string::npos && text[first] == '{' ? parse_json(text, what)
                                                                : parse_csv(text, what);
  validate(s);
  return s;
}

Schedule load_schedule_table(const std::string& path) {
  const bool csv = path.size() >= 4 && path.compare(path.size() - 4, 4, ".csv") == 0;
  const bool js = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  COLOSSAL_CHECK_INPUT(csv || js, "schedule table '", path, "': expected a .csv or .json file");
  std::ifstream f(path, std::ios::binary);
  COLOSSAL_CHECK_INPUT(f, "schedule table '", path, "': cannot open it");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  Schedule s = js ? parse_json(text, path) : parse_csv(text, path);
  validate(s);
  return s;
}

}  // namespace colossal::pipeline
