// Copyright tensorwire authors.
#include "common/log.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tensorwire::log {

static Level read_level() {
  const char* env = std::getenv("TENSORWIRE_LOG");
  if (!env) return kWarn;
  if (!strcasecmp(env, "error")) return kError;
  if (!strcasecmp(env, "info")) return kInfo;
  if (!strcasecmp(env, "debug")) return kDebug;
  return kWarn;
}

bool enabled(Level level) {
  static const Level current = read_level();
  return level <= current;
}

void write(Level level, const char* fmt, ...) {
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  char buf[1024];
  int n = std::snprintf(buf, sizeof(buf), "tensorwire[%d] %s: ", static_cast<int>(getpid()), names[level]);
  va_list ap;
  va_start(ap, fmt);
  n += std::vsnprintf(buf + n, sizeof(buf) - n - 2, fmt, ap);
  va_end(ap);
  if (n > static_cast<int>(sizeof(buf)) - 2) n = sizeof(buf) - 2;
  buf[n++] = '\n';
  ssize_t ignored = ::write(2, buf, n);
  (void)ignored;
}

}  // namespace tensorwire::log
