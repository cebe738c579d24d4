// Copyright tensorwire authors.
//
// The direct path's copy: streaming stores and `rep movsb` must copy exactly
// what memcpy copies, for every alignment of both ends and lengths around
// whole lines, without touching a byte outside the destination range.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/bulk_copy.h"
#include "tensorwire/error.h"

namespace {

using CopyFn = void (*)(void*, const void*, std::size_t);

void check_copy(std::size_t dst_off, std::size_t src_off, std::size_t n,
                CopyFn copy = tensorwire::detail::streaming_copy) {
  const std::size_t pad = 128;
  std::vector<unsigned char> src(src_off + n + pad), dst(dst_off + n + 2 * pad, 0xEE);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  copy(dst.data() + pad + dst_off, src.data() + src_off, n);
  for (std::size_t i = 0; i < pad + dst_off; ++i) ASSERT_EQ(dst[i], 0xEE) << "wrote before the range, byte " << i;
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(dst[pad + dst_off + i], src[src_off + i])
        << "byte " << i << " of " << n << ", dst_off " << dst_off << ", src_off " << src_off;
  }
  for (std::size_t i = pad + dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "wrote past the range";
}

TEST(BulkCopy, StreamingCopyMatchesMemcpyAtEveryAlignment) {
  for (std::size_t dst_off : {0, 1, 15, 32, 63}) {
    for (std::size_t src_off : {0, 3, 17, 64}) {
      for (std::size_t n : {0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096 + 33}) check_copy(dst_off, src_off, n);
    }
  }
}

TEST(BulkCopy, LargeCopiesAreExact) {
  check_copy(7, 5, (std::size_t(3) << 20) + 11);  // streamed bulk with unaligned ends
}

TEST(BulkCopy, BulkCopyIsExactAroundTheRepMovsbSize) {
  // From 64 KiB bulk_copy takes `rep movsb` (x86-64 with ERMS), below it memcpy.
  const std::size_t at = std::size_t(64) << 10;
  for (std::size_t dst_off : {0, 1, 63}) {
    for (std::size_t src_off : {0, 5}) {
      for (std::size_t n : {at - 1, at, at + 1, (std::size_t(1) << 20) + 3}) {
        check_copy(dst_off, src_off, n, tensorwire::detail::bulk_copy);
      }
    }
  }
}

// A byte count read from the environment variable `name` by `read`:
// `fallback` when unset, the bytes given, SIZE_MAX for 0 (never), a malformed
// value refused. The variable is restored afterwards.
void expect_size_from_env(const char* name, std::size_t (*read)(), std::size_t fallback) {
  const char* had = std::getenv(name);
  const std::string saved = had ? had : "";
  ::unsetenv(name);
  EXPECT_EQ(read(), fallback) << name;
  ::setenv(name, "4096", 1);
  EXPECT_EQ(read(), std::size_t(4096)) << name;
  ::setenv(name, "0", 1);  // never
  EXPECT_EQ(read(), SIZE_MAX) << name;
  ::setenv(name, "64K", 1);
  EXPECT_THROW(read(), tensorwire::InvalidArgument) << name;
  if (had) {
    ::setenv(name, saved.c_str(), 1);
  } else {
    ::unsetenv(name);
  }
}

TEST(BulkCopy, RepMovsbSizeComesFromTheEnvironment) {
  expect_size_from_env("TENSORWIRE_REP_MOVSB_MIN", tensorwire::detail::rep_movsb_min_from_env, std::size_t(64) << 10);
}

TEST(BulkCopy, SharedCopySizeComesFromTheEnvironment) {
  expect_size_from_env("TENSORWIRE_SHARED_COPY_MIN", tensorwire::detail::shared_copy_min_from_env,
                       std::size_t(256) << 10);
}

TEST(BulkCopy, ThresholdIsAboveTheSmallSizes) {
  // Latency-sized copies must stay plain memcpys (streaming is slower there).
  EXPECT_GE(tensorwire::detail::streaming_copy_min(), std::size_t(1) << 20);
}

}  // namespace
