// Test driver: parses a TOML file with colossal::toml and prints the JSON (for tomllib checks).
#include <iostream>

#include "colossal/core/toml.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: toml_tool <file.toml>\n";
    return 2;
  }
  try {
    std::cout << colossal::toml::parse_file(argv[1]).dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
