// Copyright tensorwire authors.
//
// Wire formats without any network: the region descriptor, the control-plane
// header and HELLO body, and the bounds-checked ByteReader underneath them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "common/bytes.h"
#include "core/control_wire.h"
#include "tensorwire/error.h"
#include "tensorwire/region.h"
#include "ucx/ucx.h"

namespace tw = tensorwire;
namespace ctl = tensorwire::control;
using tensorwire::detail::ByteReader;
using tensorwire::detail::ByteWriter;

namespace {

tw::RegionDescriptor sample_descriptor() {
  tw::RegionDescriptor d;
  d.device_id = 0x0123456789abcdefULL;
  d.address = 0x00007f0012345000ULL;
  d.length = 1 << 20;
  d.memory_type = tw::MemoryType::kCuda;
  d.rkey = std::string("\x01\x02\x00\xff rkey bytes", 15);  // embedded NUL on purpose
  return d;
}

tw::RegionDescriptor parse(const std::string& s) { return tw::RegionDescriptor::from_bytes(s.data(), s.size()); }

// Field offsets of the descriptor wire form (see region.cc).
constexpr std::size_t kVersionOff = 4;
constexpr std::size_t kMemTypeOff = 5;
constexpr std::size_t kAddressOff = 16;
constexpr std::size_t kLengthOff = 24;
constexpr std::size_t kRkeyLenOff = 32;
constexpr std::size_t kFixedSize = 36;

template <typename T>
void poke(std::string& s, std::size_t off, T v) {
  ASSERT_LE(off + sizeof(T), s.size());
  std::memcpy(s.data() + off, &v, sizeof(T));
}

ctl::Hello sample_hello() {
  ctl::Hello h;
  h.device_id = 42;
  h.pid = 4242;
  h.start_time = 123456789;
  h.boot_id = "7d0b9c3e-0000-4000-8000-000000000000";
  h.hostname = "node-a";
  h.address = "127.0.0.1:13337";
  h.token = "s3cret";
  h.workers = {std::string("worker-0\0addr", 13), "worker-1-addr", std::string(300, 'w')};
  return h;
}

void expect_hello_eq(const ctl::Hello& a, const ctl::Hello& b) {
  EXPECT_EQ(a.device_id, b.device_id);
  EXPECT_EQ(a.pid, b.pid);
  EXPECT_EQ(a.start_time, b.start_time);
  EXPECT_EQ(a.boot_id, b.boot_id);
  EXPECT_EQ(a.hostname, b.hostname);
  EXPECT_EQ(a.address, b.address);
  EXPECT_EQ(a.token, b.token);
  EXPECT_EQ(a.workers, b.workers);
}

}  // namespace

// ---- RegionDescriptor ----

TEST(RegionDescriptor, RoundTrip) {
  const auto d = sample_descriptor();
  const std::string bytes = d.to_bytes();
  EXPECT_EQ(bytes.size(), kFixedSize + d.rkey.size());
  const auto back = parse(bytes);
  EXPECT_EQ(back, d);
  EXPECT_EQ(back.rkey.size(), d.rkey.size());
  // Stable: encoding the decoded value gives the same bytes.
  EXPECT_EQ(back.to_bytes(), bytes);
}

TEST(RegionDescriptor, RoundTripHostAndExtremes) {
  tw::RegionDescriptor d;
  d.device_id = std::numeric_limits<std::uint64_t>::max();
  d.address = 0;
  d.length = std::numeric_limits<std::uint64_t>::max();  // 0 + max does not wrap
  d.memory_type = tw::MemoryType::kHost;
  d.rkey = std::string(1u << 16, '\x5a');  // the largest rkey accepted
  EXPECT_EQ(parse(d.to_bytes()), d);

  d.address = 4096;
  d.length = 0;  // an empty region is representable
  d.rkey = "k";
  EXPECT_EQ(parse(d.to_bytes()), d);
}

TEST(RegionDescriptor, LittleEndianLayout) {
  const std::string bytes = sample_descriptor().to_bytes();
  EXPECT_EQ(bytes.substr(0, 4), "TWRD");
  EXPECT_EQ(static_cast<std::uint8_t>(bytes[kVersionOff]), tw::RegionDescriptor::kVersion);
  EXPECT_EQ(static_cast<std::uint8_t>(bytes[kMemTypeOff]), 1);  // kCuda
}

