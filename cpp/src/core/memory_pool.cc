// Copyright tensorwire authors.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "core/memory_impl.h"
#include "cuda/driver.h"

namespace tensorwire {
namespace detail {

namespace {
std::size_t align_up(std::size_t v, std::size_t a) { return (v + a - 1) & ~(a - 1); }
std::string to_hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
  return buf;
}
constexpr std::size_t kPage = 4096;
constexpr std::size_t kHugePage = std::size_t(2) << 20;
constexpr std::size_t kLargeBlock = std::size_t(1) << 20;       // blocks from here on get their own slab
constexpr std::size_t kLargeCacheBytes = std::size_t(1) << 30;  // freed large slabs kept for reuse
constexpr std::size_t kMaxBlock = std::size_t(1) << 62;         // rounding and doubling stay in range
}  // namespace

PoolImpl::PoolImpl(std::shared_ptr<ucx::Context> context, std::uint64_t device_id, std::size_t slab_size,
                   std::size_t limit, bool large_shared, int gpu)
    : context_(std::move(context)),
      device_id_(device_id),
      slab_size_(align_up(slab_size, kPage)),
      limit_(limit),
      large_shared_(large_shared),
      gpu_(gpu) {}

std::shared_ptr<Slab> PoolImpl::new_slab(std::size_t bytes, bool dedicated) {
  if (stats_.bytes_reserved + bytes > limit_) drop_cached_large(bytes);
  if (stats_.bytes_reserved + bytes > limit_) {
    throw PoolExhausted("memory pool limit reached: " + std::to_string(stats_.bytes_reserved) + " bytes reserved + " +
                        std::to_string(bytes) + " requested > limit " + std::to_string(limit_));
  }
  std::shared_ptr<ucx::MemHandle> memh;
  if (gpu_ >= 0) {
    // GPU memory from the driver, registered whole; the handle frees it
    // after its unmap. Zeroed once, like host slabs.
    void* p = cuda::allocate(gpu_, bytes);
    const int gpu = gpu_;
    cuda::bind_thread(gpu_);  // UCX registers GPU memory in the caller's context
    memh = std::make_shared<ucx::MemHandle>(context_, p, bytes, ucx::MemHandle::Backing::kRegister, /*cuda=*/true,
                                            [gpu, p] { cuda::release(gpu, p); });
    cuda::zero(gpu_, p, bytes);
    auto slab = std::make_shared<Slab>(std::move(memh), weak_from_this(), device_id_, dedicated, gpu_);
    if (!dedicated) slab->free_.emplace(0, bytes);
    stats_.bytes_reserved += bytes;
    ++stats_.slabs;
    return slab;
  }
  try {
    // UCX-allocated slabs are shared memory that same-host peers map, so
    // their writes are a plain memcpy. Without that mapping (tcp, or
    // map_shared_memory off) large blocks get anonymous huge pages: cma
    // copies those twice as fast as shared-memory pages.
    const bool huge = dedicated && !large_shared_;
    memh = std::make_shared<ucx::MemHandle>(context_, nullptr, bytes,
                                            huge ? ucx::MemHandle::Backing::kHugeAnon : ucx::MemHandle::Backing::kUcx);
  } catch (const Error& e) {
    throw PoolExhausted(std::string("cannot allocate a registered slab: ") + e.what(), e.ucx_status());
  }
  // Touch every page now: a transfer into fresh pages is capped by page faults.
  std::memset(memh->address(), 0, bytes);
  auto slab = std::make_shared<Slab>(std::move(memh), weak_from_this(), device_id_, dedicated, -1);
  if (!dedicated) slab->free_.emplace(0, bytes);
  stats_.bytes_reserved += bytes;
  ++stats_.slabs;
  return slab;
}

std::shared_ptr<Slab> PoolImpl::take_cached_large(std::size_t size) {
  // The smallest cached slab that fits and wastes at most half of itself
  // (beyond the huge-page rounding a new slab would have anyway).
  const std::size_t max_len = std::max(2 * size, align_up(size, kHugePage));
  auto best = large_cache_.end();
  for (auto it = large_cache_.begin(); it != large_cache_.end(); ++it) {
    std::size_t len = (*it)->memh->length();
    if (len >= size && len <= max_len && (best == large_cache_.end() || len < (*best)->memh->length())) best = it;
  }
  if (best == large_cache_.end()) return nullptr;
  auto slab = *best;
  large_cache_.erase(best);
  cached_large_bytes_ -= slab->memh->length();
  return slab;
}

void PoolImpl::drop_cached_large(std::size_t needed) {
  // The reserve of empty shared slabs first, then the cache of large ones.
  for (std::size_t i = slabs_.size(); i-- > 0 && stats_.bytes_reserved + needed > limit_;) {
    if (!slabs_[i]->dedicated && slabs_[i]->empty()) drop_slab(slabs_[i].get());
  }
  while (!large_cache_.empty() && stats_.bytes_reserved + needed > limit_) {
    Slab* victim = large_cache_.back().get();
    cached_large_bytes_ -= victim->memh->length();
    drop_slab(victim);
    large_cache_.pop_back();
  }
}

bool PoolImpl::carve(Slab& slab, std::size_t nbytes, std::size_t alignment, std::size_t* offset) {
  const auto base = reinterpret_cast<std::uintptr_t>(slab.base());
  for (auto it = slab.free_.begin(); it != slab.free_.end(); ++it) {
    std::size_t start = it->first, len = it->second;
    std::size_t aligned = align_up(base + start, alignment) - base;
    if (aligned + nbytes > start + len) continue;
    slab.free_.erase(it);
    if (aligned > start) slab.free_.emplace(start, aligned - start);
    if (aligned + nbytes < start + len) slab.free_.emplace(aligned + nbytes, start + len - aligned - nbytes);
    *offset = aligned;
    return true;
  }
  return false;
}

Block PoolImpl::allocate(std::size_t nbytes, std::size_t alignment) {
  if (nbytes == 0) throw InvalidArgument("cannot allocate a block of 0 bytes");
  if (nbytes > kMaxBlock) {
    throw InvalidArgument("cannot allocate " + std::to_string(nbytes) + " bytes: blocks are limited to 2^62 bytes");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kPage) {
    throw InvalidArgument("alignment must be a power of two <= 4096, got " + std::to_string(alignment));
  }
  // Round sizes to the cache line so neighbouring blocks never share one.
  const std::size_t size = align_up(nbytes, 64);
  std::lock_guard<std::mutex> lock(mu_);
  Block block;
  std::size_t offset = 0;
  if (size >= kLargeBlock || size > slab_size_ / 2) {
    block.slab_ = take_cached_large(size);
    if (!block.slab_) {
      auto slab = new_slab(align_up(size, kHugePage), /*dedicated=*/true);
      slabs_.push_back(slab);
      block.slab_ = std::move(slab);
    }
    block.offset_ = 0;
  } else {
    for (auto& slab : slabs_) {
      if (!slab->dedicated && carve(*slab, size, alignment, &offset)) {
        block.slab_ = slab;
        break;
      }
    }
    if (!block.slab_) {
      auto slab = new_slab(slab_size_, false);
      slabs_.push_back(slab);
      if (!carve(*slab, size, alignment, &offset)) throw PoolExhausted("allocator failed on a fresh slab");
      block.slab_ = std::move(slab);
    }
    block.offset_ = offset;
  }
  block.size_ = size;
  stats_.bytes_in_use += size;
  ++stats_.blocks;
  return block;
}

std::string PoolImpl::exact_rkey(const void* address, std::size_t length, MemoryType type) {
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [lo, hi] = exact_.equal_range(start);
    for (auto it = lo; it != hi; ++it) {
      if (it->second.length == length) return it->second.memh->packed_rkey();
    }
  }
  if (type == MemoryType::kCuda) cuda::bind_thread(cuda::query(address).ordinal);
  auto memh = std::make_shared<ucx::MemHandle>(context_, const_cast<void*>(address), length,
                                               ucx::MemHandle::Backing::kRegister, type == MemoryType::kCuda);
  std::string rkey = memh->packed_rkey();
  std::lock_guard<std::mutex> lock(mu_);
  exact_.emplace(start, Exact{length, std::move(memh)});
  return rkey;
}

