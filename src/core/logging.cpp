// Logging: one line per message, written with a single write() so lines of concurrent ranks
// (and threads) never interleave mid-line.
#include "colossal/core/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace colossal {
namespace {
std::atomic<int> g_rank{-1};

LogLevel level_from_env() {
  const char* v = std::getenv("COLOSSAL_LOG_LEVEL");
  if (!v) return LogLevel::Info;
  if (!std::strcmp(v, "debug")) return LogLevel::Debug;
  if (!std::strcmp(v, "warn")) return LogLevel::Warn;
  if (!std::strcmp(v, "error")) return LogLevel::Error;
  return LogLevel::Info;
}
std::atomic<int> g_level{static_cast<int>(level_from_env())};
}  // namespace

void set_log_rank(int rank) {
  g_rank = rank;
}
int log_rank() {
  return g_rank;
}
void set_log_level(LogLevel level) {
  g_level = static_cast<int>(level);
}
LogLevel log_level() {
  return static_cast<LogLevel>(g_level.load());
}

void log_message(LogLevel level, std::string_view message) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  localtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  std::string line = "[";
  line += ts;
  int rank = g_rank;
  if (rank >= 0) line += " rank" + std::to_string(rank);
  line += " ";
  line += names[static_cast<int>(level)];
  line += "] ";
  line += message;
  line += '\n';
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace colossal
