// Copyright tensorwire authors.
//
// RegionDescriptor::from_bytes (docs/contracts.md §9.1): what a peer's LOOKUP
// reply or slot attach hands us. An accepted descriptor must satisfy the
// decoder's own rules and survive to_bytes() -> from_bytes() unchanged.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz_common.h"
#include "tensorwire/region.h"

using tensorwire::RegionDescriptor;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto d = tw_fuzz::decode_or_refuse([&] { return RegionDescriptor::from_bytes(data, size); });
  if (!d) return 0;

  TW_FUZZ_CHECK(d->memory_type == tensorwire::MemoryType::kHost || d->memory_type == tensorwire::MemoryType::kCuda);
  TW_FUZZ_CHECK(!d->rkey.empty() && d->rkey.size() <= (1u << 16));
  TW_FUZZ_CHECK(d->address + d->length >= d->address);  // a range that does not wrap

  // The encoding is canonical except the reserved u16 at offset 6 (read, not checked).
  const std::string bytes = d->to_bytes();
  TW_FUZZ_CHECK(bytes.size() == size);
  TW_FUZZ_CHECK(std::memcmp(bytes.data(), data, 6) == 0);
  TW_FUZZ_CHECK(std::memcmp(bytes.data() + 8, data + 8, size - 8) == 0);
  TW_FUZZ_CHECK(RegionDescriptor::from_bytes(bytes.data(), bytes.size()) == *d);
  return 0;
}
