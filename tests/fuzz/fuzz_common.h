// Copyright tensorwire authors.
//
// Shared by the libFuzzer targets (tests/fuzz/fuzz_<name>.cc, built by
// `make fuzz`). A decoder may refuse an input only by throwing
// tensorwire::Error; any other exception, a sanitizer report, a leak or a
// failed TW_FUZZ_CHECK is a bug, and libFuzzer keeps the input as a crash.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>

#include "tensorwire/error.h"

// Not assert(): the fuzz build may define NDEBUG.
#define TW_FUZZ_CHECK(cond)                                                               \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

namespace tw_fuzz {

// Runs `decode`: its value, or nothing when it refused the input. Round trips
// run outside, so an encoder throwing on a value its decoder accepted (even a
// tensorwire::Error) escapes and is reported.
template <typename F>
auto decode_or_refuse(F&& decode) -> std::optional<decltype(decode())> {
  try {
    return decode();
  } catch (const tensorwire::Error&) {
    return std::nullopt;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decoder threw a non-tensorwire exception: %s\n", e.what());
    std::abort();
  }
}

}  // namespace tw_fuzz
