// Copyright tensorwire authors.
//
// Region descriptor wire form (little-endian):
//   u32 magic "TWRD" | u8 version | u8 memory type | u16 reserved (0)
//   u64 device id | u64 address | u64 length | u32 rkey length | rkey bytes
#include "tensorwire/region.h"
#include "common/bytes.h"

namespace tensorwire {

namespace {
constexpr std::uint32_t kMagic = 0x44525754;  // "TWRD"
constexpr std::uint32_t kMaxRkey = 1u << 16;
}  // namespace

std::string RegionDescriptor::to_bytes() const {
  detail::ByteWriter w;
  w.put<std::uint32_t>(kMagic);
  w.put<std::uint8_t>(kVersion);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(memory_type));
  w.put<std::uint16_t>(0);
  w.put<std::uint64_t>(device_id);
  w.put<std::uint64_t>(address);
  w.put<std::uint64_t>(length);
  w.put_bytes32(rkey);
  return std::move(w.str());
}

RegionDescriptor RegionDescriptor::from_bytes(const void* data, std::size_t size) {
  detail::ByteReader r(data, size, "region descriptor");
  if (r.get<std::uint32_t>() != kMagic) throw InvalidArgument("not a region descriptor (bad magic)");
  std::uint8_t version = r.get<std::uint8_t>();
  if (version != kVersion) {
    throw ProtocolMismatch("region descriptor version " + std::to_string(version) + ", this build reads version " +
                           std::to_string(kVersion));
  }
  RegionDescriptor d;
  std::uint8_t mt = r.get<std::uint8_t>();
  if (mt > static_cast<std::uint8_t>(MemoryType::kCuda))
    throw InvalidArgument("unknown memory type in region descriptor");
  d.memory_type = static_cast<MemoryType>(mt);
  r.get<std::uint16_t>();
  d.device_id = r.get<std::uint64_t>();
  d.address = r.get<std::uint64_t>();
  d.length = r.get<std::uint64_t>();
  std::uint32_t rkey_len = r.get<std::uint32_t>();
  if (rkey_len == 0 || rkey_len > kMaxRkey) throw InvalidArgument("region descriptor has an invalid rkey length");
  d.rkey = r.get_n(rkey_len);
  if (r.left() != 0) throw InvalidArgument("region descriptor has trailing bytes");
  if (d.address + d.length < d.address) throw InvalidArgument("region descriptor range wraps around");
  return d;
}

}  // namespace tensorwire