TEST(RegionDescriptor, RejectsBadMagic) {
  std::string bytes = sample_descriptor().to_bytes();
  bytes[0] = 'X';
  EXPECT_THROW(parse(bytes), tw::InvalidArgument);
  // A well-formed control message is not a descriptor either.
  const std::string msg = ctl::encode(ctl::Header{}, "");
  EXPECT_THROW(parse(msg), tw::InvalidArgument);
}

TEST(RegionDescriptor, RejectsOtherVersion) {
  for (std::uint8_t v : {std::uint8_t(0), std::uint8_t(2), std::uint8_t(255)}) {
    std::string bytes = sample_descriptor().to_bytes();
    poke<std::uint8_t>(bytes, kVersionOff, v);
    EXPECT_THROW(parse(bytes), tw::ProtocolMismatch) << "version " << int(v);
  }
}

TEST(RegionDescriptor, RejectsUnknownMemoryType) {
  std::string bytes = sample_descriptor().to_bytes();
  poke<std::uint8_t>(bytes, kMemTypeOff, 2);
  EXPECT_THROW(parse(bytes), tw::InvalidArgument);
}

TEST(RegionDescriptor, RejectsEveryTruncation) {
  const std::string bytes = sample_descriptor().to_bytes();
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THROW(tw::RegionDescriptor::from_bytes(bytes.data(), n), tw::InvalidArgument) << "prefix of " << n;
  }
  EXPECT_NO_THROW(tw::RegionDescriptor::from_bytes(bytes.data(), bytes.size()));
}

TEST(RegionDescriptor, RejectsNullEmptyInput) {
  EXPECT_THROW(tw::RegionDescriptor::from_bytes(nullptr, 0), tw::InvalidArgument);
}

TEST(RegionDescriptor, RejectsTrailingBytes) {
  std::string bytes = sample_descriptor().to_bytes();
  bytes.push_back('\0');
  EXPECT_THROW(parse(bytes), tw::InvalidArgument);
  bytes += "more";
  EXPECT_THROW(parse(bytes), tw::InvalidArgument);
}

TEST(RegionDescriptor, RejectsBadRkeyLength) {
  // Zero-length rkey.
  {
    tw::RegionDescriptor d = sample_descriptor();
    d.rkey.clear();
    EXPECT_THROW(parse(d.to_bytes()), tw::InvalidArgument);
  }
  // Oversized rkey (above 64 KiB), present in full.
  {
    tw::RegionDescriptor d = sample_descriptor();
    d.rkey = std::string((1u << 16) + 1, 'r');
    EXPECT_THROW(parse(d.to_bytes()), tw::InvalidArgument);
  }
  // A length field that claims more than is there / an absurd length.
  for (std::uint32_t len : {std::uint32_t(16), std::uint32_t(1000), std::uint32_t(0xffffffffu)}) {
    std::string bytes = sample_descriptor().to_bytes();
    poke<std::uint32_t>(bytes, kRkeyLenOff, len);
    EXPECT_THROW(parse(bytes), tw::InvalidArgument) << "rkey length " << len;
  }
  // A length field that claims less than is there: trailing bytes.
  {
    std::string bytes = sample_descriptor().to_bytes();
    poke<std::uint32_t>(bytes, kRkeyLenOff, 3);
    EXPECT_THROW(parse(bytes), tw::InvalidArgument);
  }
}

TEST(RegionDescriptor, RejectsWrapAround) {
  std::string bytes = sample_descriptor().to_bytes();
  poke<std::uint64_t>(bytes, kAddressOff, std::numeric_limits<std::uint64_t>::max() - 10);
  poke<std::uint64_t>(bytes, kLengthOff, 11);
  EXPECT_THROW(parse(bytes), tw::InvalidArgument);
  poke<std::uint64_t>(bytes, kLengthOff, 10);  // ends exactly at 2^64-1: fine
  EXPECT_NO_THROW(parse(bytes));
  poke<std::uint64_t>(bytes, kAddressOff, 1);
  poke<std::uint64_t>(bytes, kLengthOff, std::numeric_limits<std::uint64_t>::max());
  EXPECT_THROW(parse(bytes), tw::InvalidArgument);
}

