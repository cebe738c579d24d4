// Copyright tensorwire authors.
//
// The dynamic slot's record codec (protocol/dynamic_record.h) without any
// network: round trips, and each reason the receiver refuses a record.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "protocol/dynamic_record.h"
#include "tensorwire/error.h"

namespace tw = tensorwire;
namespace td = tensorwire::detail;

namespace {

// Field offsets of the record (docs/contracts.md §10.4).
constexpr std::size_t kVersionOff = 4;
constexpr std::size_t kCodeOff = 6;
constexpr std::size_t kBitsOff = 7;
constexpr std::size_t kNdimOff = 8;
constexpr std::size_t kRkeyLenOff = 12;
constexpr std::size_t kNbytesOff = 16;
constexpr std::size_t kAddressOff = 24;
constexpr std::size_t kDimsOff = 40;

constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

td::DynamicRecord make(tw::DType dtype, std::vector<std::int64_t> shape) {
  td::DynamicRecord r;
  r.spec.dtype = dtype;
  r.spec.shape = std::move(shape);
  r.nbytes = r.spec.nbytes();
  r.address = 0x00007f0012340000ULL;
  r.device_id = 0x0123456789abcdefULL;
  if (r.nbytes) r.rkey = std::string("\x01\x00rkey\xff", 7);  // embedded NUL on purpose
  return r;
}

// A slot's record memory, as DynamicSlot hands it to the decoder.
struct Slot {
  int max_ndim;
  std::vector<char> mem;
  explicit Slot(int n) : max_ndim(n), mem(td::record_size_for(n), '\x5a') {}  // junk where nothing is written
  std::size_t size() const { return mem.size() - 64; }                        // the sequence line is not part of it
  void put(const td::DynamicRecord& r) { td::encode_record(r, max_ndim, mem.data()); }
  td::RecordStatus decode(td::DynamicRecord* out, std::size_t max_nbytes = kNoLimit) const {
    return td::decode_record(mem.data(), size(), max_ndim, max_nbytes, out);
  }
  template <typename T>
  void poke(std::size_t off, T v) {
    std::memcpy(mem.data() + off, &v, sizeof(T));
  }
};

void expect_same(const td::DynamicRecord& a, const td::DynamicRecord& b) {
  EXPECT_EQ(a.spec.dtype, b.spec.dtype);
  EXPECT_EQ(a.spec.shape, b.spec.shape);
  EXPECT_EQ(a.nbytes, b.nbytes);
  EXPECT_EQ(a.address, b.address);
  EXPECT_EQ(a.device_id, b.device_id);
  EXPECT_EQ(a.rkey, b.rkey);
}

const tw::DType kAllDtypes[] = {{0, 8},  {0, 16}, {0, 32}, {0, 64}, {1, 8},  {1, 16}, {1, 32},
                                {1, 64}, {2, 16}, {2, 32}, {2, 64}, {4, 16}, {6, 8}};

}  // namespace

// ---- round trips ----

TEST(Record, RoundTripEveryDtype) {
  for (const tw::DType& dt : kAllDtypes) {
    Slot slot(8);
    const auto r = make(dt, {3, 0x101, 2});
    slot.put(r);
    td::DynamicRecord back;
    ASSERT_EQ(slot.decode(&back), td::kAccepted) << dt.name();
    expect_same(back, r);
    EXPECT_EQ(back.nbytes, 3u * 0x101 * 2 * dt.itemsize()) << dt.name();
  }
}

TEST(Record, EncodeReturnsTheBytesToSend) {
  Slot slot(8);
  const auto r = make({2, 32}, {4});
  EXPECT_EQ(td::encode_record(r, 8, slot.mem.data()), kDimsOff + 8 * 8 + r.rkey.size());
  EXPECT_EQ(std::memcmp(slot.mem.data(), "TWDR", 4), 0);
}

TEST(Record, MaxNdimZeroTakesScalars) {
  EXPECT_EQ(td::record_size_for(0), 2176u);  // align64(40 + 2048) + 64
  Slot slot(0);
  const auto r = make({2, 64}, {});
  slot.put(r);
  td::DynamicRecord back;
  ASSERT_EQ(slot.decode(&back), td::kAccepted);
  expect_same(back, r);
  EXPECT_EQ(back.nbytes, 8u);
  EXPECT_THROW(slot.put(make({2, 64}, {1})), tw::InvalidArgument);  // one dimension too many
}

