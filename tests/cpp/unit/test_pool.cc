// Copyright tensorwire authors.
//
// The registered memory pool and the registration cache of one Device (no
// peer). UCX is needed for ucp_mem_map; the device listens on 127.0.0.1 only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "tensorwire/device.h"
#include "tensorwire/error.h"
#include "tensorwire/memory.h"

namespace tw = tensorwire;

namespace {

constexpr std::size_t kSlab = std::size_t(1) << 20;  // small slabs keep the tests quick

// Environment for every device of this binary, set before the first one is
// created. Devices listen on 127.0.0.1 over lo (pool_config). (Do not set
// UCX_* globals such as UCX_WARN_UNUSED_ENV_VARS here: UCX reads those when
// it is loaded, before this runs, and then warns that they are unused.)
const bool kEnvReady = [] {
  setenv("TENSORWIRE_LOG", "error", 0);  // refusals are expected; keep logs short
  return true;
}();

tw::DeviceConfig pool_config(std::size_t slab = kSlab, std::size_t limit = std::size_t(1) << 30) {
  tw::DeviceConfig c;
  c.host = "127.0.0.1";
  c.net_devices = "lo";
  c.progress = tw::ProgressMode::kInline;
  c.transport = "tcp";
  c.slab_size = slab;
  c.pool_limit = limit;
  return c;
}

std::uintptr_t addr(const tw::Block& b) { return reinterpret_cast<std::uintptr_t>(b.data()); }

class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kEnvReady);
    device = std::make_unique<tw::Device>(pool_config());
  }
  tw::MemoryPool& pool() { return device->pool(); }
  std::unique_ptr<tw::Device> device;
};

}  // namespace

TEST_F(PoolTest, AllocateAndFreeUpdatesStats) {
  auto s0 = pool().stats();
  EXPECT_EQ(s0.blocks, 0u);
  EXPECT_EQ(s0.bytes_in_use, 0u);
  {
    tw::Block b = pool().allocate(100);
    ASSERT_TRUE(b);
    EXPECT_GE(b.size(), 100u);
    EXPECT_EQ(b.size() % 64, 0u);  // rounded to the cache line
    auto s = pool().stats();
    EXPECT_EQ(s.blocks, 1u);
    EXPECT_EQ(s.bytes_in_use, b.size());
    EXPECT_EQ(s.slabs, 1u);
    EXPECT_EQ(s.bytes_reserved, kSlab);
    std::memset(b.data(), 0x5a, b.size());
  }
  auto s1 = pool().stats();
  EXPECT_EQ(s1.blocks, 0u);
  EXPECT_EQ(s1.bytes_in_use, 0u);
  EXPECT_EQ(s1.slabs, 1u);  // shared slabs are kept for reuse
}

TEST_F(PoolTest, MovedFromBlockIsEmpty) {
  tw::Block a = pool().allocate(256);
  void* p = a.data();
  tw::Block b = std::move(a);
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the contract under test
  EXPECT_EQ(b.data(), p);
  tw::Block c = pool().allocate(64);
  c = std::move(b);  // frees c's old memory
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(pool().stats().blocks, 1u);
  EXPECT_THROW(tw::Block().region(), tw::InvalidArgument);
  EXPECT_THROW(tw::Block().descriptor(), tw::InvalidArgument);
}

