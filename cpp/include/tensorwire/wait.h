// Copyright tensorwire authors.
//
// Waiting on several things at once: the next tensor of any of several
// slots, the completion of any of several requests, a flag word a peer
// writes, or a mix; channels in the list fail the wait when their peer fails.
//
//   std::vector<Awaitable> items{slot_a, slot_b, request};
//   std::size_t i = wait_any(items, 5.0);  // then slot_a.recv() etc. returns at once
//
// The wait drives the workers the items need, with the same spin, yield and
// nap policy as every wait in tensorwire (core/waiter.h), asks the peers
// that ring a napping waiter (a slot's sender, a dynamic send's receiver over
// shared memory) to ring it as their own waits would, and fails as soon as
// the peer a slot waits on fails.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "tensorwire/channel.h"
#include "tensorwire/memory.h"
#include "tensorwire/request.h"
#include "tensorwire/slot.h"

namespace tensorwire {

namespace detail {
class WaitSource;
}

class Awaitable {
 public:
  // Ready once the slot's next tensor is there (recv() then returns at once;
  // also when recv() would refuse because `depth` tensors are held).
  Awaitable(const StaticSlot& slot);   // NOLINT: implicit, for brace lists
  Awaitable(const DynamicSlot& slot);  // NOLINT
  // Ready once the request completed, successfully or not (wait() then
  // returns or throws at once). The request must outlive the wait.
  Awaitable(const Request& request);  // NOLINT
  // Never ready: a liveness watch. The wait fails (PeerFailed naming the
  // peer) as soon as this channel's peer fails.
  Awaitable(const Channel& channel);  // NOLINT
  // Ready once the aligned 8-byte word at local[offset] equals `value` (a
  // flag a peer writes one-sidedly). `channel`: the channel the peer writes
  // over; its worker is driven while waiting where the writes need this side
  // to progress (tcp), and its failure fails the wait.
  static Awaitable word(const LocalRegion& local, std::size_t offset, std::uint64_t value,
                        const Channel* channel = nullptr);

 private:
  explicit Awaitable(std::shared_ptr<detail::WaitSource> source) : source_(std::move(source)) {}
  friend std::size_t wait_any(const std::vector<Awaitable>& items, double timeout_s);
  std::shared_ptr<detail::WaitSource> source_;
};

// Waits until one of `items` is ready and returns its index (the lowest when
// several are). Throws the failure of a slot whose sender's channel failed
// (PeerFailed naming the peer, or ConnectionError), Timeout at the deadline
// (timeout_s < 0: none), InvalidArgument for an empty list.
std::size_t wait_any(const std::vector<Awaitable>& items, double timeout_s = -1.0);

}  // namespace tensorwire