// ---- control header ----

TEST(ControlWire, HeaderRoundTrip) {
  ctl::Header h;
  h.version = 7;
  h.type = ctl::MsgType::kCallReply;
  h.request_id = 0xfedcba9876543210ULL;
  h.status = ctl::Status::kHandlerError;
  const std::string msg = ctl::encode(h, "body!");
  ASSERT_EQ(msg.size(), 20u + 5u);
  std::uint32_t magic;
  std::memcpy(&magic, msg.data(), 4);
  EXPECT_EQ(magic, ctl::kMagic);
  EXPECT_EQ(msg.substr(0, 4), "TWCP");

  ByteReader r(msg.data(), msg.size(), "control message");
  const ctl::Header back = ctl::decode_header(r);
  EXPECT_EQ(back.version, 7);  // returned, not checked
  EXPECT_EQ(back.type, ctl::MsgType::kCallReply);
  EXPECT_EQ(back.request_id, h.request_id);
  EXPECT_EQ(back.status, ctl::Status::kHandlerError);
  EXPECT_EQ(r.left(), 5u);
  EXPECT_EQ(r.get_n(r.left()), "body!");
}

TEST(ControlWire, HeaderEveryType) {
  for (int t = 1; t <= 6; ++t) {
    ctl::Header h;
    h.type = static_cast<ctl::MsgType>(t);
    h.request_id = t;
    const std::string msg = ctl::encode(h, "");
    ByteReader r(msg.data(), msg.size(), "control message");
    EXPECT_EQ(ctl::decode_header(r).type, h.type);
    EXPECT_EQ(r.left(), 0u);
  }
}

TEST(ControlWire, HeaderRejectsUnknownType) {
  for (int t : {0, 9, 200, 255}) {
    std::string msg = ctl::encode(ctl::Header{}, "");
    msg[6] = static_cast<char>(t);
    ByteReader r(msg.data(), msg.size(), "control message");
    EXPECT_THROW(ctl::decode_header(r), tw::InvalidArgument) << "type " << t;
  }
}

TEST(ControlWire, HeaderRejectsBadMagic) {
  std::string msg = ctl::encode(ctl::Header{}, "");
  msg[3] = 'Z';
  ByteReader r(msg.data(), msg.size(), "control message");
  EXPECT_THROW(ctl::decode_header(r), tw::InvalidArgument);
}

TEST(ControlWire, HeaderRejectsEveryTruncation) {
  const std::string msg = ctl::encode(ctl::Header{}, "");
  for (std::size_t n = 0; n < msg.size(); ++n) {
    ByteReader r(msg.data(), n, "control message");
    EXPECT_THROW(ctl::decode_header(r), tw::InvalidArgument) << "prefix of " << n;
  }
}

// ---- HELLO ----

TEST(ControlWire, HelloRoundTrip) {
  const ctl::Hello h = sample_hello();
  const std::string body = ctl::encode_hello(h);
  ByteReader r(body.data(), body.size(), "HELLO");
  const ctl::Hello back = ctl::decode_hello(r);
  expect_hello_eq(back, h);
  EXPECT_EQ(r.left(), 0u);
}

TEST(ControlWire, HelloInsideMessageRoundTrip) {
  const ctl::Hello h = sample_hello();
  ctl::Header hdr;
  hdr.type = ctl::MsgType::kHello;
  hdr.request_id = 99;
  const std::string msg = ctl::encode(hdr, ctl::encode_hello(h));
  ByteReader r(msg.data(), msg.size(), "control message");
  EXPECT_EQ(ctl::decode_header(r).request_id, 99u);
  expect_hello_eq(ctl::decode_hello(r), h);
  EXPECT_EQ(r.left(), 0u);
}

TEST(ControlWire, HelloEmptyStringsRoundTrip) {
  ctl::Hello h;
  h.workers = {"w"};
  const std::string body = ctl::encode_hello(h);
  ByteReader r(body.data(), body.size(), "HELLO");
  expect_hello_eq(ctl::decode_hello(r), h);
}