TEST_F(PoolTest, FreeInRandomOrderCoalesces) {
  // Fill one slab completely with 4 KiB blocks.
  const std::size_t bs = 4096;
  std::vector<tw::Block> blocks;
  for (std::size_t i = 0; i < kSlab / bs; ++i) blocks.push_back(pool().allocate(bs));
  auto full = pool().stats();
  ASSERT_EQ(full.slabs, 1u) << "4 KiB blocks should pack a slab exactly";
  ASSERT_EQ(full.bytes_in_use, kSlab);

  // Free every other block (by address) first: the holes are all 4 KiB, so
  // an 8 KiB block cannot fit and needs a second slab.
  std::sort(blocks.begin(), blocks.end(), [](const tw::Block& a, const tw::Block& b) { return addr(a) < addr(b); });
  for (std::size_t i = 0; i < blocks.size(); i += 2) blocks[i] = tw::Block();
  {
    tw::Block big = pool().allocate(2 * bs);
    EXPECT_EQ(pool().stats().slabs, 2u);
  }
  // Then the rest, in random order.
  std::mt19937 rng(12345);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (auto& b : blocks) b = tw::Block();
  blocks.clear();
  auto empty = pool().stats();
  EXPECT_EQ(empty.blocks, 0u);
  EXPECT_EQ(empty.bytes_in_use, 0u);
  // Empty slabs went back to the pool but one, kept as a reserve.
  EXPECT_EQ(empty.slabs, 1u);
  EXPECT_EQ(empty.bytes_reserved, kSlab);

  // The largest block a shared slab serves (slab/2; larger ones get their
  // own slab) comes from the reserve slab twice: it is one free range again.
  tw::Block h1 = pool().allocate(kSlab / 2, 4096);
  tw::Block h2 = pool().allocate(kSlab / 2, 4096);
  EXPECT_EQ(pool().stats().slabs, 1u);
  tw::Block h3 = pool().allocate(kSlab / 2, 4096);
  tw::Block h4 = pool().allocate(kSlab / 2, 4096);
  auto after = pool().stats();
  EXPECT_EQ(after.slabs, 2u);
  EXPECT_EQ(after.bytes_in_use, 2 * kSlab);
}

TEST_F(PoolTest, ManySizesRandomFreeOrderCoalesces) {
  std::mt19937 rng(777);
  std::uniform_int_distribution<std::size_t> size_dist(1, 8192);
  std::vector<tw::Block> blocks;
  std::size_t total = 0;
  while (true) {
    std::size_t n = size_dist(rng);
    std::size_t rounded = (n + 63) / 64 * 64;
    if (total + rounded > kSlab / 2) break;
    blocks.push_back(pool().allocate(n));
    total += rounded;
  }
  ASSERT_EQ(pool().stats().slabs, 1u);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  while (!blocks.empty()) blocks.pop_back();
  // Everything coalesced back into one range covering the slab.
  tw::Block a = pool().allocate(kSlab / 2);
  tw::Block b = pool().allocate(kSlab / 2);
  EXPECT_EQ(pool().stats().slabs, 1u);
  EXPECT_EQ(std::min(addr(a), addr(b)) + kSlab / 2, std::max(addr(a), addr(b)));
}

TEST_F(PoolTest, AlignmentHonoured) {
  std::vector<tw::Block> keep;
  for (std::size_t align : {std::size_t(1), std::size_t(64), std::size_t(256), std::size_t(4096)}) {
    for (int i = 0; i < 8; ++i) {
      // Odd sizes push the next free offset off any alignment.
      keep.push_back(pool().allocate(64 * (2 * i + 1) + 1, align));
      EXPECT_EQ(addr(keep.back()) % align, 0u) << "alignment " << align;
      EXPECT_EQ(addr(keep.back()) % 64, 0u) << "blocks are always cache-line aligned";
    }
  }
  // Dedicated slabs too.
  tw::Block big = pool().allocate(kSlab, 4096);
  EXPECT_EQ(addr(big) % 4096, 0u);
}

TEST_F(PoolTest, RejectsBadArguments) {
  EXPECT_THROW(pool().allocate(0), tw::InvalidArgument);
  for (std::size_t a : {std::size_t(0), std::size_t(3), std::size_t(48), std::size_t(100), std::size_t(4095)}) {
    EXPECT_THROW(pool().allocate(64, a), tw::InvalidArgument) << "alignment " << a;
  }
  EXPECT_THROW(pool().allocate(64, 8192), tw::InvalidArgument);  // above a page
  EXPECT_THROW(pool().register_memory(nullptr, 64), tw::InvalidArgument);
  char buf[64];
  EXPECT_THROW(pool().register_memory(buf, 0), tw::InvalidArgument);
  auto s = pool().stats();
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_EQ(s.slabs, 0u);
}

