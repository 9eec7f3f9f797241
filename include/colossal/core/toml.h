// A TOML subset for run configs, parsed into colossal::json values (nested objects).
//
// Supported: comments (#), [table] and [a.b] headers, `key = value` with bare, quoted and
// dotted keys, basic "strings" (escapes \" \\ \b \t \n \f \r \uXXXX \UXXXXXXXX) and literal
// 'strings', integers (decimal with optional sign and _ separators, 0x/0o/0b), floats
// (1.5, 1e-3, 6.02E+23, inf, nan), booleans, arrays (nested, multi-line, trailing comma,
// comments inside) and inline tables { a = 1, b = "x" }.
// Not supported (an error, never silently misread): arrays of tables [[x]], multi-line strings,
// dates and times.
// Errors are colossal::InputError "<source>:<line>: <problem>" and name the key where known.
#pragma once

#include <colossal/core/json.h>

#include <string>
#include <string_view>

namespace colossal::toml {

// Parses TOML text; `source` (a file name) prefixes every error message.
json::Value parse(std::string_view text, std::string_view source = "TOML");

// Reads and parses a file; errors name the path.
json::Value parse_file(const std::string& path);

}  // namespace colossal::toml
