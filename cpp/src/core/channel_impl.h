// Copyright tensorwire authors.
//
// Internals of Channel and of the peer it goes to: what the protocols talk
// through (their view of the device itself is core/device_port.h).
//
// Ownership: a Peer owns its control connection (a net::Conn, tensorwire's
// own socket: net/socket.h) and its channels (until it fails) and knows its
// device weakly; a ChannelImpl owns its lane (core/lane.h: a UCX data
// endpoint, or for a tcp lane a net::Conn, its own or the one the peer
// dialled) and keeps its Peer alive. Endpoints keep workers alive, workers
// keep contexts alive, so Python may drop objects in any order.
//
// A channel moves data in one of two forms, as its lane's properties say:
// one-sided (the lane's RMA, or a copy where this process maps the peer's
// memory) or messages the target serves (Lane::rma_is_messages). Which
// transport it is decides nothing here.
//
// Liveness: UCX data endpoints are created without UCX peer error handling
// (shared-memory transports refuse it, and tcp puts run ~3x slower with it):
// UCX may still report a transport error on them, but nothing for shared
// memory. The control connection to the same peer has TCP keepalive, its
// close fails the peer (DeviceImpl::on_control_closed), and a peer that
// answers no PING for liveness_s is failed by the device's liveness thread.
// When any of these reports a failure, Peer::fail() fails every pending
// request and control call on that peer.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/control_wire.h"
#include "core/lane.h"
#include "core/memory_impl.h"
#include "core/messages.h"
#include "core/request_state.h"
#include "core/worker_ctl.h"
#include "net/socket.h"
#include "tensorwire/channel.h"

namespace tensorwire::detail {

class DeviceImpl;  // core/device_impl.h: a Peer knows its device only weakly
class Peer;

// A random nonzero 64-bit id (device ids, data tokens).
std::uint64_t random_id();
bool is_loopback(const std::string& host);  // localhost or 127.x

// A call handler as the device runs it: `caller` is the peer that said HELLO
// on the connection the call came on (identity from the connection, never
// from the payload).
using CallFn = std::function<std::string(const std::shared_ptr<Peer>& caller, const std::string& payload)>;

// The part of a channel that UCX callbacks touch. Reference counted by hand:
// the channel holds one ref and every operation UCX still owns holds one, so
// a completion UCX delivers after the channel is gone (operations of a
// force-closed endpoint may be purged as late as the worker's destruction)
// still finds it.
class PendingOps {
 public:
  PendingOps(std::weak_ptr<Peer> peer, std::string peer_name)
      : peer(std::move(peer)), peer_name(std::move(peer_name)) {}
  void retain() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void release() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
  // Tracks `state` (takes its UCX ref); completes it at once if failed.
  void add(RequestState* state);
  // Completes `state` with `status`, drops the UCX ref and this op's ref on us.
  void settle(RequestState* state, ucs_status_t status);
  // Fails every pending request with `kind`; later adds fail too. Idempotent.
  void fail(ErrorKind kind, const std::string& why);
  // Message-form writes and reads (ChannelImpl::message_rma): tracked like
  // any operation, and counted so that flush_messages() can wait for them.
  // `ordered`: the target applies it before any message sent after it (an
  // eager write); the others (rendezvous payloads, reads) are counted apart.
  void add_message(RequestState* state, bool ordered = false);
  void settle_message(RequestState* state, ucs_status_t status);
  // Completes once every message op added so far has (at once if none is in flight).
  Request flush_messages(const std::shared_ptr<WorkerCtl>& worker);
  // Whether a message op that is not ordered is in flight (a fence must wait for it).
  bool unordered_in_flight();
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  [[noreturn]] void throw_failure() const;

  const std::weak_ptr<Peer> peer;
  const std::string peer_name;

