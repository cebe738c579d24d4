// Copyright tensorwire authors.
//
// Internals of Device: DeviceImpl owns its Peers (by id), the workers, the
// pools and the control plane. Channels and peers are core/channel_impl.h,
// included here since DeviceImpl speaks of them; the protocols see a device
// only through core/device_port.h.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/bytes.h"
#include "core/channel_impl.h"
#include "core/control_wire.h"
#include "core/memory_impl.h"
#include "core/messages.h"
#include "core/request_state.h"
#include "core/worker_ctl.h"
#include "net/socket.h"
#include "tensorwire/device.h"

namespace tensorwire::detail {

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
  // Ends every peer's grants of ranges starting in [start, end); this
  // device's pools call it before a block or registration's memory returns.
  void revoke_grants(std::uint64_t start, std::uint64_t end);
  std::string describe() const;
  // What this device's lanes can use: UCX's resources and (transports tcp and auto) "tcp/socket".
  std::vector<std::string> resources() const;
  unsigned progress();

  // ---- control plane (core/connect.cc, core/control_plane.cc) ----
  std::shared_ptr<Peer> connect(const std::string& address);
  // Sends a control request to `peer` and waits for the reply body.
  std::string control_call(const std::shared_ptr<Peer>& peer, control::MsgType type, const std::string& body,
                           double timeout_s);
  void publish(const std::string& name, const RegionDescriptor& d);
  void unpublish(const std::string& name);
  void on_call(const std::string& name, CallFn handler);
  // Fails every pending control call sent on `conn`.
  void fail_pending_control(const net::Conn* conn, ErrorKind kind, const std::string& why);

  // The control thread's handlers (net::Poller).
  void on_accept(int fd);
  void on_control_closed(const std::shared_ptr<net::Conn>& conn, const std::string& why);
  void on_message(const std::shared_ptr<net::Conn>& conn, const void* data, std::size_t length);

  DeviceConfig config;
  std::uint64_t id = 0;
  std::string address;
  std::shared_ptr<ucx::Context> data_context;
  std::vector<std::shared_ptr<WorkerCtl>> workers;
  std::shared_ptr<PoolImpl> pool_impl;
  std::unique_ptr<MemoryPool> pool;
  // The CUDA arena of GPU `gpu` (made on first use; InvalidArgument without CUDA).
  MemoryPool& cuda_pool(int gpu);
  // The pool whose slab holds [address, address+length): its exact exports
  // are revoked when that memory returns (host pool: also registrations).
  PoolImpl& pool_holding(const RegionDescriptor& d);
  std::uint64_t refusal_count() const { return refusals_.load(); }
  std::vector<std::uint64_t> pending_call_ids() const {  // tests
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::uint64_t> ids;
    for (const auto& [rid, call] : pending_) ids.push_back(rid);
    return ids;
  }

