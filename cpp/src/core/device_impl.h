// Copyright tensorwire authors.
//
// Internals of Device, Peer and Channel.
//
// Ownership: DeviceImpl owns Peers (by id); a Peer owns its control endpoint
// and knows its channels weakly; a ChannelImpl owns its data endpoint and
// keeps its Peer alive. Endpoints keep workers alive, workers keep contexts
// alive, so Python may drop objects in any order.
//
// Liveness: data endpoints are created without UCX peer error handling
// (shared-memory transports refuse it, and tcp puts run ~3x slower with it):
// UCX may still report a transport error on them (a tcp reset), but nothing
// for shared memory. The control endpoint to the same peer uses peer error
// handling (over tcp, with keepalive). When either reports a failure,
// Peer::fail() fails every pending request and control call on that peer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "control/wire.h"
#include "core/memory_impl.h"
#include "core/messages.h"
#include "core/request_state.h"
#include "core/worker_ctl.h"
#include "tensorwire/device.h"

namespace tensorwire::detail {

class DeviceImpl;
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
  void add_message(RequestState* state);
  void settle_message(RequestState* state, ucs_status_t status);
  // Completes once every message op added so far has (at once if none is in flight).
  Request flush_messages(const std::shared_ptr<WorkerCtl>& worker);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  [[noreturn]] void throw_failure() const;

  const std::weak_ptr<Peer> peer;
  const std::string peer_name;

 private:
  std::atomic<int> refs_{1};
  std::mutex mu_;
  std::unordered_set<RequestState*> pending_;
  std::size_t messages_ = 0;                  // message ops in flight (under mu_)
  std::vector<RequestState*> flush_waiters_;  // complete when messages_ reaches 0
  std::atomic<bool> failed_{false};
  ErrorKind fail_kind_ = ErrorKind::kConnection;
  std::string fail_message_;
};

class ChannelImpl : public std::enable_shared_from_this<ChannelImpl> {
 public:
  ChannelImpl(std::shared_ptr<Peer> peer, int lane, std::shared_ptr<WorkerCtl> worker);
  ~ChannelImpl();
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
  // Fails every pending request with `kind`; later posts throw. Idempotent.
  void fail(ErrorKind kind, const std::string& why) { ops_->fail(kind, why); }
  bool failed() const { return ops_->failed(); }
  void check_usable() const;
  // The local address of remote's first byte when copies to it go direct, else nullptr.
  char* direct_target(const RemoteRegion& remote, const LocalRegion& local) const;
  ChannelStats stats() const;
  // Whether a write from the peer over this channel's transports lands only
  // when this side progresses its worker (tcp and UCX's other emulated RMA);
  // not over shared memory or verbs RC/DC. Waiters on a word the peer writes
  // drive the worker only then. Conservative (true) until UCX can tell.
  bool needs_target_progress() const;
  // The UCX transports of this channel's endpoint, "transport/device"
  // (empty when UCX cannot say).
  std::vector<std::string> lane_transports() const;
  // Whether this lane carries slots and plain write/read as messages
  // (core/messages.h): where its RMA is emulated (needs_target_progress), or
  // as TENSORWIRE_LANE_FORM forces; never on a channel to this very device.
  bool uses_messages() const;
  // Whether a waiter for something the peer sends must drive this lane's
  // worker: emulated RMA, or messages (handled by whoever progresses).
  bool waiter_drives() const { return needs_target_progress() || uses_messages(); }
  // Posts a data message (header `h` with this peer's token, `extra`, and
  // local[offset..+length) as payload); completes when the local bytes may be reused.
  Request send_message(DataHeader h, std::string_view extra, const LocalRegion* local, std::size_t offset,
                       std::size_t length);
  // Unpacks `remote`'s key on this lane now (cached) and checks what it maps:
  // InvalidArgument for a key a peer made up.
  void check_remote(const RemoteRegion& remote) const;
  // remote's key on this lane (unpacked once) and its mapping, checked.
  RemoteRegionImpl::Access access_to(const RemoteRegion& remote) const;

  const std::shared_ptr<Peer> peer;
  const int lane;
  const std::shared_ptr<WorkerCtl> worker;
  std::shared_ptr<ucx::Endpoint> ep;

