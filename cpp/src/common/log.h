// Copyright tensorwire authors. Minimal logging to stderr; the level comes
// from TENSORWIRE_LOG (error|warn|info|debug, default warn).
#pragma once

namespace tensorwire::log {
enum Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };
bool enabled(Level level);
void write(Level level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
}  // namespace tensorwire::log

#define TW_LOG_AT(lvl, ...)                                                          \
  do {                                                                               \
    if (::tensorwire::log::enabled(lvl)) ::tensorwire::log::write(lvl, __VA_ARGS__); \
  } while (0)
#define TW_LOG_ERROR(...) TW_LOG_AT(::tensorwire::log::kError, __VA_ARGS__)
#define TW_LOG_WARN(...) TW_LOG_AT(::tensorwire::log::kWarn, __VA_ARGS__)
#define TW_LOG_INFO(...) TW_LOG_AT(::tensorwire::log::kInfo, __VA_ARGS__)
#define TW_LOG_DEBUG(...) TW_LOG_AT(::tensorwire::log::kDebug, __VA_ARGS__)
