// Test driver: data::Tokenizer::encode_with_offsets for the Python tests. Each stdin line is a
// JSON string; each stdout line the JSON array of [id, begin byte, end byte] of its tokens.
//   offsets_tool <tokenizer.json>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "colossal/core/json.h"
#include "colossal/data/tokenizer.h"

using namespace colossal;

int main(int argc, char** argv) {
  try {
    if (argc != 2) {
      std::cerr << "usage: offsets_tool <tokenizer.json>\n";
      return 2;
    }
    const auto tok = data::Tokenizer::from_file(argv[1]);
    std::string line;
    std::vector<std::pair<size_t, size_t>> off;
    while (std::getline(std::cin, line)) {
      const std::string text = json::parse(line, "stdin").as_string();
      const auto ids = tok.encode_with_offsets(text, off);
      json::Value out = json::Value::array();
      for (size_t i = 0; i < ids.size(); ++i) {
        json::Value t = json::Value::array();
        t.push_back(ids[i]);
        t.push_back(off[i].first);
        t.push_back(off[i].second);
        out.push_back(std::move(t));
      }
      std::cout << out.dump() << "\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "offsets_tool: " << e.what() << "\n";
    return 1;
  }
}