void PoolImpl::take_exact(std::uintptr_t start, std::uintptr_t end, std::vector<std::shared_ptr<ucx::MemHandle>>* out) {
  for (auto it = exact_.lower_bound(start); it != exact_.end() && it->first < end;) {
    out->push_back(std::move(it->second.memh));
    it = exact_.erase(it);
  }
}

void PoolImpl::free(Slab* slab, std::size_t offset, std::size_t size) {
  const auto start = reinterpret_cast<std::uintptr_t>(slab->base()) + offset;
  if (revoker_) revoker_(start, start + size);           // before the range can be leased (and granted) again
  std::vector<std::shared_ptr<ucx::MemHandle>> revoked;  // unmapped after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  if (!exact_.empty()) take_exact(start, start + size, &revoked);
  stats_.bytes_in_use -= size;
  --stats_.blocks;
  if (slab->dedicated) {
    // Keep a few for reuse: fresh pages cost page faults on every transfer
    // (a receiver allocating per tensor would be capped near 2 GB/s).
    if (cached_large_bytes_ + slab->memh->length() <= kLargeCacheBytes) {
      for (auto& s : slabs_) {
        if (s.get() == slab) {
          large_cache_.push_back(s);
          cached_large_bytes_ += slab->memh->length();
          return;
        }
      }
    }
    drop_slab(slab);
    return;
  }
  auto& fl = slab->free_;
  auto next = fl.lower_bound(offset);
  // Coalesce with the following and the preceding free ranges.
  if (next != fl.end() && offset + size == next->first) {
    size += next->second;
    next = fl.erase(next);
  }
  bool merged = false;
  if (next != fl.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += size;
      merged = true;
    }
  }
  if (!merged) fl.emplace(offset, size);
  // An empty slab goes back, so that its bytes can serve a larger block;
  // one shared slab stays as a reserve (dropped too when the limit needs it).
  if (slab->empty()) {
    const auto shared = std::count_if(slabs_.begin(), slabs_.end(), [](const auto& s) { return !s->dedicated; });
    if (shared > 1) drop_slab(slab);
  }
}