TEST(Record, MaxNdimSixtyFour) {
  EXPECT_EQ(td::record_size_for(64), 2688u);  // align64(40 + 512 + 2048) + 64
  Slot slot(64);
  std::vector<std::int64_t> shape(64, 1);
  shape[0] = 5;
  shape[63] = 7;
  const auto r = make({0, 16}, shape);
  slot.put(r);
  td::DynamicRecord back;
  ASSERT_EQ(slot.decode(&back), td::kAccepted);
  expect_same(back, r);
  EXPECT_THROW(slot.put(make({0, 16}, std::vector<std::int64_t>(65, 1))), tw::InvalidArgument);
  EXPECT_THROW(td::record_size_for(65), tw::InvalidArgument);
  EXPECT_THROW(td::record_size_for(-1), tw::InvalidArgument);
}

TEST(Record, EmptyTensorNeedsNoRkey) {
  Slot slot(4);
  auto r = make({2, 32}, {0, 9});
  ASSERT_TRUE(r.rkey.empty());
  slot.put(r);
  slot.poke<std::uint32_t>(kRkeyLenOff, 0xffffffffu);  // ignored when there is nothing to read
  td::DynamicRecord back;
  ASSERT_EQ(slot.decode(&back), td::kAccepted);
  EXPECT_EQ(back.nbytes, 0u);
  EXPECT_TRUE(back.rkey.empty());
}

TEST(Record, LargestRkey) {
  Slot slot(1);
  auto r = make({1, 8}, {10});
  r.rkey.assign(td::kRecordMaxRkey, 'k');
  slot.put(r);
  td::DynamicRecord back;
  ASSERT_EQ(slot.decode(&back), td::kAccepted);
  EXPECT_EQ(back.rkey, r.rkey);
  r.rkey.push_back('k');
  EXPECT_THROW(slot.put(r), tw::InvalidArgument);
}

TEST(Record, EncoderRefusesDataWithoutRkey) {
  Slot slot(2);
  auto r = make({2, 32}, {2});
  r.rkey.clear();
  EXPECT_THROW(slot.put(r), tw::InvalidArgument);
}

// ---- each refusal ----

TEST(Record, RefusesBadMagic) {
  Slot slot(2);
  slot.put(make({2, 32}, {2}));
  slot.mem[0] = 'X';
  td::DynamicRecord out;
  EXPECT_EQ(slot.decode(&out), td::kBadMagic);
}

TEST(Record, RefusesShortBuffer) {
  Slot slot(2);
  slot.put(make({2, 32}, {2}));
  td::DynamicRecord out;
  const std::size_t whole = kDimsOff + 8 * 2 + td::kRecordMaxRkey;
  EXPECT_EQ(td::decode_record(slot.mem.data(), whole - 1, 2, kNoLimit, &out), td::kBadMagic);
  EXPECT_EQ(td::decode_record(slot.mem.data(), whole, 2, kNoLimit, &out), td::kAccepted);
}

TEST(Record, RefusesOtherVersion) {
  for (std::uint16_t v : {std::uint16_t(0), std::uint16_t(2), std::uint16_t(0xffff)}) {
    Slot slot(2);
    slot.put(make({2, 32}, {2}));
    slot.poke<std::uint16_t>(kVersionOff, v);
    td::DynamicRecord out;
    EXPECT_EQ(slot.decode(&out), td::kBadVersion) << "version " << v;
  }
}

TEST(Record, RefusesUnknownDtype) {
  const std::pair<std::uint8_t, std::uint8_t> bad[] = {{2, 8}, {3, 32}, {4, 32}, {6, 16}, {0, 0}, {0, 7}, {255, 8}};
  for (auto [code, bits] : bad) {
    Slot slot(2);
    slot.put(make({2, 32}, {2}));
    slot.poke<std::uint8_t>(kCodeOff, code);
    slot.poke<std::uint8_t>(kBitsOff, bits);
    td::DynamicRecord out;
    EXPECT_EQ(slot.decode(&out), td::kBadDtype) << int(code) << "/" << int(bits);
  }
}

