// The message of the InputError `fn` throws, or "no error": tests assert that bad input is named
// (`EXPECT_NE(error_of(...).find("what"), npos)`); any other exception propagates and fails them.
#pragma once

#include <functional>
#include <string>

#include "colossal/core/error.h"

namespace colossal::tests {

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace colossal::tests