TEST(Pool, FreedSmallBlocksMakeRoomForALargeOne) {
  // Fill the whole limit with small blocks, free them all: a block as large
  // as the limit allows must fit (empty slabs, the reserve too, go back).
  ASSERT_TRUE(kEnvReady);
  tw::Device device(pool_config(kSlab, 4 * kSlab));
  auto& pool = device.pool();
  std::vector<tw::Block> blocks;
  while (true) {
    try {
      blocks.push_back(pool.allocate(64 << 10));
    } catch (const tw::PoolExhausted&) {
      break;
    }
  }
  EXPECT_EQ(pool.stats().bytes_reserved, 4 * kSlab);
  EXPECT_THROW(pool.allocate(2 * kSlab), tw::PoolExhausted);
  blocks.clear();
  EXPECT_EQ(pool.stats().slabs, 1u);
  tw::Block large = pool.allocate(4 * kSlab);
  EXPECT_EQ(large.size(), 4 * kSlab);
  EXPECT_EQ(pool.stats().bytes_reserved, 4 * kSlab);
  std::memset(large.data(), 7, large.size());
}

TEST(Pool, LimitExceededThenStillUsable) {
  ASSERT_TRUE(kEnvReady);
  tw::Device device(pool_config(kSlab, 4 * kSlab));
  auto& pool = device.pool();
  // A dedicated block above the limit.
  EXPECT_THROW(pool.allocate(5 * kSlab), tw::PoolExhausted);
  EXPECT_EQ(pool.stats().bytes_reserved, 0u);
  // Fill the limit with shared slabs.
  std::vector<tw::Block> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(kSlab / 2));
  EXPECT_EQ(pool.stats().slabs, 4u);
  EXPECT_EQ(pool.stats().bytes_reserved, 4 * kSlab);
  EXPECT_THROW(pool.allocate(64), tw::PoolExhausted);
  EXPECT_THROW(pool.allocate(kSlab), tw::PoolExhausted);
  auto s = pool.stats();
  EXPECT_EQ(s.blocks, 8u);
  EXPECT_EQ(s.bytes_in_use, 4 * kSlab);
  // Free one: the pool serves again from that hole, without a new slab.
  void* hole = blocks[3].data();
  blocks[3] = tw::Block();
  tw::Block again = pool.allocate(kSlab / 2);
  EXPECT_EQ(again.data(), hole);
  EXPECT_EQ(pool.stats().slabs, 4u);
  std::memset(again.data(), 1, again.size());
  blocks.clear();
  again = tw::Block();
  // With every block back, the pool serves again.
  EXPECT_EQ(pool.stats().bytes_in_use, 0u);
  tw::Block small = pool.allocate(kSlab / 2);
  EXPECT_TRUE(small);
  std::memset(small.data(), 2, small.size());
}

TEST_F(PoolTest, DedicatedSlabsAreCachedAndReused) {
  tw::Block small = pool().allocate(64);  // one shared slab
  auto base = pool().stats();
  void* first = nullptr;
  {
    tw::Block big = pool().allocate(kSlab / 2 + 1);  // above slab/2: dedicated
    auto s = pool().stats();
    EXPECT_EQ(s.slabs, base.slabs + 1);
    EXPECT_GE(s.bytes_reserved, base.bytes_reserved + kSlab / 2 + 1);
    EXPECT_GE(big.size(), kSlab / 2 + 1);
    std::memset(big.data(), 0xee, big.size());
    first = big.data();
    tw::Block huge = pool().allocate(3 * kSlab + 5);
    EXPECT_EQ(pool().stats().slabs, base.slabs + 2);
    std::memset(huge.data(), 0xdd, huge.size());
  }
  // Freed dedicated slabs stay reserved for reuse (fresh pages cost faults).
  auto after = pool().stats();
  EXPECT_EQ(after.slabs, base.slabs + 2);
  EXPECT_EQ(after.bytes_in_use, base.bytes_in_use);
  EXPECT_EQ(after.blocks, 1u);
  // A block of a similar size reuses the cached slab instead of mapping a new one.
  tw::Block again = pool().allocate(kSlab / 2 + 1);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool().stats().slabs, base.slabs + 2);
}

