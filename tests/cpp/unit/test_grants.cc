// Copyright tensorwire authors.
//
// A peer's grant table (core/peer.cc): the ranges of our memory a peer may
// reach by message (contracts §11). Bounded, and revoked when the memory
// returns, without a revoked range ever costing a live one its place.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>

#include "core/channel_impl.h"

namespace td = tensorwire::detail;

namespace {

constexpr std::uint64_t kMax = 4096;  // Peer::kMaxExports

std::shared_ptr<td::Peer> lone_peer() {
  return std::make_shared<td::Peer>(std::weak_ptr<td::DeviceImpl>(), tensorwire::control::Hello{}, nullptr, false);
}

TEST(Grants, CoverTheirRangeOnly) {
  auto p = lone_peer();
  p->grant(0x10000, 4096);
  p->grant(0x10100, 16);  // nested: the outer range still serves
  EXPECT_TRUE(p->granted(0x10000, 4096));
  EXPECT_TRUE(p->granted(0x10200, 64));
  EXPECT_FALSE(p->granted(0x10000, 4097));
  EXPECT_FALSE(p->granted(0xffff, 2));
  EXPECT_FALSE(p->granted(~std::uint64_t(0) - 8, 16));  // wraps around
}

TEST(Grants, RevokeEndsRangesStartingInside) {
  auto p = lone_peer();
  p->grant(0x10000, 4096);
  p->grant(0x20000, 4096);
  p->grant(0x20800, 64);
  p->revoke(0x20000, 0x21000);
  EXPECT_TRUE(p->granted(0x10000, 4096));
  EXPECT_FALSE(p->granted(0x20000, 8));
  EXPECT_FALSE(p->granted(0x20800, 8));  // the nested one too
  p->grant(0x20000, 4096);               // leased and exported again
  EXPECT_TRUE(p->granted(0x20000, 4096));
}

TEST(Grants, TheOldestLiveRangeIsForgottenPastTheBound) {
  auto p = lone_peer();
  for (std::uint64_t i = 0; i <= kMax; ++i) p->grant(0x100000 + 64 * i, 64);
  EXPECT_FALSE(p->granted(0x100000, 64));  // the first of kMax + 1
  EXPECT_TRUE(p->granted(0x100000 + 64, 64));
  EXPECT_TRUE(p->granted(0x100000 + 64 * kMax, 64));
}

TEST(Grants, ARevokedEntryDoesNotEvictItsRegrant) {
  auto p = lone_peer();
  // One block freed and leased again many times (a receiver's per-tensor
  // block), among kMax - 1 long-lived grants: the table holds kMax live
  // ranges, so nothing is forgotten, however many stale entries went before.
  p->grant(0x1000, 64);
  for (std::uint64_t i = 1; i < kMax; ++i) p->grant(0x100000 + 64 * i, 64);
  for (int k = 0; k < 3 * int(kMax); ++k) {
    p->revoke(0x1000, 0x1040);
    p->grant(0x1000, 64);
  }
  EXPECT_TRUE(p->granted(0x1000, 64));
  for (std::uint64_t i = 1; i < kMax; ++i) ASSERT_TRUE(p->granted(0x100000 + 64 * i, 64)) << i;
  p->grant(0x900000, 64);  // one more: now the oldest live range goes
  EXPECT_FALSE(p->granted(0x100000 + 64, 64));
  EXPECT_TRUE(p->granted(0x1000, 64));
}

}  // namespace