 private:
  Request finish_post(ucs_status_ptr_t ptr, const char* op, const std::shared_ptr<const void>* local_owner = nullptr,
                      const RemoteRegion* remote = nullptr);

  // The direct path: a memcpy to/from a region mapped by a shared-memory
  // transport, or one of this device's own (a channel to itself).
  Request direct(bool is_write, const LocalRegion& local, std::size_t local_offset, char* mapped,
                 std::size_t remote_offset, std::size_t length);
  bool host_memory(const LocalRegion& local) const;
  // A pool block of this very device (self_): its first byte, pinned; else nullptr.
  char* own_memory(const RemoteRegion& remote) const;
  // write/read in the message form: the target checks and applies it; the
  // request completes on its reply.
  Request message_rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                      std::size_t remote_offset, std::size_t length);

  PendingOps* ops_;  // holds one ref
  const bool map_shared_memory_;
  const std::weak_ptr<PoolImpl> own_pool_;  // the peer is this device: its pool, whose blocks are our memory
  const std::shared_ptr<PoolImpl> pool_;    // this device's pool (a peer's key must not map into it)
  const bool self_;                         // own_pool_ was set (a channel to this very device)
  // fence() orders UCX operations among themselves; a direct copy after a
  // fence must also wait for the UCX operations posted before it.
  std::atomic<bool> ucx_since_fence_{false};
  std::atomic<bool> drain_before_direct_{false};
  mutable std::atomic<int> target_progress_{-1};  // -1 unknown, else the answer
  mutable std::atomic<int> messages_{-1};         // uses_messages(): -1 unknown, else the answer
  std::atomic<std::uint64_t> posted_{0}, direct_writes_{0}, direct_reads_{0}, direct_bytes_{0}, drains_{0};
};

class Peer : public std::enable_shared_from_this<Peer> {
 public:
  Peer(std::weak_ptr<DeviceImpl> device, control::Hello hello, std::shared_ptr<ucx::Endpoint> control_ep,
       bool same_host);
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
  void fail(ErrorKind kind, const std::string& why);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string describe() const;  // "device 0x.. at host:port (pid N)"
  // Liveness: when a control message from this peer last arrived.
  void heard() { last_heard_ns_.store(now_ns(), std::memory_order_relaxed); }
  double silent_s() const { return 1e-9 * double(now_ns() - last_heard_ns_.load(std::memory_order_relaxed)); }

  const std::weak_ptr<DeviceImpl> device;
  const control::Hello hello;
  const std::shared_ptr<ucx::Endpoint> control_ep;
  PeerInfo info;
  // The token this peer puts in its data messages to us: we chose it and
  // sent it in our HELLO (or reply) on its connection. Its HELLO carried the
  // one we put in ours (hello.data_token).
  std::uint64_t inbound_token = 0;

 private:
  mutable std::mutex mu_;
  std::map<int, std::weak_ptr<ChannelImpl>> channels_;
  std::map<std::string, std::weak_ptr<RemoteRegionImpl>> regions_;  // by descriptor bytes
  static constexpr std::size_t kRecentRegions = 16;
  std::deque<std::shared_ptr<RemoteRegionImpl>> recent_;  // the last ones used, kept alive
  std::size_t sweep_at_ = 2 * kRecentRegions;              // regions_ size that triggers a sweep
  // What this peer exported to us: rkey bytes -> [start, end) ranges. Bounded:
  // past kMaxExports ranges the oldest key (or, when all share one key, as
  // over tcp, its oldest range) is forgotten, and descriptors in it refused.
  static constexpr std::size_t kMaxExports = 4096;
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> exports_;
  std::map<std::string, MemoryType> export_types_;  // rkey bytes -> the memory type it was exported with
  std::deque<std::string> export_order_;
  std::size_t export_count_ = 0;
  std::map<std::uint64_t, std::uint64_t> grants_;  // start -> end, our memory this peer may reach by message
  std::deque<std::uint64_t> grant_order_;
  std::shared_ptr<RemoteRegionImpl> region_locked(const RegionDescriptor& d);
  std::atomic<bool> failed_{false};
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::atomic<std::int64_t> last_heard_ns_{now_ns()};
};

