// Copyright tensorwire authors.
#include "core/bulk_copy.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tensorwire/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tensorwire {
namespace detail {

namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kDefaultLastLevelCache = 32u << 20;

std::size_t last_level_cache() {
  long l3 = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  return l3 > 0 ? static_cast<std::size_t>(l3) : kDefaultLastLevelCache;
}

}  // namespace

std::size_t streaming_copy_min_from_env() {
  if (const char* v = std::getenv("TENSORWIRE_STREAMING_COPY_MIN")) {
    char* end = nullptr;
    unsigned long long n = std::strtoull(v, &end, 10);
    if (!*v || *end || *v == '-') {
      throw InvalidArgument(std::string("TENSORWIRE_STREAMING_COPY_MIN must be a byte count (0 = never), got '") +
                            v + "'");
    }
    return n == 0 ? SIZE_MAX : static_cast<std::size_t>(n);
  }
  return last_level_cache() / 2 + 1;
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
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace detail
}  // namespace tensorwire