 private:
  std::atomic<int> refs_{1};
  std::mutex mu_;
  std::unordered_set<RequestState*> pending_;
  std::size_t messages_ = 0;                     // message ops in flight (under mu_)
  std::unordered_set<RequestState*> unordered_;  // those of them not ordered (under mu_)
  std::vector<RequestState*> flush_waiters_;     // complete when messages_ reaches 0
  std::atomic<bool> failed_{false};
  ErrorKind fail_kind_ = ErrorKind::kConnection;
  std::string fail_message_;
};

class ChannelImpl : public std::enable_shared_from_this<ChannelImpl> {
 public:
  ChannelImpl(std::shared_ptr<Peer> peer, int lane_index, std::shared_ptr<WorkerCtl> worker);
  ~ChannelImpl();
  // Makes the lane: a UCX endpoint to the peer's worker at
  // `remote_worker_address`, or (transport tcp, or auto where UCX reaches
  // no transport of the peer) a socket.
  void connect(const std::string& remote_worker_address);

  // Checks one transfer (InvalidArgument naming `op`); true when it moves bytes.
  bool check_rma(const char* op, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                 std::size_t remote_offset, std::size_t length) const;
  Request batch(bool is_write, const std::vector<Transfer>& transfers);
  Request rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
              std::size_t remote_offset, std::size_t length);
  Request flush();
  void fence();
  Request write_ordered(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                        std::size_t remote_offset, std::size_t length);
  Request write_flagged(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                        std::size_t remote_offset, std::size_t length, std::size_t flag_local_offset,
                        std::size_t flag_remote_offset, bool landed = true);
  // One request over `requests` (this channel's): complete when all are, failed with the first
  // failure in order; an already complete or failed one needs no tracking.
  Request join(std::vector<Request> requests);
  // Fails every pending request with `kind`; later posts throw. Idempotent.
  void fail(ErrorKind kind, const std::string& why) { ops_->fail(kind, why); }
  bool failed() const { return ops_->failed(); }
  void check_usable() const;
  // The local address of remote's first byte when copies to it go direct, else nullptr.
  char* direct_target(const RemoteRegion& remote, const LocalRegion& local) const;
  // The local address of remote's first byte where this process maps it
  // (shared memory, host memory), whatever this lane's form; else nullptr.
  char* mapping_of(const RemoteRegion& remote) const;
  // A write into a mapped peer region with streaming stores, whatever its size (InvalidArgument
  // when not mapped): the peer's core holds the destination's lines, whose read-for-ownership
  // halved a plain copy's rate (an all_reduce's landing area, re-read by the peer every round).
  Request write_streaming(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                          std::size_t remote_offset, std::size_t length);
  // The direct path: a memcpy to/from a region mapped by a shared-memory
  // transport, or one of this device's own (a channel to itself); `mapped`
  // from direct_target, the range checked by the caller (check_rma).
  Request direct(bool is_write, const LocalRegion& local, std::size_t local_offset, char* mapped,
                 std::size_t remote_offset, std::size_t length, bool streaming = false);
  ChannelStats stats() const;
  // The transport under this channel and what it can do (core/lane.h).
  Lane& lane() const { return *lane_; }
  // Posts a data message (header `h` with this peer's token, `extra`, and
  // local[offset..+length) as payload); completes when the local bytes may be reused.
  Request send_message(DataHeader h, std::string_view extra, const LocalRegion* local, std::size_t offset,
                       std::size_t length);
  // A header-only message that need not leave now (a slot's release): it
  // rides in the next message sent on this lane (Lane::ride), or goes at the
  // worker's next flush point if none is sent first. False where the lane
  // cannot or is no longer usable: then send it the usual way.
  bool ride_message(const void* key, DataHeader h);
  // Whether a payload from `local` to `remote` can go placed
  // (put_then_message): a message-form lane with one-sided puts, host memory on both sides.
  bool can_place(const LocalRegion& local, const RemoteRegion& remote) const;
  // A slot's placed send on a message-form lane (contracts §12): UCX puts
  // local[offset..+length) at remote[remote_offset..] (memory the peer
  // exported to this sender for it), and once a flush of the endpoint says
  // it landed, the message `h` (with `extra`, no payload) announces it.
  // Completes when that message is posted and sent.
  Request put_then_message(const LocalRegion& local, std::size_t offset, const RemoteRegion& remote,
                           std::size_t remote_offset, std::size_t length, DataHeader h, std::string extra = {});
  // Unpacks `remote`'s key on this lane now (cached) and checks what it maps:
  // InvalidArgument for a key a peer made up.
  void check_remote(const RemoteRegion& remote) const;

  const std::shared_ptr<Peer> peer;
  const int lane_index;  // Channel::lane()
  const std::shared_ptr<WorkerCtl> worker;