TEST(Record, RefusesTooManyDimensions) {
  Slot slot(2);
  slot.put(make({2, 32}, {2}));
  td::DynamicRecord out;
  for (std::uint32_t n : {3u, 64u, 0xffffffffu}) {
    slot.poke<std::uint32_t>(kNdimOff, n);
    EXPECT_EQ(slot.decode(&out), td::kBadNdim) << "ndim " << n;
  }
  // A max_ndim outside 0..64 is refused whatever the record says (the
  // buffer is large enough for 65 dimensions, so only the limit refuses it).
  Slot big(64);
  big.put(make({2, 32}, {2}));
  EXPECT_EQ(td::decode_record(big.mem.data(), big.size(), -1, kNoLimit, &out), td::kBadNdim);
  EXPECT_EQ(td::decode_record(big.mem.data(), big.size(), 65, kNoLimit, &out), td::kBadNdim);
}

TEST(Record, RefusesNegativeDimension) {
  Slot slot(3);
  slot.put(make({2, 32}, {2, 3, 4}));
  slot.poke<std::int64_t>(kDimsOff + 8, -3);
  td::DynamicRecord out;
  EXPECT_EQ(slot.decode(&out), td::kBadDims);
}

TEST(Record, RefusesSizeMismatch) {
  Slot slot(2);
  const auto r = make({2, 32}, {4, 4});
  slot.put(r);
  td::DynamicRecord out;
  for (std::uint64_t n : {r.nbytes - 1, r.nbytes + 1, std::uint64_t(0), ~std::uint64_t(0)}) {
    slot.poke<std::uint64_t>(kNbytesOff, n);
    EXPECT_EQ(slot.decode(&out), td::kSizeMismatch) << "nbytes " << n;
  }
}

TEST(Record, RefusesTooLarge) {
  Slot slot(2);
  const auto r = make({2, 32}, {4, 4});  // 64 bytes
  slot.put(r);
  td::DynamicRecord out;
  EXPECT_EQ(slot.decode(&out, 63), td::kTooLarge);
  EXPECT_EQ(slot.decode(&out, 64), td::kAccepted);
  // A shape whose size overflows is too large, not a mismatch.
  slot.poke<std::int64_t>(kDimsOff, std::int64_t(1) << 40);
  slot.poke<std::int64_t>(kDimsOff + 8, std::int64_t(1) << 40);
  EXPECT_EQ(slot.decode(&out), td::kTooLarge);
}

TEST(Record, RefusesBadRkeyLength) {
  for (std::uint32_t len : {0u, std::uint32_t(td::kRecordMaxRkey + 1), 0xffffffffu}) {
    Slot slot(2);
    slot.put(make({2, 32}, {2}));
    slot.poke<std::uint32_t>(kRkeyLenOff, len);
    td::DynamicRecord out;
    EXPECT_EQ(slot.decode(&out), td::kBadRkey) << "rkey length " << len;
  }
}

TEST(Record, RefusesWrappingAddress) {
  Slot slot(1);
  const auto r = make({1, 8}, {16});
  slot.put(r);
  td::DynamicRecord out;
  // As for region descriptors, the end (address + nbytes) must be representable.
  slot.poke<std::uint64_t>(kAddressOff, ~std::uint64_t(0) - 16);  // ends at 2^64-1: fine
  EXPECT_EQ(slot.decode(&out), td::kAccepted);
  slot.poke<std::uint64_t>(kAddressOff, ~std::uint64_t(0) - 15);
  EXPECT_EQ(slot.decode(&out), td::kTooLarge);
  slot.poke<std::uint64_t>(kAddressOff, ~std::uint64_t(0));
  EXPECT_EQ(slot.decode(&out), td::kTooLarge);
}

TEST(Record, EveryStatusHasADescription) {
  for (std::uint64_t s = td::kAccepted; s <= td::kPoolExhausted; ++s) {
    EXPECT_STRNE(td::describe_record_status(s), "refused") << "status " << s;
  }
  EXPECT_STREQ(td::describe_record_status(999), "refused");
}