void PoolImpl::drop_slab(Slab* slab) {
  for (auto it = slabs_.begin(); it != slabs_.end(); ++it) {
    if (it->get() == slab) {
      stats_.bytes_reserved -= slab->memh->length();
      --stats_.slabs;
      slabs_.erase(it);  // blocks still pointing at it keep it mapped
      return;
    }
  }
}

Registration PoolImpl::register_memory(void* ptr, std::size_t nbytes, MemoryType type) {
  if (ptr == nullptr || nbytes == 0) throw InvalidArgument("cannot register an empty or null range");
  const auto start = reinterpret_cast<std::uintptr_t>(ptr);
  if (start + nbytes < start) throw InvalidArgument("cannot register a range that wraps around the address space");
  const bool cuda = type == MemoryType::kCuda;
  // What is registered: the range itself, or for GPU memory its whole
  // allocation (the driver knows it), so later tensors of it hit the cache.
  void* reg_start = ptr;
  std::size_t reg_length = nbytes;
  int gpu = -1;
  if (cuda) {
    const cuda::PointerInfo info = cuda::query(ptr);
    if (!info.device) {
      throw InvalidArgument(cuda::available() ? "cannot register 0x" + to_hex(start) +
                                                    " as GPU memory: it is not live GPU memory "
                                                    "(freed, host or managed memory)"
                                              : "cannot register GPU memory: " + cuda::unavailable_reason());
    }
    if (start + nbytes > info.base + info.size) {
      throw InvalidArgument("cannot register " + std::to_string(nbytes) + " bytes at 0x" + to_hex(start) +
                            ": the range runs past its GPU allocation of " + std::to_string(info.size) + " bytes");
    }
    reg_start = reinterpret_cast<void*>(info.base);
    reg_length = info.size;
    gpu = info.ordinal;
  }
  std::shared_ptr<RegistrationImpl> candidate;  // released outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The candidate is the live registration with the greatest start <= ptr.
    auto it = registrations_.upper_bound(start);
    if (it != registrations_.begin()) candidate = std::prev(it)->second.lock();
    if (candidate && candidate->memh->cuda() == cuda) {
      const auto rstart = reinterpret_cast<std::uintptr_t>(candidate->memh->address());
      if (start >= rstart && start + nbytes <= rstart + candidate->memh->length()) {
        ++stats_.registration_cache_hits;
        return Registration(std::move(candidate), ptr, nbytes);
      }
    }
    ++stats_.registration_cache_misses;
  }
  if (cuda) cuda::bind_thread(gpu);  // UCX registers GPU memory in the caller's context
  auto memh =
      std::make_shared<ucx::MemHandle>(context_, reg_start, reg_length, ucx::MemHandle::Backing::kRegister, cuda);
  auto reg = std::make_shared<RegistrationImpl>(std::move(memh), weak_from_this(), device_id_, gpu);
  std::lock_guard<std::mutex> lock(mu_);
  registrations_[reinterpret_cast<std::uintptr_t>(reg_start)] = reg;
  ++stats_.registrations;
  return Registration(std::move(reg), ptr, nbytes);
}