TEST(ControlWire, HelloRejectsEveryTruncation) {
  const std::string body = ctl::encode_hello(sample_hello());
  for (std::size_t n = 0; n < body.size(); ++n) {
    // Copy the prefix so that a read past it would be caught by sanitizers too.
    const std::string prefix = body.substr(0, n);
    ByteReader r(prefix.data(), prefix.size(), "HELLO");
    EXPECT_THROW(ctl::decode_hello(r), tw::InvalidArgument) << "prefix of " << n;
  }
}

TEST(ControlWire, HelloRejectsZeroWorkers) {
  ctl::Hello h = sample_hello();
  h.workers.clear();
  const std::string body = ctl::encode_hello(h);  // the encoder does not police this
  ByteReader r(body.data(), body.size(), "HELLO");
  EXPECT_THROW(ctl::decode_hello(r), tw::InvalidArgument);
}

TEST(ControlWire, HelloRejectsTooManyWorkers) {
  ctl::Hello h = sample_hello();
  h.workers.assign(4097, "w");
  EXPECT_THROW(ctl::encode_hello(h), tw::InvalidArgument);

  // A hand-made body claiming 4097 workers is refused before reading them.
  ctl::Hello one = sample_hello();
  one.workers = {"w"};
  std::string body = ctl::encode_hello(one);
  // The tail: u16 count | u32-prefixed address "w" | u16-prefixed empty self proof | u64 data token.
  const std::size_t count_off = body.size() - 8 - 2 - (4 + 1) - 2;
  std::uint16_t n = 4097;
  std::memcpy(body.data() + count_off, &n, 2);
  ByteReader r(body.data(), body.size(), "HELLO");
  EXPECT_THROW(ctl::decode_hello(r), tw::InvalidArgument);
}

TEST(ControlWire, HelloRejectsOversizedField) {
  ctl::Hello h = sample_hello();
  h.hostname = std::string(0x10000, 'h');
  EXPECT_THROW(ctl::encode_hello(h), tw::InvalidArgument);
}

// ---- ByteReader / ByteWriter ----

TEST(ByteReader, Bounds) {
  ByteWriter w;
  w.put<std::uint8_t>(0xab);
  w.put<std::uint16_t>(0x1234);
  w.put<std::uint32_t>(0xdeadbeef);
  w.put<std::uint64_t>(0x0102030405060708ULL);
  const std::string& s = w.str();
  ASSERT_EQ(s.size(), 15u);
  EXPECT_EQ(static_cast<std::uint8_t>(s[1]), 0x34);  // little-endian
  EXPECT_EQ(static_cast<std::uint8_t>(s[2]), 0x12);

  ByteReader r(s.data(), s.size(), "test buffer");
  EXPECT_EQ(r.left(), 15u);
  EXPECT_EQ(r.get<std::uint8_t>(), 0xab);
  EXPECT_EQ(r.get<std::uint16_t>(), 0x1234);
  EXPECT_EQ(r.get<std::uint32_t>(), 0xdeadbeefu);
  EXPECT_EQ(r.left(), 8u);
  // A read that does not fit throws and consumes nothing.
  ByteReader r2(s.data() + 7, 7, "test buffer");
  EXPECT_THROW(r2.get<std::uint64_t>(), tw::InvalidArgument);
  EXPECT_EQ(r2.left(), 7u);
  EXPECT_EQ(r.get<std::uint64_t>(), 0x0102030405060708ULL);
  EXPECT_EQ(r.left(), 0u);
  EXPECT_THROW(r.get<std::uint8_t>(), tw::InvalidArgument);
  EXPECT_THROW(r.get_n(1), tw::InvalidArgument);
  EXPECT_EQ(r.get_n(0), "");
  EXPECT_EQ(r.left(), 0u);
}

TEST(ByteReader, EmptyBuffer) {
  ByteReader r(nullptr, 0, "nothing");
  EXPECT_EQ(r.left(), 0u);
  EXPECT_EQ(r.get_n(0), "");
  EXPECT_THROW(r.get<std::uint8_t>(), tw::InvalidArgument);
  EXPECT_THROW(r.get_bytes16(), tw::InvalidArgument);
}

TEST(ByteReader, ErrorNamesWhatWasRead) {
  ByteReader r(nullptr, 0, "widget");
  try {
    r.get<std::uint32_t>();
    FAIL() << "expected InvalidArgument";
  } catch (const tw::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("widget"), std::string::npos) << e.what();
    EXPECT_EQ(e.kind(), tw::ErrorKind::kInvalidArgument);
  }
}

