// Copyright tensorwire authors.
//
// Channel: one endpoint to a peer device on one lane (the paper's queue pair).
// Lanes to a peer are spread round-robin over the local workers (the paper's
// completion queues) and over the peer's workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire/memory.h"
#include "tensorwire/region.h"
#include "tensorwire/request.h"

namespace tensorwire {

namespace detail {
class ChannelImpl;
}

struct PeerInfo {
  std::uint64_t device_id = 0;
  std::string address;  // the peer's listening address, "host:port"
  std::string hostname;
  std::uint32_t pid = 0;
  bool same_host = false;
  int workers = 0;
};

// What the operations of one channel did: which path each took.
struct ChannelStats {
  std::uint64_t posted = 0;         // write/read posted to UCX
  std::uint64_t direct_writes = 0;  // writes done as a memcpy into a mapped region
  std::uint64_t direct_reads = 0;   // reads done as a memcpy from a mapped region
  std::uint64_t direct_bytes = 0;
  std::uint64_t drains = 0;  // direct copies that first waited for earlier UCX operations
};

// How a channel moves data: one-sided RMA (or a copy where this process maps
// the peer's memory), or messages the target places (tcp and other
// transports without one-sided RMA; contracts §12).
enum class ChannelForm { kRma, kMessages };

// One transfer of a batch (Channel::write_batch / read_batch).
struct Transfer {
  LocalRegion local;
  std::size_t local_offset = 0;
  RemoteRegion remote;
  std::size_t remote_offset = 0;
  std::size_t length = 0;
};

class Channel {
 public:
  Channel() = default;
  explicit Channel(std::shared_ptr<detail::ChannelImpl> impl) : impl_(std::move(impl)) {}

  // One-sided write of `length` bytes from local[local_offset..] into
  // remote[remote_offset..]. Both ranges are checked before anything is
  // posted (InvalidArgument otherwise).
  // Completion: the local bytes may be reused once the Request completes.
  // Remote visibility: only after a later flush() completes (or a value the
  // receiver polls, written after a fence()).
  Request write(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                std::size_t remote_offset, std::size_t length);
  // One-sided read into local[local_offset..]; the data is there once the
  // Request completes.
  Request read(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
               std::size_t remote_offset, std::size_t length);
  // A batch of writes (reads) posted in one call: every transfer is checked
  // before any is posted (InvalidArgument naming the first bad one); the one
  // Request completes when all did, with the first error of any.
  Request write_batch(const std::vector<Transfer>& transfers);
  Request read_batch(const std::vector<Transfer>& transfers);
  // Orders: every operation posted on this channel's worker before the fence
  // is performed at the target before any operation posted after it.
  // Direct copies (see maps()) are included.
  void fence();
  // Completes when every operation posted earlier on this channel is complete
  // and visible at the peer.
  Request flush();
  // A write that lands after every write posted earlier on this channel (a
  // slot's flag after its payload). Like fence() + write(), but never blocks:
  // where UCX orders writes only by a "strong" fence (tcp: a flush the caller
  // spins out), the write is posted once a flush of what came before
  // completes, and the Request completes with the write (with a progress
  // thread; inline-mode devices fence, as they have no other driver).
  Request write_ordered(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                        std::size_t remote_offset, std::size_t length);

  // Data, then flag (the paper's static placement): writes local[local_offset,
  // +length) into remote[remote_offset..], then the 8-byte word at
  // local[flag_local_offset] into remote[flag_remote_offset] (aligned), which
  // lands after every byte of the data: a peer that polls the word and sees
  // it may read the data. One message where the target places writes (tcp),
  // else write + fence + write. Completes when both writes did; with
  // landed = false, on a tcp lane, once the local bytes left (the target does
  // not answer: its flag is the only news that they landed, and a refusal is
  // the target's alone to log), for records whose reader acknowledges them.
  Request write_flagged(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                        std::size_t remote_offset, std::size_t length, std::size_t flag_local_offset,
                        std::size_t flag_remote_offset, bool landed = true);

  // Asks the peer for the region it published under `name` (NotFound if none).
  RemoteRegion lookup(const std::string& name, double timeout_s = 10.0);
  // A region of the peer described by `descriptor` (e.g. sent in a call). It
  // must lie inside a region the peer exported to this device (a lookup, a
  // slot, or export_region() on the peer's side): InvalidArgument otherwise.
  RemoteRegion remote_region(const RegionDescriptor& descriptor);
  // Exports `local` to the peer (one control call): descriptors of ranges
  // inside it that this side hands over later are accepted there. Returns
  // the descriptor exported: hand over ranges with its key, which may be a
  // registration of exactly `local` rather than the key of `local.memh`.
  RegionDescriptor export_region(const LocalRegion& local, double timeout_s = 10.0);
  // Small request/response call to a handler the peer registered by `name`.
  std::string call(const std::string& name, const std::string& payload, double timeout_s = 10.0);

  // Whether write/read to `remote` are a memcpy in the calling thread: a
  // same-host peer's region that a shared-memory transport maps
  // (DeviceConfig::map_shared_memory). Such operations complete on return.
  bool maps(const RemoteRegion& remote, const LocalRegion& local) const;
  // A write into a region that maps() with streaming stores, whatever its
  // size (InvalidArgument when not mapped): for a destination the peer's
  // core keeps re-reading, whose read-for-ownership halves a plain copy's rate.
  Request write_streaming(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                          std::size_t remote_offset, std::size_t length);
  ChannelStats stats() const;
  // The UCX transports and devices this channel's endpoint uses
  // ("posix/memory", "rc_mlx5/mlx5_0:1"), from UCX's endpoint query.
  std::vector<std::string> transports() const;
  ChannelForm form() const;

  int lane() const;
  PeerInfo peer() const;
  // The description of the transport UCX chose for this endpoint.
  std::string transport_info() const;
  // Drives the progress of this channel's worker once (inline mode, benches).
  unsigned progress();
  detail::ChannelImpl* impl() const noexcept { return impl_.get(); }

 private:
  std::shared_ptr<detail::ChannelImpl> impl_;
};

}  // namespace tensorwire