void PoolImpl::forget_registration(std::uintptr_t start, std::size_t length) {
  if (revoker_) revoker_(start, start + length);
  std::vector<std::shared_ptr<ucx::MemHandle>> revoked;  // unmapped after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  take_exact(start, start + length, &revoked);
  auto it = registrations_.find(start);
  if (it != registrations_.end() && it->second.expired()) registrations_.erase(it);
  --stats_.registrations;
}

PoolStats PoolImpl::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats s = stats_;
  s.exact_exports = exact_.size();
  return s;
}

RegistrationImpl::~RegistrationImpl() {
  if (auto p = pool.lock()) p->forget_registration(reinterpret_cast<std::uintptr_t>(memh->address()), memh->length());
}

std::vector<std::uintptr_t> PoolImpl::slab_starts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::uintptr_t> out;
  for (const auto& slab : slabs_) out.push_back(reinterpret_cast<std::uintptr_t>(slab->memh->address()));
  return out;
}

std::shared_ptr<const void> PoolImpl::pin(std::uint64_t address, std::size_t length) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& slab : slabs_) {
    const auto start = reinterpret_cast<std::uint64_t>(slab->memh->address());
    if (address >= start && length <= slab->memh->length() && address - start <= slab->memh->length() - length) {
      return slab->memh;
    }
  }
  return nullptr;
}

char* RemoteRegionImpl::own_memory(const PoolImpl& pool) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pin_tried_) {
    pinned_ = pool.pin(descriptor.address, descriptor.length);
    pin_tried_ = true;
  }
  return pinned_ ? reinterpret_cast<char*>(descriptor.address) : nullptr;
}

namespace {
struct Mapping {
  unsigned long start = 0, end = 0, inode = 0;
  char perms[8] = {0};
  char dev[16] = {0};
};

std::vector<Mapping> read_mappings(const char* path = "/proc/self/maps") {
  std::vector<Mapping> out;
  FILE* f = std::fopen(path, "r");
  if (!f) return out;
  char line[512];
  while (std::fgets(line, sizeof(line), f)) {
    Mapping m;
    unsigned long offset = 0;
    if (std::sscanf(line, "%lx-%lx %7s %lx %15s %lu", &m.start, &m.end, m.perms, &offset, m.dev, &m.inode) == 6) {
      out.push_back(m);
    }
  }
  std::fclose(f);
  return out;
}

const Mapping* mapping_at(const std::vector<Mapping>& maps, std::uintptr_t a) {
  for (const auto& m : maps) {
    if (a >= m.start && a < m.end) return &m;
  }
  return nullptr;
}

// Whether [p, p+len) lies inside one shared (MAP_SHARED) mapping of this
// process that is not this device's own pool, under any address. UCX's
// shared-memory keys map by offset without bounds (uct rkey_ptr): a peer
// that exports a range longer than its segment would make us touch memory
// we did not map, and one that re-exports our own slab's key (looked up from
// us) maps our own memory a second time, at another address. The segment
// must also be mapped by the exporting peer's own process (`owner_pid`, from
// its HELLO), so a peer cannot hand on a third process's key as its own.
bool peer_mapping_covers(const char* p, std::size_t len, const PoolImpl* own, std::uint32_t owner_pid) {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  if (len == 0 || lo + len < lo) return false;
  if (own && own->pin(lo, 1)) return false;
  const auto maps = read_mappings();
  const Mapping* m = mapping_at(maps, lo);
  if (!m || m->perms[3] != 's') return false;
  // The range may span several adjacent entries of the same file (the kernel
  // splits a mapping whose pages got different attributes).
  for (const Mapping* cur = m; cur->end - lo < len;) {
    const Mapping* next = mapping_at(maps, cur->end);
    if (!next || next->start != cur->end || next->perms[3] != 's' || next->inode != m->inode ||
        std::strcmp(next->dev, m->dev) != 0) {
      return false;
    }
    cur = next;
  }
  if (own && m->inode != 0) {
    for (std::uintptr_t slab : own->slab_starts()) {
      const Mapping* mine = mapping_at(maps, slab);
      if (mine && mine->inode == m->inode && std::strcmp(mine->dev, m->dev) == 0) return false;
    }
  }
  if (owner_pid != 0 && m->inode != 0) {
    const auto theirs = read_mappings(("/proc/" + std::to_string(owner_pid) + "/maps").c_str());
    if (!theirs.empty()) {  // unreadable (another pid namespace): nothing to compare with
      bool owned = false;
      for (const auto& t : theirs) owned = owned || (t.inode == m->inode && std::strcmp(t.dev, m->dev) == 0);
      if (!owned) return false;
    }
  }
  return true;
}
}  // namespace

