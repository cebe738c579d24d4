// Copyright tensorwire authors.
//
// Registered memory: a pool of large registered slabs with an allocator on
// top (Block leases), and registration of outside memory (Registration) with
// a cache keyed by address range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire/region.h"

struct ucp_mem;

namespace tensorwire {

namespace detail {
class Slab;
class PoolImpl;
class RegistrationImpl;
}  // namespace detail

// A registered range of local memory, as the data path needs it. `owner`
// keeps the registration (and through it the UCX context) alive.
struct LocalRegion {
  void* address = nullptr;
  std::size_t length = 0;
  ucp_mem* memh = nullptr;
  std::shared_ptr<const void> owner;
  const std::string* rkey = nullptr;  // packed remote key (owned by `owner`)
};

// A move-only lease of pool memory. The memory returns to its pool when the
// Block is destroyed; it stays mapped as long as the Block lives, even after
// its Device closed (children keep their parents alive).
class Block {
 public:
  Block() = default;
  Block(Block&& other) noexcept : slab_(std::move(other.slab_)), offset_(other.offset_), size_(other.size_) {
    other.size_ = 0;
  }
  Block& operator=(Block&&) noexcept;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block();

  void* data() const noexcept;
  std::size_t size() const noexcept { return size_; }
  explicit operator bool() const noexcept { return slab_ != nullptr; }
  LocalRegion region() const;
  // What a peer needs to reach this block (device id, address, length, rkey).
  RegionDescriptor descriptor() const;
  MemoryType memory_type() const noexcept;
  int gpu() const noexcept;  // the CUDA device ordinal of GPU memory; -1 for host memory

 private:
  friend class detail::PoolImpl;
  std::shared_ptr<detail::Slab> slab_;
  std::size_t offset_ = 0;
  std::size_t size_ = 0;
};

// Registered outside memory (the caller keeps the memory alive as long as
// this object lives). Copies share one registration.
class Registration {
 public:
  Registration() = default;
  Registration(std::shared_ptr<detail::RegistrationImpl> impl, void* address, std::size_t length)
      : impl_(std::move(impl)), address_(address), length_(length) {}
  void* data() const noexcept { return address_; }
  std::size_t size() const noexcept { return length_; }
  LocalRegion region() const;
  RegionDescriptor descriptor() const;
  MemoryType memory_type() const noexcept;
  int gpu() const noexcept;  // -1 for host memory
  explicit operator bool() const noexcept { return impl_ != nullptr; }

 private:
  std::shared_ptr<detail::RegistrationImpl> impl_;
  void* address_ = nullptr;  // the range asked for: inside the (cached) registration
  std::size_t length_ = 0;
};

struct PoolStats {
  std::size_t bytes_in_use = 0;    // bytes leased out as Blocks
  std::size_t bytes_reserved = 0;  // bytes held in registered slabs
  std::size_t slabs = 0;
  std::size_t blocks = 0;
  std::size_t registrations = 0;  // live registrations of outside memory
  std::size_t registration_cache_hits = 0;
  std::size_t registration_cache_misses = 0;
  std::size_t exact_exports = 0;  // live registrations of exactly an exported range (contracts §11)
};

class MemoryPool {
 public:
  explicit MemoryPool(std::shared_ptr<detail::PoolImpl> impl) : impl_(std::move(impl)) {}
  // A block of at least `nbytes` (> 0) aligned to `alignment` (a power of two).
  // Throws PoolExhausted when the pool limit would be exceeded.
  Block allocate(std::size_t nbytes, std::size_t alignment = 64);
  // Registers [ptr, ptr+nbytes). A range inside a live earlier registration
  // of the same memory type is served from the cache without calling UCX.
  // GPU memory (kCuda) is registered by its whole allocation, so the tensors
  // of one allocator segment share one registration; a range that is not
  // GPU memory, or spans past its allocation, is InvalidArgument.
  Registration register_memory(void* ptr, std::size_t nbytes, MemoryType type = MemoryType::kHost);
  PoolStats stats() const;

 private:
  std::shared_ptr<detail::PoolImpl> impl_;
};

// Copies n bytes as the direct path copies into a mapped peer region
// (`rep movsb` from 64 KiB, streaming stores for the largest copies). The
// ranges must not overlap.
void copy_memory(void* dst, const void* src, std::size_t n);

// What the CUDA driver offers. The driver is loaded at run time: a build or a
// machine without CUDA says why here instead of failing.
struct CudaInfo {
  bool available = false;
  std::string reason;                // why not, when !available ("libcuda.so.1 not found", ...)
  int driver_version = 0;            // e.g. 13000; 0 when unavailable
  std::vector<std::string> devices;  // names, by ordinal
};
CudaInfo cuda_info();

}  // namespace tensorwire
