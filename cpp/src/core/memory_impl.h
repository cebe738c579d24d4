// Copyright tensorwire authors.
//
// Internals of the memory pool: slabs registered with ucp_mem_map(ALLOCATE)
// and a first-fit allocator with coalescing over each slab's free ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tensorwire/memory.h"
#include "ucx/ucx.h"

namespace tensorwire::detail {

class PoolImpl;

// Whether a registered local range is GPU memory (as UCX registered it).
inline bool gpu_memory(const LocalRegion& local) {
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE;
  return local.memh && ucp_mem_query(local.memh, &attr) == UCS_OK && attr.mem_type == UCS_MEMORY_TYPE_CUDA;
}

class Slab {
 public:
  Slab(std::shared_ptr<ucx::MemHandle> memh, std::weak_ptr<PoolImpl> pool, std::uint64_t device_id, bool dedicated,
       int gpu)
      : memh(std::move(memh)), pool(std::move(pool)), device_id(device_id), dedicated(dedicated), gpu(gpu) {}
  std::shared_ptr<ucx::MemHandle> memh;
  std::weak_ptr<PoolImpl> pool;
  std::uint64_t device_id;
  bool dedicated;
  int gpu;  // the GPU whose memory this is; -1 host                          // one block spans the whole slab
  std::map<std::size_t, std::size_t> free_;  // offset -> length; guarded by the pool's mutex
  char* base() const { return static_cast<char*>(memh->address()); }
  // A shared slab with nothing leased from it (pool's mutex held).
  bool empty() const {
    return free_.size() == 1 && free_.begin()->first == 0 && free_.begin()->second == memh->length();
  }
};

class PoolImpl : public std::enable_shared_from_this<PoolImpl> {
 public:
  // `large_shared`: dedicated slabs for large blocks are UCX-allocated shared
  // memory (mappable by same-host peers) rather than anonymous huge pages.
  // `gpu` >= 0: a CUDA arena, whose slabs are that GPU's memory.
  PoolImpl(std::shared_ptr<ucx::Context> context, std::uint64_t device_id, std::size_t slab_size, std::size_t limit,
           bool large_shared, int gpu = -1);
  Block allocate(std::size_t nbytes, std::size_t alignment);
  void free(Slab* slab, std::size_t offset, std::size_t size);
  // kCuda: [ptr, ptr+nbytes) must lie in one GPU allocation, which is
  // registered whole (one registration serves every tensor of an
  // allocator's segment).
  Registration register_memory(void* ptr, std::size_t nbytes, MemoryType type);
  PoolStats stats() const;
  int gpu() const { return gpu_; }
  void forget_registration(std::uintptr_t start, std::size_t length);
  // The slab holding [address, address+length), if this pool allocated it:
  // whoever holds the result keeps that memory mapped, even after the pool
  // freed or dropped the slab. Not for user registrations, whose memory the
  // user may free.
  std::shared_ptr<const void> pin(std::uint64_t address, std::size_t length) const;
  std::vector<std::uintptr_t> slab_starts() const;  // the first byte of every slab
  // The packed rkey of a registration of exactly [address, address+length),
  // for a peer that must reach nothing else of the slab (on RDMA a slab's
  // key covers all of it). Cached until a block overlapping it is freed or
  // its registration dropped; then the key stops working.
  std::string exact_rkey(const void* address, std::size_t length, MemoryType type);
  // Called with [start, end) before a block or registration returns, so that
  // no peer keeps a grant to memory that is leased again (DeviceImpl::
  // revoke_grants). Set once, before the pool is shared.
  void set_revoker(std::function<void(std::uintptr_t, std::uintptr_t)> revoker) { revoker_ = std::move(revoker); }

 private:
  bool carve(Slab& slab, std::size_t nbytes, std::size_t alignment, std::size_t* offset);
  std::shared_ptr<Slab> take_cached_large(std::size_t size);
  // Frees empty shared slabs, then cached large ones, until `needed` more fits.
  void drop_cached_large(std::size_t needed);
  void drop_slab(Slab* slab);  // the pool forgets it (caller holds mu_)
  std::shared_ptr<Slab> new_slab(std::size_t bytes, bool dedicated);

  std::shared_ptr<ucx::Context> context_;
  std::uint64_t device_id_;
  std::size_t slab_size_;
  std::size_t limit_;
  bool large_shared_;
  int gpu_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Slab>> slabs_;
  std::vector<std::shared_ptr<Slab>> large_cache_;  // freed dedicated slabs, for reuse
  std::size_t cached_large_bytes_ = 0;
  PoolStats stats_;
  // Registration cache: start address -> live registration (weak: a hit is
  // only served while the caller still holds a registration of that range,
  // so freed-and-reused addresses never hit a stale entry).
  std::map<std::uintptr_t, std::weak_ptr<RegistrationImpl>> registrations_;
  struct Exact {
    std::size_t length;
    std::shared_ptr<ucx::MemHandle> memh;
  };
  std::function<void(std::uintptr_t, std::uintptr_t)> revoker_;
  std::multimap<std::uintptr_t, Exact> exact_;  // start -> exact registrations (exact_rkey)
  // Moves the exact registrations starting inside [start, end) to `out`
  // (unmapped by the caller, outside mu_).
  void take_exact(std::uintptr_t start, std::uintptr_t end, std::vector<std::shared_ptr<ucx::MemHandle>>* out);
};

class RegistrationImpl {
 public:
  RegistrationImpl(std::shared_ptr<ucx::MemHandle> memh, std::weak_ptr<PoolImpl> pool, std::uint64_t device_id, int gpu)
      : memh(std::move(memh)), pool(std::move(pool)), device_id(device_id), gpu(gpu) {}
  ~RegistrationImpl();
  std::shared_ptr<ucx::MemHandle> memh;
  std::weak_ptr<PoolImpl> pool;
  std::uint64_t device_id;
  int gpu;  // -1 host
};

class RemoteRegionImpl {
 public:
  explicit RemoteRegionImpl(RegionDescriptor d) : descriptor(std::move(d)) {}
  struct Access {
    ucp_rkey_h rkey = nullptr;
    // The region's first byte mapped into this process, when a shared-memory
    // transport can map it (ucp_rkey_ptr); nullptr otherwise.
    char* mapped = nullptr;
  };
  // The rkey unpacked on `endpoint` (cached; one per lane).
  // `own`: this device's pool, whose memory a peer's key must never map.
  // InvalidArgument when the key maps less than the descriptor's range.
  // `owner_pid`: the exporting peer's process, which must map the segment too.
  // `verify` false: a channel to this very device, whose regions are its own memory.
  Access access_for(const std::shared_ptr<ucx::Endpoint>& endpoint, const PoolImpl* own, std::uint32_t owner_pid,
                    bool verify);
  // For a region of this process's own device (a channel to itself): its
  // first byte, with the memory pinned for as long as this object lives
  // (pool.pin); nullptr when `pool` did not allocate it (the first answer is
  // cached).
  char* own_memory(const PoolImpl& pool);
  const RegionDescriptor descriptor;

 private:
  bool pin_tried_ = false;              // guarded by mu_
  std::shared_ptr<const void> pinned_;  // guarded by mu_
  struct Entry {
    ucx::Endpoint* endpoint;
    std::unique_ptr<ucx::Rkey> rkey;
    char* mapped;
  };
  std::mutex mu_;
  std::vector<Entry> rkeys_;
};

}  // namespace tensorwire::detail
