// Rank-prefixed logging to stderr. stdout is reserved for a command's results (generated token
// ids, reports), so logs never mix into what a script parses.
#pragma once

#include <string>
#include <string_view>

#include "colossal/core/error.h"

namespace colossal {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

// Set once the rank is known (dist::init does it); -1 = no prefix. Level from COLOSSAL_LOG_LEVEL
// (debug|info|warn|error) unless set here.
void set_log_rank(int rank);
int log_rank();
void set_log_level(LogLevel level);
LogLevel log_level();
void log_message(LogLevel level, std::string_view message);

template <class... Args>
void log_debug(Args&&... args) {
  if (log_level() <= LogLevel::Debug)
    log_message(LogLevel::Debug, str(std::forward<Args>(args)...));
}
template <class... Args>
void log_info(Args&&... args) {
  if (log_level() <= LogLevel::Info) log_message(LogLevel::Info, str(std::forward<Args>(args)...));
}
template <class... Args>
void log_warn(Args&&... args) {
  if (log_level() <= LogLevel::Warn) log_message(LogLevel::Warn, str(std::forward<Args>(args)...));
}
template <class... Args>
void log_error(Args&&... args) {
  log_message(LogLevel::Error, str(std::forward<Args>(args)...));
}

}  // namespace colossal
