// Copyright tensorwire authors.
//
// RegionDescriptor: what a peer needs to reach a registered region, in a
// compact, versioned, little-endian byte form (docs/contracts.md, "Region
// descriptor"). RemoteRegion: a descriptor received from a peer, with its
// remote key unpacked lazily per endpoint (lane) and cached.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tensorwire {

enum class MemoryType : std::uint8_t { kHost = 0, kCuda = 1 };

struct RegionDescriptor {
  static constexpr std::uint8_t kVersion = 1;
  std::uint64_t device_id = 0;
  std::uint64_t address = 0;
  std::uint64_t length = 0;
  MemoryType memory_type = MemoryType::kHost;
  std::string rkey;  // UCX packed remote key

  std::string to_bytes() const;
  // Throws ProtocolMismatch on a wrong version, InvalidArgument on a bad
  // magic or a truncated or inconsistent buffer.
  static RegionDescriptor from_bytes(const void* data, std::size_t size);
  bool operator==(const RegionDescriptor&) const = default;
};

namespace detail {
class RemoteRegionImpl;
}

class RemoteRegion {
 public:
  RemoteRegion() = default;
  explicit RemoteRegion(std::shared_ptr<detail::RemoteRegionImpl> impl) : impl_(std::move(impl)) {}
  const RegionDescriptor& descriptor() const;
  std::uint64_t address() const { return descriptor().address; }
  std::uint64_t length() const { return descriptor().length; }
  explicit operator bool() const noexcept { return impl_ != nullptr; }
  detail::RemoteRegionImpl* impl() const noexcept { return impl_.get(); }
  std::shared_ptr<const void> shared() const noexcept { return impl_; }

 private:
  std::shared_ptr<detail::RemoteRegionImpl> impl_;
};

}  // namespace tensorwire