class DeviceImpl : public std::enable_shared_from_this<DeviceImpl> {
 public:
  explicit DeviceImpl(const DeviceConfig& config);
  ~DeviceImpl();
  void start();
  void close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  void check_open() const;

  std::shared_ptr<Peer> peer_by_id(std::uint64_t id);
  std::vector<PeerInfo> peers() const;
  PeerInfo wait_for_peer(double timeout_s);
  // `d` as exported to `to`: a peer that reaches our memory through a key
  // (any transport but our shared-memory mapping, which a same-host peer
  // needs for its direct path) gets the key of exactly d's range.
  RegionDescriptor export_for(RegionDescriptor d, Peer& to);
  std::string describe() const;
  unsigned progress();

  // ---- control plane (control/connect.cc, control/plane.cc) ----
  std::shared_ptr<Peer> connect(const std::string& address);
  // Sends a control request to `peer` and waits for the reply body.
  // `release_after_send`: a held lock (the control worker's progress guard)
  // to unlock once the request is sent, before waiting for the reply.
  std::string control_call(const std::shared_ptr<Peer>& peer, control::MsgType type, const std::string& body,
                           double timeout_s,
                           std::unique_lock<std::mutex>* release_after_send = nullptr);
  void publish(const std::string& name, const RegionDescriptor& d);
  void unpublish(const std::string& name);
  void on_call(const std::string& name, CallFn handler);
  // Fails every pending control call sent on `ep`.
  void fail_pending_control(const ucx::Endpoint* ep, ErrorKind kind, const std::string& why);

  // UCX callbacks (control thread).
  void on_connection_request(ucp_conn_request_h request);
  void on_control_error(ucp_ep_h ep, ucs_status_t status);
  void on_message(ucp_ep_h reply_ep, const void* data, std::size_t length);

  DeviceConfig config;
  std::uint64_t id = 0;
  std::string address;
  std::shared_ptr<ucx::Context> data_context;
  std::shared_ptr<ucx::Context> control_context;
  std::vector<std::shared_ptr<WorkerCtl>> workers;
  std::shared_ptr<WorkerCtl> control_worker;
  std::shared_ptr<PoolImpl> pool_impl;
  std::unique_ptr<MemoryPool> pool;
  // The CUDA arena of GPU `gpu` (made on first use; InvalidArgument without CUDA).
  MemoryPool& cuda_pool(int gpu);
  // The pool whose slab holds [address, address+length): its exact exports
  // are revoked when that memory returns (host pool: also registrations).
  PoolImpl& pool_holding(const RegionDescriptor& d);
  std::uint64_t refusal_count() const { return refusals_.load(); }