RemoteRegionImpl::Access RemoteRegionImpl::access_for(const std::shared_ptr<ucx::Endpoint>& endpoint,
                                                      const PoolImpl* own, std::uint32_t owner_pid, bool verify) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& e : rkeys_) {
    if (e.endpoint == endpoint.get()) return {e.rkey->get(), e.mapped};
  }
  auto rkey = std::make_unique<ucx::Rkey>(endpoint, descriptor.rkey);
  void* mapped = nullptr;
  // GPU memory is never mapped for a CPU copy (UCX's CUDA transports move it).
  if (descriptor.memory_type != MemoryType::kHost || ucp_rkey_ptr(rkey->get(), descriptor.address, &mapped) != UCS_OK) {
    mapped = nullptr;
  }
  if (mapped && verify && !peer_mapping_covers(static_cast<char*>(mapped), descriptor.length, own, owner_pid)) {
    // UCX's own shared-memory put would copy through the same mapping: refuse.
    throw InvalidArgument("the peer's key does not map the whole region it describes (" +
                          std::to_string(descriptor.length) + " bytes): refused before any access");
  }
  rkeys_.push_back({endpoint.get(), std::move(rkey), static_cast<char*>(mapped)});
  return {rkeys_.back().rkey->get(), rkeys_.back().mapped};
}

}  // namespace detail

// ---- public wrappers ----

Block& Block::operator=(Block&& other) noexcept {
  if (this != &other) {
    if (slab_) {
      if (auto pool = slab_->pool.lock()) pool->free(slab_.get(), offset_, size_);
    }
    slab_ = std::move(other.slab_);
    offset_ = other.offset_;
    size_ = other.size_;
    other.size_ = 0;
  }
  return *this;
}

Block::~Block() {
  if (slab_) {
    if (auto pool = slab_->pool.lock()) pool->free(slab_.get(), offset_, size_);
  }
}

void* Block::data() const noexcept { return slab_ ? slab_->base() + offset_ : nullptr; }

LocalRegion Block::region() const {
  if (!slab_) throw InvalidArgument("empty block");
  return LocalRegion{data(), size_, slab_->memh->get(), slab_, &slab_->memh->packed_rkey()};
}

RegionDescriptor Block::descriptor() const {
  if (!slab_) throw InvalidArgument("empty block");
  RegionDescriptor d;
  d.device_id = slab_->device_id;
  d.address = reinterpret_cast<std::uint64_t>(data());
  d.length = size_;
  d.rkey = slab_->memh->packed_rkey();
  d.memory_type = memory_type();
  return d;
}

MemoryType Block::memory_type() const noexcept {
  return slab_ && slab_->gpu >= 0 ? MemoryType::kCuda : MemoryType::kHost;
}
int Block::gpu() const noexcept { return slab_ ? slab_->gpu : -1; }

LocalRegion Registration::region() const {
  if (!impl_) throw InvalidArgument("empty registration");
  return LocalRegion{address_, length_, impl_->memh->get(), impl_, &impl_->memh->packed_rkey()};
}

RegionDescriptor Registration::descriptor() const {
  if (!impl_) throw InvalidArgument("empty registration");
  RegionDescriptor d;
  d.device_id = impl_->device_id;
  d.address = reinterpret_cast<std::uint64_t>(address_);
  d.length = length_;
  d.rkey = impl_->memh->packed_rkey();
  d.memory_type = memory_type();
  return d;
}

MemoryType Registration::memory_type() const noexcept {
  return impl_ && impl_->gpu >= 0 ? MemoryType::kCuda : MemoryType::kHost;
}
int Registration::gpu() const noexcept { return impl_ ? impl_->gpu : -1; }

Block MemoryPool::allocate(std::size_t nbytes, std::size_t alignment) { return impl_->allocate(nbytes, alignment); }
Registration MemoryPool::register_memory(void* ptr, std::size_t nbytes, MemoryType type) {
  return impl_->register_memory(ptr, nbytes, type);
}
PoolStats MemoryPool::stats() const { return impl_->stats(); }

const RegionDescriptor& RemoteRegion::descriptor() const {
  if (!impl_) throw InvalidArgument("empty remote region");
  return impl_->descriptor;
}

CudaInfo cuda_info() {
  CudaInfo info;
  info.available = cuda::available();
  if (!info.available) info.reason = cuda::unavailable_reason();
  info.driver_version = cuda::driver_version();
  for (int i = 0; i < cuda::device_count(); ++i) info.devices.push_back(cuda::device_name(i));
  return info;
}

}  // namespace tensorwire
