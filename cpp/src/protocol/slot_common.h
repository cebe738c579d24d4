// Copyright tensorwire authors.
//
// Shared pieces of the slot protocols: waiting on a word in local memory
// while driving progress, and the dtype table.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "core/device_impl.h"
#include "tensorwire/slot.h"

namespace tensorwire::detail {

inline std::uint64_t load_acquire(const void* p) {
  return std::atomic_ref<const std::uint64_t>(*static_cast<const std::uint64_t*>(p)).load(std::memory_order_acquire);
}

inline void store_release(void* p, std::uint64_t v) {
  std::atomic_ref<std::uint64_t>(*static_cast<std::uint64_t*>(p)).store(v, std::memory_order_release);
}

// Spins on `ready()` while progressing `channel`'s worker (tcp targets must
// progress for writes to land); after `spin_us` of nothing, sleeps briefly
// between checks. Returns false at the deadline (timeout_s < 0: never), or
// as soon as `channel` failed.
template <typename Ready>
bool wait_until(ChannelImpl* channel, WorkerCtl* worker, Ready ready, double timeout_s) {
  using clock = std::chrono::steady_clock;
  if (ready()) return true;
  const auto start = clock::now();
  const bool forever = timeout_s < 0;
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(
                                    forever ? 0.0 : timeout_s));
  WorkerCtl* w = channel ? channel->worker.get() : worker;
  const auto spin = std::chrono::microseconds(w && w->spin_us() ? w->spin_us() : 50);
  auto last = start;
  unsigned rounds = 0;
  while (!ready()) {
    if (w && w->progress() > 0) last = clock::now();
    if ((++rounds & 63) != 0) continue;
    // A dead peer never writes the word: stop at once (callers then raise the
    // channel's failure) rather than at the deadline, or never.
    if (channel && channel->failed()) return ready();
    auto now = clock::now();
    if (!forever && now > deadline) return ready();
    if (now - last > spin) {
      // Not the worker's event fd: a one-sided write over shared memory
      // raises no event on the target, so such a sleep would only end at its
      // timeout. A short sleep bounds the added latency of an idle wait.
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return true;
}

inline std::size_t align64(std::size_t v) { return (v + 63) & ~std::size_t(63); }

}  // namespace tensorwire::detail
