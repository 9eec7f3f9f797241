// Test driver: prints a token file's resolved format and tokens as JSON, or the sample indices
// of a sampler layout, for the Python tests.
//   data_tool dump <path> [format]
#include <iostream>
#include <string>

#include "colossal/core/json.h"
#include "colossal/data/token_file.h"

using namespace colossal;

int main(int argc, char** argv) {
  try {
    if (argc < 3 || std::string(argv[1]) != "dump") {
      std::cerr << "usage: data_tool dump <path> [format]\n";
      return 2;
    }
    auto fmt = argc > 3 ? data::token_format_from_string(argv[3]) : data::TokenFormat::Auto;
    data::TokenFile f(argv[2], fmt);
    json::Value out = json::Value::object();
    out.set("format", data::to_string(f.format()));
    json::Value toks = json::Value::array();
    for (int64_t i = 0; i < f.size(); ++i) toks.push_back(f.token(i));
    out.set("tokens", std::move(toks));
    std::cout << out.dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "data_tool: " << e.what() << "\n";
    return 1;
  }
}