 private:
  // direct_target and mapping_of: remote's first byte where this process maps it;
  // `rma_form_only`: nullptr on a lane that carries writes and reads as messages.
  char* mapped(const RemoteRegion& remote, bool rma_form_only) const;
  // The lane's one-sided put or get, or the direct copy where the region is
  // mapped, whatever the lane's form; `rma` after its checks.
  Request one_sided(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                    std::size_t remote_offset, std::size_t length);
  Request flush_one_sided();  // every one-sided operation (and direct copy) before it has completed
  // Posts next(*this) once `before` completed (write_ordered's write after
  // its flush, a placed send's header after its put): the Request completes
  // with what `next` posted, or fails with the first error. The owners stay
  // alive until the chain ends.
  Request post_after(Request before, std::function<Request(ChannelImpl&)> next,
                     std::shared_ptr<const void> local_owner = {}, std::shared_ptr<const void> remote_owner = {});
  // A tcp lane's socket: the one the peer dialled for this lane, else one
  // dialled to its listener and introduced (LaneIntro).
  std::unique_ptr<Lane> connect_socket(DeviceImpl& dev);
  // send_message without its after-post duties (deferred releases): also from a UCX callback.
  Request post_data_message(DataHeader h, std::string_view extra, const LocalRegion* local, std::size_t offset,
                            std::size_t length);

  bool host_memory(const LocalRegion& local) const;
  // write/read in the message form: the target checks and applies it; the
  // request completes on its reply. A write with `flag_at` (a remote
  // address) also sets the word there to `flag` after its payload landed.
  Request message_rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                      std::size_t remote_offset, std::size_t length, std::uint64_t flag_at = 0, std::uint64_t flag = 0);

  PendingOps* ops_;             // holds one ref
  std::unique_ptr<Lane> lane_;  // set by connect()
  const bool map_shared_memory_;
  // fence() orders one-sided operations among themselves; a direct copy
  // after a fence must also wait for the ones posted before it.
  std::atomic<bool> rma_since_fence_{false};
  std::atomic<bool> drain_before_direct_{false};
  std::atomic<std::uint64_t> posted_{0}, direct_writes_{0}, direct_reads_{0}, direct_bytes_{0}, drains_{0};
};

class Peer : public std::enable_shared_from_this<Peer> {
 public:
  Peer(std::weak_ptr<DeviceImpl> device, control::Hello hello, std::shared_ptr<net::Conn> control_conn, bool same_host);
  std::shared_ptr<ChannelImpl> channel(int lane);
  // A region this peer exported to us through the control plane (a LOOKUP
  // reply, a slot's attach call or reply, an export call): remembered, so
  // that descriptors it hands us later can be checked against it.
  std::shared_ptr<RemoteRegionImpl> accept_export(const RegionDescriptor& d);
  // A region inside one this peer exported to us (same key, range inside);
  // InvalidArgument otherwise: no descriptor reaches memory it did not export.
  std::shared_ptr<RemoteRegionImpl> remote_region(const RegionDescriptor& d);
  bool exported(const RegionDescriptor& d) const;
  // The other direction: ranges of our memory exported to this peer
  // (DeviceImpl::export_for). A message-form write or read from this peer
  // must fall inside one (contracts §11). Bounded like the export table.
  void grant(std::uint64_t address, std::uint64_t length);
  bool granted(std::uint64_t address, std::uint64_t length) const;
  // Ends the grants of ranges that start in [start, end): that memory went
  // back to its pool, or to a user as a received tensor (contracts §11).
  void revoke(std::uint64_t start, std::uint64_t end);
  // Set once the device lists this peer among those it granted anything
  // (DeviceImpl::revoke_grants walks that list).
  std::atomic<bool> listed_as_grantee{false};
  // Fails its channels and message operations, and (`calls_too`) the control
  // calls waiting for its replies. A data lane's end passes false: the peer's
  // replies sent before it closed are still on their way over the control
  // connection, whose own end (or liveness, or the call's timeout) fails the rest.
  void fail(ErrorKind kind, const std::string& why, bool calls_too = true);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string describe() const;  // "device 0x.. at host:port (pid N)"
  // Liveness: when a control message from this peer last arrived.
  void heard() { last_heard_ns_.store(now_ns(), std::memory_order_relaxed); }
  double silent_s() const { return 1e-9 * double(now_ns() - last_heard_ns_.load(std::memory_order_relaxed)); }