  // ---- data messages (core/messages.cc) ----
  enum class LaneForm { kAuto, kRma, kMessages };
  std::vector<LaneForm> lane_forms;  // TENSORWIRE_LANE_FORM, per lane (lane % size); empty: auto
  // A write or read in flight in the message form, waiting for its reply.
  struct MessageOp {
    RequestState* state = nullptr;
    PendingOps* ops = nullptr;  // its channel's (kept alive by the pending op)
    const Peer* peer = nullptr;  // only this peer may answer
    void* dest = nullptr;        // a read's destination
    ucp_mem_h memh = nullptr;
    std::size_t length = 0;
  };
  std::uint64_t add_message_op(const MessageOp& op);
  bool take_message_op(std::uint64_t id, const Peer* from, MessageOp* out);
  void drop_message_ops(const Peer* peer, const std::string& why);  // its ops fail
  std::uint64_t add_sink(std::weak_ptr<MessageSink> sink);
  void remove_sink(std::uint64_t id);
  std::shared_ptr<MessageSink> message_sink(std::uint64_t id);
  std::shared_ptr<Peer> peer_by_token(std::uint64_t token);
  // The data workers' AM handler (kDataAmId).
  void on_data_message(int worker_index, const void* header, std::size_t header_length, void* data,
                       std::size_t length, const ucp_am_recv_param_t* param);
  // Logs (rate-limited) and counts a message refused by its target.
  void refuse_message(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  std::uint64_t message_refusals() const { return message_refusals_.load(); }

 private:
  // ---- control plane ----
  // The control worker's AM handler and the listener; sets `address` (start()).
  void listen();
  void send(const std::shared_ptr<ucx::Endpoint>& ep, const control::Header& h, const std::string& body);
  void reply(ucp_ep_h ep, const control::Header& request, control::MsgType type, control::Status status,
             const std::string& body);
  std::shared_ptr<ucx::Endpoint> endpoint_for(ucp_ep_h ep);
  void handle_hello(ucp_ep_h ep, const control::Header& h, detail::ByteReader& r);
  void dispatch(ucp_ep_h ep, const control::Header& h, detail::ByteReader& r);
  void dispatcher_loop();
  // Pings peers gone quiet; fails those silent for config.liveness_s.
  void liveness_loop();
  std::shared_ptr<Peer> peer_on(ucp_ep_h ep);
  // Why a HELLO claiming `claimed` on `ep` must be refused ("" when it may stand).
  std::string identity_conflict(const control::Hello& claimed);
  // An outgoing connection waiting for its HELLO reply.
  struct Connecting {
    std::string address;
    std::shared_ptr<ucx::Endpoint> ep;
    std::shared_ptr<Peer> peer;  // set when the reply registered it
    std::string refused;         // or why not
    std::uint64_t token = 0;     // the data token our HELLO gave the peer
  };
  // Registers the peer of a HELLO reply (control thread, mu_ held).
  void register_connected(ucp_ep_h handle, Connecting& c, const std::string& body);
  std::map<ucp_ep_h, Connecting> connecting_;
  control::Hello my_hello() const;

  void register_token(std::uint64_t token, const std::shared_ptr<Peer>& peer);
  std::mutex msg_mu_;
  std::unordered_map<std::uint64_t, MessageOp> message_ops_;
  std::uint64_t next_op_id_ = 1;
  std::unordered_map<std::uint64_t, std::weak_ptr<MessageSink>> sinks_;
  std::uint64_t next_sink_id_ = 1;
  std::unordered_map<std::uint64_t, std::weak_ptr<Peer>> by_token_;
  std::atomic<std::uint64_t> message_refusals_{0};
  std::vector<std::shared_ptr<const void>> data_args_;

  ucp_listener_h listener_ = nullptr;
  void* control_arg_ = nullptr;  // owned by the control worker
  std::atomic<std::uint64_t> refusals_{0};
  std::mutex cuda_pools_mu_;
  std::map<int, std::pair<std::shared_ptr<PoolImpl>, std::unique_ptr<MemoryPool>>> cuda_pools_;
  std::atomic<bool> closed_{false};
  mutable std::mutex mu_;
  std::condition_variable peer_cv_;
  std::mutex connect_mu_;
  std::map<std::string, RegionDescriptor> published_;
  std::map<std::string, CallFn> handlers_;
  std::map<std::uint64_t, std::shared_ptr<Peer>> peers_;            // by device id
  std::deque<std::uint64_t> new_peers_;                               // for wait_for_peer
  std::map<ucp_ep_h, std::shared_ptr<ucx::Endpoint>> endpoints_;     // every control endpoint
  std::map<ucp_ep_h, std::shared_ptr<Peer>> peers_by_ep_;
  struct PendingCall {
    RequestState* state;
    const ucx::Endpoint* ep;
  };
  std::map<std::uint64_t, PendingCall> pending_;
  std::uint64_t next_request_id_ = 1;
  std::thread dispatcher_;
  std::thread liveness_;
  std::condition_variable liveness_cv_;
  std::string self_proof_;  // see control::Hello::self_proof
  bool exact_export_ = false;  // export_for gives exact keys (hardware keys, or TENSORWIRE_EXACT_EXPORT=1)
  std::deque<std::function<void()>> jobs_;
  std::condition_variable jobs_cv_;
  bool stop_dispatcher_ = false;
  std::string boot_id_;
  std::uint64_t start_time_ = 0;
  std::string hostname_;
};

}  // namespace tensorwire::detail