TEST_F(PoolTest, BlocksDoNotOverlap) {
  std::mt19937 rng(99);
  std::uniform_int_distribution<std::size_t> size_dist(1, 20000);
  std::vector<tw::Block> blocks;
  std::vector<std::size_t> asked;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 60; ++i) {
      // Mostly small; now and then a dedicated one.
      std::size_t n = (i % 29 == 28) ? kSlab : size_dist(rng);
      blocks.push_back(pool().allocate(n, std::size_t(64) << (i % 7)));
      asked.push_back(n);
    }
    // Free a random third to create holes for the next round.
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (rng() % 3 == 0) blocks[i] = tw::Block();
    }
  }
  // Every live block gets its own byte pattern over its full size...
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (!blocks[i]) continue;
    ASSERT_GE(blocks[i].size(), asked[i]);
    std::memset(blocks[i].data(), static_cast<int>(i * 37 + 1) & 0xff, blocks[i].size());
  }
  // ...which must all still be intact.
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (!blocks[i]) continue;
    const auto* p = static_cast<const unsigned char*>(blocks[i].data());
    const auto expect = static_cast<unsigned char>((i * 37 + 1) & 0xff);
    for (std::size_t k = 0; k < blocks[i].size(); ++k) {
      if (p[k] != expect) {
        FAIL() << "block " << i << " byte " << k << " overwritten";
      }
    }
  }
  // And the address ranges are pairwise disjoint.
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;
  for (auto& b : blocks) {
    if (b) ranges.emplace_back(addr(b), addr(b) + b.size());
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first);
  std::size_t live = 0, bytes = 0;
  for (auto& b : blocks) {
    if (b) {
      ++live;
      bytes += b.size();
    }
  }
  EXPECT_EQ(pool().stats().blocks, live);
  EXPECT_EQ(pool().stats().bytes_in_use, bytes);
}

TEST_F(PoolTest, BlockRegionAndDescriptor) {
  tw::Block b = pool().allocate(1000);
  tw::LocalRegion r = b.region();
  EXPECT_EQ(r.address, b.data());
  EXPECT_EQ(r.length, b.size());
  EXPECT_NE(r.memh, nullptr);
  tw::RegionDescriptor d = b.descriptor();
  EXPECT_EQ(d.device_id, device->id());
  EXPECT_EQ(d.address, addr(b));
  EXPECT_EQ(d.length, b.size());
  EXPECT_FALSE(d.rkey.empty());
  const std::string bytes = d.to_bytes();
  EXPECT_EQ(tw::RegionDescriptor::from_bytes(bytes.data(), bytes.size()), d);
}

TEST_F(PoolTest, RegistrationCache) {
  const std::size_t n = 1 << 20;
  std::unique_ptr<char[]> mem(new char[n]);
  std::memset(mem.get(), 0, n);
  auto s0 = pool().stats();
  {
    tw::Registration whole = pool().register_memory(mem.get(), n);
    ASSERT_TRUE(whole);
    EXPECT_EQ(whole.data(), mem.get());
    EXPECT_EQ(whole.size(), n);
    auto s1 = pool().stats();
    EXPECT_EQ(s1.registration_cache_misses, s0.registration_cache_misses + 1);
    EXPECT_EQ(s1.registration_cache_hits, s0.registration_cache_hits);
    EXPECT_EQ(s1.registrations, s0.registrations + 1);

    // Sub-ranges (including the whole range again) are hits.
    tw::Registration sub = pool().register_memory(mem.get() + 4096, 8192);
    tw::Registration tail = pool().register_memory(mem.get() + n - 1, 1);
    tw::Registration same = pool().register_memory(mem.get(), n);
    auto s2 = pool().stats();
    EXPECT_EQ(s2.registration_cache_hits, s0.registration_cache_hits + 3);
    EXPECT_EQ(s2.registration_cache_misses, s0.registration_cache_misses + 1);
    EXPECT_EQ(s2.registrations, s0.registrations + 1);
    EXPECT_EQ(sub.data(), mem.get() + 4096);
    EXPECT_EQ(sub.size(), 8192u);
    // A sub-range keeps its own bounds but shares the registration.
    EXPECT_EQ(sub.region().address, mem.get() + 4096);
    EXPECT_EQ(sub.region().length, 8192u);
    EXPECT_EQ(sub.region().memh, whole.region().memh);
    EXPECT_EQ(sub.descriptor().address, reinterpret_cast<std::uint64_t>(mem.get() + 4096));
    EXPECT_EQ(sub.descriptor().length, 8192u);
    EXPECT_EQ(sub.descriptor().device_id, device->id());

    // The last byte-exact sub-range at the end is still inside.
    tw::Registration upper = pool().register_memory(mem.get() + n / 2, n / 2);
    EXPECT_EQ(pool().stats().registration_cache_hits, s0.registration_cache_hits + 4);

    // Drop the whole-range handle: the sub-range copies keep the
    // registration alive, so it still serves hits.
    whole = tw::Registration();
    tw::Registration sub2 = pool().register_memory(mem.get() + 100, 100);
    EXPECT_EQ(pool().stats().registration_cache_hits, s0.registration_cache_hits + 5);
    EXPECT_EQ(pool().stats().registrations, s0.registrations + 1);
  }
  // Every Registration of the range is gone: the next one is a miss.
  auto s3 = pool().stats();
  EXPECT_EQ(s3.registrations, s0.registrations);
  tw::Registration fresh = pool().register_memory(mem.get() + 4096, 8192);
  auto s4 = pool().stats();
  EXPECT_EQ(s4.registration_cache_misses, s3.registration_cache_misses + 1);
  EXPECT_EQ(s4.registration_cache_hits, s3.registration_cache_hits);
  EXPECT_EQ(s4.registrations, s3.registrations + 1);
  // A range that is not inside the live one (it starts before it) is a miss.
  tw::Registration wider = pool().register_memory(mem.get(), n);
  EXPECT_EQ(pool().stats().registration_cache_misses, s3.registration_cache_misses + 2);
  EXPECT_EQ(pool().stats().registrations, s3.registrations + 2);
  fresh = tw::Registration();
  wider = tw::Registration();
  EXPECT_EQ(pool().stats().registrations, s3.registrations);
}