  // ---- data messages (core/messages.cc) ----
  std::vector<LaneForm> lane_forms;  // TENSORWIRE_LANE_FORM, per lane (lane % size); empty: auto
  // Which tensors this device's slots ask their senders to place on a
  // message-form UCX lane (UD, or forced; a tcp lane is a socket and places
  // nothing) (put, flush, header message; contracts §10.3, §10.4, §12):
  // [from, to], empty when from > to. Placing lets a sender stream tensor k+1
  // while the receiver's thread consumes tensor k, which matters only where no
  // progress thread answers a rendezvous meanwhile: by default inline
  // progress, 256 KiB-64 MiB, or 256 KiB-4 MiB where the kernel's tcp
  // congestion control is bbr (measured when tcp lanes were UCX's: there
  // bursts beyond what the socket buffers hold (4 MiB) lost segments while the
  // receiver was away; bench/results/tcp_placed.txt §6-7).
  // TENSORWIRE_PLACE=LO-HI (bytes) or off sets it for every progress mode.
  std::pair<std::uint64_t, std::uint64_t> place_window() const;
  std::uint64_t place_from = std::uint64_t(256) << 10, place_to = std::uint64_t(4) << 20;
  bool place_set = false;  // TENSORWIRE_PLACE was given
  // A write or read in flight in the message form, waiting for its reply.
  struct MessageOp {
    RequestState* state = nullptr;
    PendingOps* ops = nullptr;   // its channel's (kept alive by the pending op)
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
  // A data message, from a data worker's AM handler (kDataAmId) or a tcp
  // lane's socket (`bound`: the peer that lane belongs to; a message must
  // carry that peer's token).
  void on_data_message(int worker_index, const void* header, std::size_t header_length, Incoming& payload,
                       const ReplyPath& reply, const Peer* bound);
  // tcp lanes (core/messages.cc): the acceptor's side of a lane's first
  // frame (false when the frame is not a lane introduction), and the
  // handlers of a lane's socket, served by worker `worker_index` for `peer`.
  bool accept_lane(const std::shared_ptr<net::Conn>& conn, const char* header, std::size_t length);
  std::pair<net::FrameHandler, net::CloseHandler> lane_handlers(int worker_index, const std::shared_ptr<Peer>& peer);
  // Whether every lane (but a channel to this very device) is a tcp socket:
  // transport tcp. Under auto, ChannelImpl::connect makes one for a peer UCX
  // cannot reach.
  bool socket_lanes() const { return config.transport == "tcp"; }
  std::string lane_interface;  // tcp lanes bind to it (net_devices, transport tcp); empty: routing decides
  // Logs (rate-limited) and counts a message refused by its target.
  void refuse_message(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  void refuse_message_v(const char* fmt, va_list ap) __attribute__((format(printf, 2, 0)));
  std::uint64_t message_refusals() const { return message_refusals_.load(); }

  // ---- no data op outlives its grant (contracts §11) ----
  // Shared: a message-form put's or get's grant check and what it does with
  // the memory at once (an eager put's copy, a get reply's first write);
  // exclusive: revoke_grants. What goes on after the handler returns is
  // registered: a streamed put's landing (its guard, which revoke_grants
  // sets to discard) and a get reply the socket queued (its payload, which
  // revoke_grants has the socket copy). So once a pool's free has revoked a
  // range, no message-form op reads or writes it again.
  std::shared_lock<std::shared_mutex> hold_grants() { return std::shared_lock<std::shared_mutex>(access_mu_); }
  std::uint64_t add_landing(std::uint64_t start, std::uint64_t end, std::uint64_t flag_at,
                            std::shared_ptr<net::LandingGuard> guard);
  void end_landing(std::uint64_t id);
  // A get's reply of [payload, +length) of our memory (grant checked, hold_grants held).
  void send_memory_reply(const ReplyPath& to, const DataHeader& h, const void* payload, std::size_t length);
  std::size_t live_landings() const;  // streamed puts and queued get replies being tracked (tests)

 private:
  // ---- control plane ----
  // The listening socket and the control thread's poller; sets `address` (start()).
  void listen();
  // Adds a control connection to the control thread (ours or accepted).
  void add_control(const std::shared_ptr<net::Conn>& conn);
  // A control connection's handlers: every frame to on_message (a bad one logged and dropped).
  std::pair<net::FrameHandler, net::CloseHandler> control_handlers();
  void on_message_logged(const std::shared_ptr<net::Conn>& conn, const void* data, std::size_t length);
  // The first frame on an accepted connection: a control message, or a data lane's introduction.
  void on_first_frame(const std::shared_ptr<net::Conn>& conn, const char* header, std::size_t length,
                      net::Payload& payload);
  // is_reply: an answer to a frame the peer sent (counts toward its backpressure, net::Conn::send).
  void send(const std::shared_ptr<net::Conn>& conn, const control::Header& h, const std::string& body,
            bool is_reply = false);
  void reply(const std::shared_ptr<net::Conn>& conn, const control::Header& request, control::MsgType type,
             control::Status status, const std::string& body);
  void handle_hello(const std::shared_ptr<net::Conn>& conn, const control::Header& h, detail::ByteReader& r);
  void dispatch(const std::shared_ptr<net::Conn>& conn, const control::Header& h, detail::ByteReader& r);
  void dispatcher_loop();
  void control_loop();
  // Pings peers gone quiet; fails those silent for config.liveness_s.
  void liveness_loop();
  std::shared_ptr<Peer> peer_on(const net::Conn* conn);
  // Why a HELLO claiming `claimed` must be refused ("" when it may stand).
  std::string identity_conflict(const control::Hello& claimed);
  // Admits the peer of an accepted HELLO (checked) and replies.
  void admit_hello(const std::shared_ptr<net::Conn>& conn, const control::Header& h, control::Hello hello);
  void refuse_hello(const std::shared_ptr<net::Conn>& conn, const control::Header& h, control::Status status,
                    const std::string& who, const std::string& why);
  // An outgoing connection waiting for its HELLO reply.
  struct Connecting {
    std::string address;
    std::shared_ptr<net::Conn> conn;
    std::shared_ptr<Peer> peer;  // set when the reply registered it
    std::string refused;         // or why not
    std::uint64_t token = 0;     // the data token our HELLO gave the peer
  };
  // Registers the peer of a HELLO reply (control thread, mu_ held).
  void register_connected(const net::Conn* conn, Connecting& c, const std::string& body);
  std::map<const net::Conn*, Connecting> connecting_;
  // tcp lanes that arrived before the HELLO reply that registers their token
  // (accept_lane): by token, each with the worker it asked for (under mu_).
  static constexpr std::size_t kMaxParkedLanes = 64;
  struct ParkedLane {
    std::shared_ptr<net::Conn> conn;
    int worker;
    std::uint32_t lane;
  };
  std::map<std::uint64_t, std::vector<ParkedLane>> parked_lanes_;
  control::Hello my_hello() const;

  void register_token(std::uint64_t token, const std::shared_ptr<Peer>& peer);
  void forget_token(std::uint64_t token);
  std::mutex msg_mu_;
  std::unordered_map<std::uint64_t, MessageOp> message_ops_;
  std::uint64_t next_op_id_ = 1;
  std::unordered_map<std::uint64_t, std::weak_ptr<MessageSink>> sinks_;
  std::uint64_t next_sink_id_ = 1;
  std::unordered_map<std::uint64_t, std::weak_ptr<Peer>> by_token_;
  // Tokens of peers that left, newest last (at most kDepartedTokens): a lane
  // such a peer dialled just before it left is closed, not counted as refused.
  std::deque<std::uint64_t> departed_tokens_;
  static constexpr std::size_t kDepartedTokens = 256;
  bool departed(std::uint64_t token);
  std::atomic<std::uint64_t> message_refusals_{0};
  std::vector<std::shared_ptr<const void>> data_args_;

  std::unique_ptr<net::Poller> control_poller_;  // the listener and every control connection
  std::thread control_thread_;
  std::atomic<bool> stop_control_{false};
  std::atomic<std::uint64_t> refusals_{0};
  std::mutex cuda_pools_mu_;
  std::map<int, std::pair<std::shared_ptr<PoolImpl>, std::unique_ptr<MemoryPool>>> cuda_pools_;
  std::atomic<bool> closed_{false};
  mutable std::mutex mu_;
  std::condition_variable peer_cv_;
  std::mutex connect_mu_;
  std::map<std::string, RegionDescriptor> published_;
  std::map<std::string, CallFn> handlers_;
  std::map<std::uint64_t, std::shared_ptr<Peer>> peers_;          // by device id
  std::deque<std::uint64_t> new_peers_;                           // for wait_for_peer
  std::map<const net::Conn*, std::shared_ptr<net::Conn>> conns_;  // every control connection
  std::map<const net::Conn*, std::shared_ptr<Peer>> peers_by_conn_;
  struct PendingCall {
    RequestState* state;
    const net::Conn* conn;
  };
  std::map<std::uint64_t, PendingCall> pending_;
  // Request ids are random (under mu_), and a reply counts only on the
  // connection its call went out on (PendingCall::conn): a peer can neither
  // guess another connection's ids nor answer for another peer.
  std::mt19937_64 request_ids_{random_id()};
  std::thread dispatcher_;
  std::thread liveness_;
  std::condition_variable liveness_cv_;
  std::string self_proof_;                                              // see control::Hello::self_proof
  std::function<void(std::uintptr_t, std::uintptr_t)> grant_revoker();  // for this device's pools
  std::shared_mutex access_mu_;                                         // see hold_grants
  struct Landing {
    std::uint64_t start, end, flag_at;  // the payload's range, and a flag word's address (or ~0)
    std::shared_ptr<net::LandingGuard> guard;
  };
  struct QueuedReply {
    std::uint64_t start, end;
    std::weak_ptr<net::Conn> conn;
  };
  mutable std::mutex landings_mu_;  // a leaf lock (taken under a socket's send lock)
  std::map<std::uint64_t, Landing> landings_;
  std::map<std::uint64_t, QueuedReply> queued_replies_;
  std::uint64_t next_landing_ = 1;
  std::mutex grantees_mu_;                     // a leaf lock
  std::vector<std::weak_ptr<Peer>> grantees_;  // the peers export_for granted anything
  bool exact_export_ = false;  // export_for gives exact keys (hardware keys, or TENSORWIRE_EXACT_EXPORT=1)
  std::deque<std::function<void()>> jobs_;
  std::condition_variable jobs_cv_;
  bool stop_dispatcher_ = false;
  std::string boot_id_;
  std::uint64_t start_time_ = 0;
  std::string hostname_;
};

}  // namespace tensorwire::detail
