// Copyright tensorwire authors.
#include "core/bulk_copy.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tensorwire/error.h"
#include "tensorwire/memory.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace tensorwire {
namespace detail {

namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kDefaultLastLevelCache = 32u << 20;
// Copies from 64 KiB go by `rep movsb` where the CPU has ERMS: see bulk_copy.h.
constexpr std::size_t kRepMovsbMin = 64u << 10;
// A smaller tensor's chunk would not pay for the receiver's start (static_slot.cc).
constexpr std::size_t kSharedCopyMin = 256u << 10;

std::size_t last_level_cache() {
  long l3 = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  return l3 > 0 ? static_cast<std::size_t>(l3) : kDefaultLastLevelCache;
}

// The byte count `v` of the environment variable `name`, 0 meaning never
// (SIZE_MAX); `fallback` when it is not set. (Callers spell getenv("...")
// out: tests/python/core/test_configuration.py finds the names the core reads so.)
std::size_t size_from_env(const char* name, const char* v, std::size_t fallback) {
  if (!v) return fallback;
  char* end = nullptr;
  unsigned long long n = std::strtoull(v, &end, 10);
  if (!*v || *end || *v == '-') {
    throw InvalidArgument(std::string(name) + " must be a byte count (0 = never), got '" + v + "'");
  }
  return n == 0 ? SIZE_MAX : static_cast<std::size_t>(n);
}

}  // namespace

std::size_t streaming_copy_min_from_env() {
  return size_from_env("TENSORWIRE_STREAMING_COPY_MIN", std::getenv("TENSORWIRE_STREAMING_COPY_MIN"),
                       last_level_cache() / 2 + 1);
}

std::size_t rep_movsb_min_from_env() {
  return size_from_env("TENSORWIRE_REP_MOVSB_MIN", std::getenv("TENSORWIRE_REP_MOVSB_MIN"), kRepMovsbMin);
}

std::size_t shared_copy_min_from_env() {
  return size_from_env("TENSORWIRE_SHARED_COPY_MIN", std::getenv("TENSORWIRE_SHARED_COPY_MIN"), kSharedCopyMin);
}

std::size_t shared_copy_min() {
  static const std::size_t min = shared_copy_min_from_env();
  return min;
}

namespace {

#if defined(__x86_64__)
// dst is 64-byte aligned, n a multiple of 64.
__attribute__((target("avx2"))) void stream_lines_avx2(char* dst, const char* src, std::size_t n) {
  for (std::size_t i = 0; i < n; i += kLine) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
}

void stream_lines_sse2(char* dst, const char* src, std::size_t n) {
  for (std::size_t i = 0; i < n; i += kLine) {
    for (std::size_t j = 0; j < kLine; j += 16) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + j));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + j), v);
    }
  }
}

bool has_erms() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 9));
}

void rep_movsb(void* dst, const void* src, std::size_t n) {
  asm volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

void stream_copy(char* dst, const char* src, std::size_t n) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  // Plain copies for the partial lines at both ends: a streaming store of a
  // partial line would merge with whatever the line holds in memory.
  std::size_t head = (kLine - reinterpret_cast<std::uintptr_t>(dst) % kLine) % kLine;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  std::size_t body = (n - head) / kLine * kLine;
  if (avx2) {
    stream_lines_avx2(dst + head, src + head, body);
  } else {
    stream_lines_sse2(dst + head, src + head, body);
  }
  std::memcpy(dst + head + body, src + head + body, n - head - body);
  _mm_sfence();  // streaming stores are weakly ordered: order them before later stores
}
#endif

}  // namespace

std::size_t streaming_copy_min() {
  static const std::size_t min = streaming_copy_min_from_env();
  return min;
}

std::size_t rep_movsb_min() {
#if defined(__x86_64__)
  static const std::size_t min = has_erms() ? rep_movsb_min_from_env() : SIZE_MAX;
#else
  static const std::size_t min = SIZE_MAX;
#endif
  return min;
}

void streaming_copy(void* dst, const void* src, std::size_t n) {
#if defined(__x86_64__)
  stream_copy(static_cast<char*>(dst), static_cast<const char*>(src), n);
#else
  std::memcpy(dst, src, n);
#endif
}

void bulk_copy(void* dst, const void* src, std::size_t n) {
  if (n >= streaming_copy_min()) {
    streaming_copy(dst, src, n);
    return;
  }
#if defined(__x86_64__)
  if (n >= rep_movsb_min()) {
    rep_movsb(dst, src, n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace detail

void copy_memory(void* dst, const void* src, std::size_t n) { detail::bulk_copy(dst, src, n); }

}  // namespace tensorwire