TEST_F(PoolTest, RegistrationOverlappingPastEndIsMiss) {
  const std::size_t n = 64 * 1024;
  std::unique_ptr<char[]> mem(new char[2 * n]);
  tw::Registration first = pool().register_memory(mem.get(), n);
  auto s = pool().stats();
  tw::Registration over = pool().register_memory(mem.get() + n / 2, n);  // runs past the first
  EXPECT_EQ(pool().stats().registration_cache_misses, s.registration_cache_misses + 1);
  EXPECT_EQ(pool().stats().registration_cache_hits, s.registration_cache_hits);
  EXPECT_EQ(over.size(), n);
  EXPECT_EQ(pool().stats().registrations, s.registrations + 1);
}

TEST(Pool, BlockUsableAfterClose) {
  ASSERT_TRUE(kEnvReady);
  tw::Device device(pool_config());
  tw::Block block = device.allocate(4096);
  tw::Block big = device.allocate(2 * kSlab);  // dedicated
  std::unique_ptr<char[]> mem(new char[4096]);
  tw::Registration reg = device.pool().register_memory(mem.get(), 4096);
  std::memset(block.data(), 0x11, block.size());
  device.close();
  EXPECT_TRUE(device.closed());
  device.close();  // idempotent
  // Still mapped: read and write.
  const auto* p = static_cast<const unsigned char*>(block.data());
  EXPECT_EQ(p[0], 0x11);
  EXPECT_EQ(p[block.size() - 1], 0x11);
  std::memset(block.data(), 0x22, block.size());
  EXPECT_EQ(p[100], 0x22);
  std::memset(big.data(), 0x33, big.size());
  EXPECT_EQ(static_cast<const unsigned char*>(big.data())[big.size() - 1], 0x33);
  EXPECT_NO_THROW(block.region());
  EXPECT_NO_THROW(block.descriptor());
  EXPECT_NO_THROW(reg.region());
  // No new memory from a closed device.
  EXPECT_THROW(device.allocate(64), tw::ConnectionError);
  EXPECT_THROW(device.pool(), tw::ConnectionError);
  // Blocks and registrations release cleanly afterwards.
  block = tw::Block();
  big = tw::Block();
  reg = tw::Registration();
}

TEST(Pool, BlockOutlivesDevice) {
  ASSERT_TRUE(kEnvReady);
  tw::Block block;
  {
    tw::Device device(pool_config());
    block = device.allocate(4096);
    std::memset(block.data(), 0x44, block.size());
  }
  // The Device is gone; the Block keeps its slab (and the UCX context) alive.
  EXPECT_EQ(static_cast<const unsigned char*>(block.data())[4095], 0x44);
  std::memset(block.data(), 0x55, block.size());
  block = tw::Block();
}