TEST(ByteReader, LengthPrefixedFields) {
  ByteWriter w;
  w.put_bytes16("hello");
  w.put_bytes32(std::string("wo\0rld", 6));
  w.put_bytes16("");
  const std::string s = w.str();
  ByteReader r(s.data(), s.size(), "fields");
  EXPECT_EQ(r.get_bytes16(), "hello");
  EXPECT_EQ(r.get_bytes32(), std::string("wo\0rld", 6));
  EXPECT_EQ(r.get_bytes16(), "");
  EXPECT_EQ(r.left(), 0u);
}

TEST(ByteReader, LengthPrefixLargerThanBuffer) {
  // A 16-bit length of 100 followed by only 3 bytes.
  ByteWriter w;
  w.put<std::uint16_t>(100);
  w.put_raw("abc");
  const std::string s = w.str();
  ByteReader r(s.data(), s.size(), "fields");
  EXPECT_THROW(r.get_bytes16(), tw::InvalidArgument);

  // A 32-bit length near 4 GiB must not wrap the bounds check.
  ByteWriter w32;
  w32.put<std::uint32_t>(0xffffffffu);
  w32.put_raw("x");
  const std::string s32 = w32.str();
  ByteReader r32(s32.data(), s32.size(), "fields");
  EXPECT_THROW(r32.get_bytes32(), tw::InvalidArgument);

  // get_n with a size_t that would overflow a pointer addition.
  ByteReader rn(s.data(), s.size(), "fields");
  EXPECT_THROW(rn.get_n(std::numeric_limits<std::size_t>::max()), tw::InvalidArgument);
}

TEST(ByteWriter, RejectsOversizedField) {
  ByteWriter w;
  EXPECT_THROW(w.put_bytes16(std::string(0x10000, 'x')), tw::InvalidArgument);
  EXPECT_TRUE(w.str().empty());  // nothing half-written
  EXPECT_NO_THROW(w.put_bytes16(std::string(0xffff, 'x')));
  EXPECT_EQ(w.str().size(), 2u + 0xffff);
}

// Packed UCP remote keys as UCX 1.22 made them on an H100 machine
// (bench/results/gpu_env_h100.txt): the checker that walks a peer's key
// before ucp_ep_rkey_unpack trusts it must accept both, and no truncation.
namespace {
std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}
const char* const kHostKey = "0500000000000000000c0c00000000d07fce057f000000ff";
const char* const kGpuKey =
    "0c000000000000000100c00100000000000000608e38030000000033020000000000000000000400000000004000000000000006"
    "00000000ff000032000000000000002000d0c19600005c0000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000009f"
    "03000000000000330200007564615f0000009e057f00000000000400000000d578c0f737aa56651b215fff02eb857f0000000fff";
}  // namespace

TEST(PackedRkey, AcceptsHostAndGpuKeysOfUcx122) {
  EXPECT_TRUE(tensorwire::ucx::packed_rkey_well_formed(from_hex(kHostKey)));
  const std::string gpu = from_hex(kGpuKey);
  ASSERT_EQ(gpu.size(), 208u);
  EXPECT_TRUE(tensorwire::ucx::packed_rkey_well_formed(gpu));
}

TEST(PackedRkey, RefusesTruncatedOrForgedKeys) {
  const std::string gpu = from_hex(kGpuKey);
  // (Cutting the end marker alone leaves a well-formed tail: the walk guards
  // the memory-domain entries, which UCX would read past.)
  for (std::size_t cut : {2u, 6u, 50u, 199u}) {
    EXPECT_FALSE(tensorwire::ucx::packed_rkey_well_formed(gpu.substr(0, gpu.size() - cut))) << cut;
  }
  std::string forged = gpu;
  forged[0] = '\x7f';  // more memory domains than entries
  EXPECT_FALSE(tensorwire::ucx::packed_rkey_well_formed(forged));
  std::string bad_type = gpu;
  bad_type[8] = '\x7f';
  EXPECT_FALSE(tensorwire::ucx::packed_rkey_well_formed(bad_type));
}