  const std::weak_ptr<DeviceImpl> device;
  const control::Hello hello;
  const std::shared_ptr<net::Conn> control_conn;
  PeerInfo info;
  // The token this peer puts in its data messages to us: we chose it and
  // sent it in our HELLO (or reply) on its connection. Its HELLO carried the
  // one we put in ours (hello.data_token).
  std::uint64_t inbound_token = 0;
  // tcp lanes this peer dialled to us. Our channel on such a lane sends on that
  // socket instead of dialling its own: one connection both ways, as UCX's tcp
  // matches connections, so that acks ride on data (a round trip is two
  // segments, not three or four). `worker`: the poller the socket is in.
  void add_inbound_lane(std::uint32_t lane, int worker, const std::shared_ptr<net::Conn>& conn);
  std::shared_ptr<net::Conn> inbound_lane(int lane, int worker) const;  // null: none open there
  // Whether this peer dialled our control connection (we accepted it). Lanes
  // on a connection are dialled by its dialer only: a channel of ours made
  // before the dialer's lane arrived would otherwise dial a second socket,
  // and each direction would then carry its data on one socket and the other
  // direction's acks on its own (3-4 segments a round trip, not 2).
  bool accepted = false;
  // An accepted peer's lane: asks the dialer for it (control::kLaneCall)
  // unless it is open already, and waits for it up to timeout_s. Null when it
  // did not come (the caller dials its own).
  std::shared_ptr<net::Conn> lane_from_dialer(int lane, int worker, double timeout_s);

 private:
  mutable std::mutex mu_;
  std::condition_variable lane_cv_;  // an inbound lane arrived (under mu_)
  std::mutex lane_mu_;               // held while a lane's channel is made (channel()); never inside mu_
  // A lane's channel lives as long as the peer: held here (the cycle with
  // ChannelImpl::peer ends in fail(), which closing the device runs), so a
  // slot made after the last one on a lane went finds its endpoint instead
  // of wiring up a new one (over tcp a new connection each time, which
  // slowed later transfers; UCX left the old ones open).
  std::map<int, std::shared_ptr<ChannelImpl>> channels_;
  // lane -> (worker, socket); bounded like the lanes a peer may dial (kMaxInboundLanes)
  static constexpr std::size_t kMaxInboundLanes = 1024;
  std::map<std::uint32_t, std::pair<int, std::weak_ptr<net::Conn>>> inbound_lanes_;
  std::map<std::string, std::weak_ptr<RemoteRegionImpl>> regions_;  // by descriptor bytes
  static constexpr std::size_t kRecentRegions = 16;
  std::deque<std::shared_ptr<RemoteRegionImpl>> recent_;  // the last ones used, kept alive
  std::size_t sweep_at_ = 2 * kRecentRegions;             // regions_ size that triggers a sweep
  // What this peer exported to us: rkey bytes -> [start, end) ranges. Bounded:
  // past kMaxExports ranges the oldest key (or, when all share one key, as
  // over tcp, its oldest range) is forgotten, and descriptors in it refused.
  static constexpr std::size_t kMaxExports = 4096;
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> exports_;
  std::map<std::string, MemoryType> export_types_;  // rkey bytes -> the memory type it was exported with
  std::deque<std::string> export_order_;
  std::size_t export_count_ = 0;
  struct Grant {
    std::uint64_t end;
    std::list<std::uint64_t>::iterator order;  // its start's place in grant_order_
  };
  std::map<std::uint64_t, Grant> grants_;  // start -> grant: our memory this peer may reach by message
  std::list<std::uint64_t> grant_order_;   // the starts, oldest first (revoke() takes one out in O(1))
  std::shared_ptr<RemoteRegionImpl> region_locked(const RegionDescriptor& d);
  std::shared_ptr<net::Conn> inbound_lane_locked(int lane, int worker) const;  // mu_ held
  std::atomic<bool> failed_{false};
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::atomic<std::int64_t> last_heard_ns_{now_ns()};
};

}  // namespace tensorwire::detail
