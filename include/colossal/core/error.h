// Error types and checks. Every error a user can cause says what was wrong, with the offending
// value, and what to do; these types let the CLI turn them into one clean line and exit code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace colossal {

// Base of every error the project throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad user input: a config value, a CLI flag, a data or checkpoint file.
class InputError : public Error {
 public:
  using Error::Error;
};

// A collective or rendezvous failed or timed out, or a peer rank died.
class DistError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  ((os << std::forward<Args>(args)), ...);
  return os.str();
}
}  // namespace detail

// str("a", 1, "b") -> "a1b"
template <class... Args>
std::string str(Args&&... args) {
  return detail::concat(std::forward<Args>(args)...);
}

}  // namespace colossal

// COLOSSAL_CHECK(cond, "message parts", value, ...) throws colossal::Error.
#define COLOSSAL_CHECK(cond, ...)                                       \
  do {                                                                  \
    if (!(cond)) throw ::colossal::Error(::colossal::str(__VA_ARGS__)); \
  } while (0)

// COLOSSAL_CHECK_INPUT: the same for user-caused problems (throws colossal::InputError).
#define COLOSSAL_CHECK_INPUT(cond, ...)                                      \
  do {                                                                       \
    if (!(cond)) throw ::colossal::InputError(::colossal::str(__VA_ARGS__)); \
  } while (0)
