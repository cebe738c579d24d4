// Copyright tensorwire authors.
//
// ChannelImpl (core/channel_impl.h) and the public Channel. The lanes under
// channels are in core/lanes.cc, PendingOps and the deferred releases in
// core/pending_ops.cc, Peer in core/peer.cc, the message form's target side
// in core/messages.cc.
#include <atomic>
#include <cstring>

#include "core/bulk_copy.h"
#include "core/device_impl.h"
#include "cuda/driver.h"

namespace tensorwire {
namespace detail {

namespace {

// The error handler's argument: owned by the worker (see
// ucx::Worker::keep_until_destroyed), never by the channel.
struct DataEpErrorArg {
  std::weak_ptr<Peer> peer;
  std::string peer_name;
};

void on_data_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<const DataEpErrorArg*>(arg);
  if (auto peer = a->peer.lock()) {
    peer->fail(ErrorKind::kPeerFailed, "data endpoint to " + a->peer_name + " failed: " + ucs_status_string(status),
               /*calls_too=*/false);
  }
}

// A direct copy waits at most this long for one-sided operations it must not overtake.
constexpr double kDrainTimeoutS = 30.0;

bool range_ok(std::size_t offset, std::size_t length, std::uint64_t size) {
  return length <= size && offset <= size - length;
}

// Completes the Request of a chained operation (write_ordered) and drops
// the chain's reference; the owners it kept alive are released outside UCX.
void settle_chain(RequestState* state, bool ok, ErrorKind kind, const std::string& why) {
  if (ok) {
    state->complete_ok();
  } else {
    state->complete_error(kind, why);
  }
  defer_release(std::move(state->local_owner));
  defer_release(std::move(state->remote_owner));
  state->release();
}

bool maps_shared_memory(const Peer& peer) {
  auto dev = peer.device.lock();
  return dev && dev->config.map_shared_memory && peer.info.same_host;
}

}  // namespace

// ---- ChannelImpl ----

ChannelImpl::ChannelImpl(std::shared_ptr<Peer> p, int l, std::shared_ptr<WorkerCtl> w)
    : peer(std::move(p)),
      lane_index(l),
      worker(std::move(w)),
      ops_(new PendingOps(peer, peer->describe())),
      map_shared_memory_(maps_shared_memory(*peer)) {}

void ChannelImpl::connect(const std::string& remote_worker_address) {
  auto dev = peer->device.lock();
  if (!dev) throw ConnectionError("device is closed");
  // A channel to this very device (one process hosting both ends, such as
  // a colocated worker and server): its lane copies our own pool blocks,
  // whatever the transport.
  const bool self = peer->hello.device_id == dev->id;
  if (!self && dev->socket_lanes()) {
    lane_ = connect_socket(*dev);
    return;
  }
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(remote_worker_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_NONE;  // liveness comes from the control plane
  auto err_arg = std::make_shared<DataEpErrorArg>(DataEpErrorArg{peer, peer->describe()});
  worker->worker()->keep_until_destroyed(err_arg);
  params.err_handler.cb = on_data_ep_error;
  params.err_handler.arg = err_arg.get();
  ucp_ep_h handle = nullptr;
  const ucs_status_t st = ucp_ep_create(worker->get(), &params, &handle);
  // Transport auto: a peer no UCX transport of ours reaches gets a tcp lane.
  if (st == UCS_ERR_UNREACHABLE && !self && dev->config.transport == "auto") {
    lane_ = connect_socket(*dev);
    return;
  }
  ucx::check(st, "cannot create a data endpoint to " + peer->describe());
  auto ep = std::make_shared<ucx::Endpoint>(worker->worker(), handle);
  LaneContext context{worker, ops_, peer->describe()};
  if (self) {
    lane_ = self_lane(std::move(context), std::move(ep), dev->pool_impl);
    return;
  }
  const LaneForm form =
      dev->lane_forms.empty() ? LaneForm::kAuto : dev->lane_forms[lane_index % dev->lane_forms.size()];
  lane_ = ucx_lane(std::move(context), std::move(ep), form, dev->pool_impl, peer->hello.pid);
}

std::unique_ptr<Lane> ChannelImpl::connect_socket(DeviceImpl& dev) {
  LaneContext context{worker, ops_, peer->describe()};
  const std::string transport = "tcp/" + (dev.lane_interface.empty() ? std::string("socket") : dev.lane_interface);
  // The peer's own lane, where it dialled one: its frames and ours share the
  // socket, each side's replies coming back on it (lane_handlers serves both).
  // bench/results/net_one_socket.txt: a round trip is two segments, not three.
  const int here = static_cast<int>(lane_index % dev.workers.size());
  auto theirs = peer->inbound_lane(lane_index, here);
  if (!theirs && peer->accepted) theirs = peer->lane_from_dialer(lane_index, here, dev.config.connect_timeout_s);
  if (theirs) return socket_lane(std::move(context), std::move(theirs), /*borrowed=*/true, lane_index, transport);
  auto [host, port] = net::split_address(peer->hello.address);
  socklen_t len = 0;
  const sockaddr_storage ss = net::resolve(host, port, &len);
  auto conn = net::Conn::dial(ss, len, "tcp lane " + std::to_string(lane_index) + " to " + peer->describe(),
                              dev.config.connect_timeout_s, dev.config.keepalive_s, dev.lane_interface);
  LaneIntro intro;
  intro.version = dev.config.protocol_version ? dev.config.protocol_version : control::kProtocolVersion;
  intro.worker = static_cast<std::uint16_t>(lane_index % peer->hello.workers.size());
  intro.lane = static_cast<std::uint32_t>(lane_index);
  intro.token = peer->hello.data_token;
  conn->send(intro.encode());  // before any data message; the acceptor checks it first
  // Replies to what we send come back on the same socket, to this lane's worker.
  auto [on_frame, on_close] = dev.lane_handlers(static_cast<int>(lane_index % dev.workers.size()), peer);
  worker->sockets().add(conn, std::move(on_frame), std::move(on_close));
  return socket_lane(std::move(context), std::move(conn), /*borrowed=*/false, lane_index, transport);
}

ChannelImpl::~ChannelImpl() {
  // Force-close: UCX cancels what it still holds, now or (for operations
  // queued in a transport) when the worker is destroyed; those completions
  // land in ops_, which lives until the last of them. A socket fails what it
  // still queues when its worker's poller sees it closed.
  if (lane_) lane_->close();
  ops_->fail(ErrorKind::kConnection, "channel closed");
  ops_->release();
  drain_deferred_releases();
}

void ChannelImpl::check_usable() const {
  if (failed()) ops_->throw_failure();
  // Peer::fail marks the peer failed (peers() drops it) before it fails its
  // channels one by one: an op posted in between fails as it would after.
  if (peer->failed()) throw PeerFailed(peer->describe() + " has failed");
  if (!lane_->usable()) throw ConnectionError("channel is closed");
}

bool ChannelImpl::check_rma(const char* op, const LocalRegion& local, std::size_t local_offset,
                            const RemoteRegion& remote, std::size_t remote_offset, std::size_t length) const {
  if (!remote) throw InvalidArgument(std::string(op) + ": empty remote region");
  if (!local.address || !local.memh) throw InvalidArgument(std::string(op) + ": local memory is not registered");
  if (!range_ok(local_offset, length, local.length)) {
    throw InvalidArgument(std::string(op) + ": local range [" + std::to_string(local_offset) + ", +" +
                          std::to_string(length) + ") exceeds the local region of " + std::to_string(local.length) +
                          " bytes");
  }
  const RegionDescriptor& rd = remote.descriptor();
  if (!range_ok(remote_offset, length, rd.length)) {
    throw InvalidArgument(std::string(op) + ": remote range [" + std::to_string(remote_offset) + ", +" +
                          std::to_string(length) + ") exceeds the remote region of " + std::to_string(rd.length) +
                          " bytes");
  }
  if (rd.device_id != peer->hello.device_id) {
    throw InvalidArgument(std::string(op) + ": the remote region belongs to another device than this channel's peer");
  }
  check_usable();
  return length != 0;
}

Request ChannelImpl::rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                         std::size_t remote_offset, std::size_t length) {
  const char* op = is_write ? "write" : "read";
  if (!check_rma(op, local, local_offset, remote, remote_offset, length)) return Request();
  // GPU memory is never copied here: UCX's CUDA transports move it, in this
  // thread's CUDA context.
  if (cuda::in_use()) cuda::bind_thread(cuda::first_ordinal());
  if (lane_->rma_is_messages()) return message_rma(is_write, local, local_offset, remote, remote_offset, length);
  return one_sided(is_write, local, local_offset, remote, remote_offset, length);
}

Request ChannelImpl::one_sided(bool is_write, const LocalRegion& local, std::size_t local_offset,
                               const RemoteRegion& remote, std::size_t remote_offset, std::size_t length) {
  const RegionDescriptor& rd = remote.descriptor();
  const bool host_target = rd.memory_type == MemoryType::kHost;
  const RemoteRegionImpl::Access access = lane_->access(remote);
  if (access.mapped && host_target && map_shared_memory_ && host_memory(local)) {
    return direct(is_write, local, local_offset, access.mapped, remote_offset, length);
  }
  rma_since_fence_.store(true, std::memory_order_relaxed);
  posted_.fetch_add(1, std::memory_order_relaxed);
  Request request = lane_->rma(is_write, local, local_offset, remote, access.rkey, rd.address + remote_offset, length);
  drain_deferred_releases();
  return request;
}

Request ChannelImpl::batch(bool is_write, const std::vector<Transfer>& transfers) {
  const std::string op = is_write ? "write_batch" : "read_batch";
  for (std::size_t i = 0; i < transfers.size(); ++i) {  // all checked before any is posted
    const Transfer& t = transfers[i];
    check_rma((op + " item " + std::to_string(i)).c_str(), t.local, t.local_offset, t.remote, t.remote_offset,
              t.length);
  }
  std::vector<Request> posted;
  for (const Transfer& t : transfers) {
    Request r = rma(is_write, t.local, t.local_offset, t.remote, t.remote_offset, t.length);
    if (r.state() < 0) r.wait(0);  // posted, then failed at once: its error is the batch's
    posted.push_back(std::move(r));
  }
  return join(std::move(posted));
}

Request ChannelImpl::join(std::vector<Request> requests) {
  auto pending = std::make_shared<std::vector<Request>>();
  for (Request& r : requests) {
    if (r.state() < 0) return Request::failed(r.error_kind(), r.error_message());
    if (r.state() == 0) pending->push_back(std::move(r));
  }
  if (pending->empty()) return Request();
  // One request over the pending ones; they complete in any order.
  auto* state = new RequestState(worker, 1);
  state->poller_evented = true;  // UCX requests: their completions are events of this worker
  auto next = std::make_shared<std::size_t>(0);
  state->poller = [pending, next, state]() {
    // state(), not test(): the waiter (or the progress thread) progresses.
    for (; *next < pending->size(); ++*next) {
      Request& r = (*pending)[*next];
      if (r.state() == 0) return false;
      if (r.state() < 0) {
        state->complete_error(r.error_kind(), r.error_message());
        return true;
      }
    }
    state->complete_ok();
    return true;
  };
  return Request(state);
}

Request ChannelImpl::message_rma(bool is_write, const LocalRegion& local, std::size_t local_offset,
                                 const RemoteRegion& remote, std::size_t remote_offset, std::size_t length,
                                 std::uint64_t flag_at, std::uint64_t flag) {
  auto dev = peer->device.lock();
  if (!dev) throw ConnectionError("device is closed");
  char* here = static_cast<char*>(local.address) + local_offset;
  // One ref for the Request, one for the op table (settle drops it).
  auto* state = new RequestState(worker, 2);
  state->inbound = !is_write;
  state->local_owner = local.owner;
  state->remote_owner = remote.shared();
  DeviceImpl::MessageOp op;
  op.state = state;
  op.ops = ops_;
  op.peer = peer.get();
  if (!is_write) {
    op.dest = here;
    op.memh = local.memh;
    op.length = length;
  }
  // A write the target applies in order (core/messages.h): a fence after it
  // waits for nothing. Reads are not: the target's reply may read its memory
  // after later writes landed.
  const bool ordered = is_write && lane_->write_message_in_order(length);
  ops_->add_message(state, ordered);  // before the post: the reply may beat its return
  const std::uint64_t id = dev->add_message_op(op);
  DataHeader h;
  h.kind = is_write ? (flag_at ? MsgKind::kPutFlagged : MsgKind::kPut) : MsgKind::kGet;
  h.token = peer->hello.data_token;
  h.target = id;
  h.a = remote.descriptor().address + remote_offset;
  h.b = is_write ? flag_at : length;
  std::string extra;
  if (flag_at) {
    ByteWriter w;
    w.put<std::uint64_t>(flag);
    extra = std::move(w.str());
  }
  posted_.fetch_add(1, std::memory_order_relaxed);
  try {
    // The op completes on the target's reply, which comes after the payload arrived.
    lane_->post(h.encode(extra), is_write ? here : nullptr, is_write ? length : 0, is_write ? local.memh : nullptr,
                ordered);
  } catch (const Error& e) {
    DeviceImpl::MessageOp taken;
    if (dev->take_message_op(id, peer.get(), &taken)) {
      state->complete_error(
          e.kind(), std::string(is_write ? "write" : "read") + " to " + peer->describe() + " failed: " + e.what());
      ops_->settle_message(state, UCS_ERR_CONNECTION_RESET);
    }
  }
  worker->flush_deferred();  // after the caller's own message
  drain_deferred_releases();
  return Request(state);
}

Request ChannelImpl::send_message(DataHeader h, std::string_view extra, const LocalRegion* local, std::size_t offset,
                                  std::size_t length) {
  Request request = post_data_message(h, extra, local, offset, length);
  worker->flush_deferred();  // after the caller's own message
  drain_deferred_releases();
  return request;
}

bool ChannelImpl::ride_message(const void* key, DataHeader h) {
  // A lane that failed: the caller's own path reports it where it always did.
  if (failed()) return false;
  h.token = peer->hello.data_token;
  return lane_->ride(key, h);
}

Request ChannelImpl::post_data_message(DataHeader h, std::string_view extra, const LocalRegion* local,
                                       std::size_t offset, std::size_t length) {
  check_usable();
  h.token = peer->hello.data_token;
  const void* payload = local && length ? static_cast<const char*>(local->address) + offset : nullptr;
  posted_.fetch_add(1, std::memory_order_relaxed);
  return lane_->send(h.encode(extra), payload, payload ? length : 0, payload ? local->memh : nullptr,
                     local ? &local->owner : nullptr);
}

bool ChannelImpl::can_place(const LocalRegion& local, const RemoteRegion& remote) const {
  // Placing takes a one-sided put: a tcp lane's payloads travel in the message, read into place by the target.
  return lane_->rma_is_messages() && lane_->one_sided() && remote.descriptor().memory_type == MemoryType::kHost &&
         host_memory(local);
}

Request ChannelImpl::put_then_message(const LocalRegion& local, std::size_t offset, const RemoteRegion& remote,
                                      std::size_t remote_offset, std::size_t length, DataHeader h, std::string extra) {
  check_usable();
  if (!check_rma("write", local, offset, remote, remote_offset, length)) {
    return send_message(h, extra, nullptr, 0, 0);
  }
  // Not waited on: the flush below completes after it (its state keeps the source alive).
  Request put = one_sided(true, local, offset, remote, remote_offset, length);
  if (put.state() < 0) return put;
  // The flush completes once the target acknowledged every put before it
  // (over tcp: its UCX placed the bytes), so the message cannot overtake them.
  Request landed = flush_one_sided();
  drain_deferred_releases();
  if (landed.state() != 0) {
    if (landed.state() < 0) return landed;
    return send_message(h, extra, nullptr, 0, 0);
  }
  return post_after(std::move(landed), [h, extra = std::move(extra)](ChannelImpl& channel) {
    return channel.post_data_message(h, extra, nullptr, 0, 0);
  });
}

bool ChannelImpl::host_memory(const LocalRegion& local) const {
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE;
  return ucp_mem_query(local.memh, &attr) == UCS_OK && attr.mem_type == UCS_MEMORY_TYPE_HOST;
}

Request ChannelImpl::write_streaming(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                                     std::size_t remote_offset, std::size_t length) {
  if (!check_rma("write_streaming", local, local_offset, remote, remote_offset, length)) return Request();
  char* mapped = direct_target(remote, local);
  if (!mapped) throw InvalidArgument("write_streaming: the peer's region is not mapped here");
  return direct(true, local, local_offset, mapped, remote_offset, length, /*streaming=*/true);
}

Request ChannelImpl::direct(bool is_write, const LocalRegion& local, std::size_t local_offset, char* mapped,
                            std::size_t remote_offset, std::size_t length, bool streaming) {
  if (drain_before_direct_.exchange(false, std::memory_order_acq_rel)) {
    // One-sided operations posted before the last fence may still be in
    // flight: this copy must not overtake them.
    drains_.fetch_add(1, std::memory_order_relaxed);
    flush().wait(kDrainTimeoutS);
  }
  char* here = static_cast<char*>(local.address) + local_offset;
  char* there = mapped + remote_offset;
  if (is_write) {
    if (streaming) {
      streaming_copy(there, here, length);
    } else {
      bulk_copy(there, here, length);
    }
    direct_writes_.fetch_add(1, std::memory_order_relaxed);
  } else {
    bulk_copy(here, there, length);
    direct_reads_.fetch_add(1, std::memory_order_relaxed);
  }
  direct_bytes_.fetch_add(length, std::memory_order_relaxed);
  return Request();  // complete: the bytes are in place
}

void ChannelImpl::check_remote(const RemoteRegion& remote) const {
  check_usable();
  lane_->access(remote);  // a tcp lane uses no key: the target checks every address
}

char* ChannelImpl::direct_target(const RemoteRegion& remote, const LocalRegion& local) const {
  if (!remote || !local.memh || !host_memory(local)) return nullptr;
  return mapped(remote, /*rma_form_only=*/true);
}

char* ChannelImpl::mapping_of(const RemoteRegion& remote) const { return mapped(remote, /*rma_form_only=*/false); }

char* ChannelImpl::mapped(const RemoteRegion& remote, bool rma_form_only) const {
  if (!remote || !map_shared_memory_) return nullptr;
  if (remote.descriptor().memory_type != MemoryType::kHost) return nullptr;
  if (remote.descriptor().device_id != peer->hello.device_id) return nullptr;
  check_usable();
  if (rma_form_only && lane_->rma_is_messages()) return nullptr;  // writes and reads go as messages, never a copy here
  return lane_->mapping(remote);
}

ChannelStats ChannelImpl::stats() const {
  ChannelStats s;
  s.posted = posted_.load(std::memory_order_relaxed);
  s.direct_writes = direct_writes_.load(std::memory_order_relaxed);
  s.direct_reads = direct_reads_.load(std::memory_order_relaxed);
  s.direct_bytes = direct_bytes_.load(std::memory_order_relaxed);
  s.drains = drains_.load(std::memory_order_relaxed);
  return s;
}

Request ChannelImpl::flush() {
  check_usable();
  if (lane_->rma_is_messages()) return ops_->flush_messages(worker);  // every op completes on the target's reply
  return flush_one_sided();
}

Request ChannelImpl::flush_one_sided() {
  // Large memcpys use non-temporal stores, which x86 does not order with
  // later stores: make every direct copy so far visible first.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return lane_->flush();
}

void ChannelImpl::fence() {
  check_usable();
  if (lane_->rma_is_messages()) {
    // Eager writes are applied in order (message_rma); a rendezvous payload
    // or a read's reply lands later: wait for every op in flight then.
    if (ops_->unordered_in_flight()) flush().wait(kDrainTimeoutS);
    return;
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);  // orders direct copies (see flush)
  if (rma_since_fence_.exchange(false, std::memory_order_acq_rel)) {
    drain_before_direct_.store(true, std::memory_order_release);
  }
  lane_->fence();
}

Request ChannelImpl::write_ordered(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                                   std::size_t remote_offset, std::size_t length) {
  // Transports that land puts by themselves (shared memory: a copy done at
  // once; verbs RC/DC: ordered by the NIC) get UCX's cheap fence. The others
  // (tcp) would get a strong one: a worker flush that ucp_worker_fence spins
  // out, holding the worker, for the whole payload (100 ms for 200 MB).
  // Inline mode keeps the blocking fence too: no thread but the caller's
  // progresses, so a write chained to a flush would wait for the caller's
  // next wait (and never come if the caller sends last and leaves).
  const bool messages = lane_->rma_is_messages();
  if ((!lane_->needs_target_progress() && !messages) || worker->mode() == ProgressMode::kInline ||
      (messages && !ops_->unordered_in_flight())) {
    fence();
    return rma(true, local, local_offset, remote, remote_offset, length);
  }
  Request before = flush();
  if (before.state() != 0) {
    if (before.state() < 0) return Request::failed(ErrorKind::kConnection, before.error_message());
    return rma(true, local, local_offset, remote, remote_offset, length);
  }
  return post_after(
      std::move(before),
      [local = LocalRegion(local), local_offset, remote = RemoteRegion(remote), remote_offset,
       length](ChannelImpl& channel) { return channel.rma(true, local, local_offset, remote, remote_offset, length); },
      local.owner, remote.shared());
}

Request ChannelImpl::write_flagged(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                                   std::size_t remote_offset, std::size_t length, std::size_t flag_local_offset,
                                   std::size_t flag_remote_offset, bool landed) {
  check_rma("write_flagged", local, local_offset, remote, remote_offset, length);
  check_rma("write_flagged (flag)", local, flag_local_offset, remote, flag_remote_offset, 8);
  if ((remote.descriptor().address + flag_remote_offset) % 8) {
    throw InvalidArgument("write_flagged: the flag must be an aligned 8-byte word");
  }
  if (lane_->rma_is_messages()) {
    // One message: the target lands the payload, then sets the flag (kPutFlagged).
    std::uint64_t flag;
    std::memcpy(&flag, static_cast<const char*>(local.address) + flag_local_offset, sizeof(flag));
    if (!landed && lane_->unanswered_flagged_writes()) {
      // Unanswered (operation id 0): one syscall less at each end per record, and no
      // reply to wake our progress thread.
      DataHeader h;
      h.kind = MsgKind::kPutFlagged;
      h.token = peer->hello.data_token;
      h.target = kUnanswered;
      h.a = remote.descriptor().address + remote_offset;
      h.b = remote.descriptor().address + flag_remote_offset;
      ByteWriter w;
      w.put<std::uint64_t>(flag);
      posted_.fetch_add(1, std::memory_order_relaxed);
      Request sent = lane_->send(h.encode(w.str()), static_cast<const char*>(local.address) + local_offset, length,
                                 local.memh, &local.owner);
      worker->flush_deferred();
      drain_deferred_releases();
      return sent;
    }
    return message_rma(true, local, local_offset, remote, remote_offset, length,
                       remote.descriptor().address + flag_remote_offset, flag);
  }
  Request data = rma(true, local, local_offset, remote, remote_offset, length);
  fence();
  Request flag = rma(true, local, flag_local_offset, remote, flag_remote_offset, 8);
  std::vector<Request> both;
  both.push_back(std::move(data));
  both.push_back(std::move(flag));
  return join(std::move(both));
}

Request ChannelImpl::post_after(Request before, std::function<Request(ChannelImpl&)> next,
                                std::shared_ptr<const void> local_owner, std::shared_ptr<const void> remote_owner) {
  // One ref for the returned Request, one for the chain (dropped when it ends).
  auto* outer = new RequestState(worker, 2);
  outer->local_owner = std::move(local_owner);
  outer->remote_owner = std::move(remote_owner);
  std::weak_ptr<ChannelImpl> self = weak_from_this();
  // Runs on whichever thread completes `before`, maybe inside a UCX
  // callback: posting from there is allowed (progressing is not); whatever
  // may be a last reference (the channel, memory, an rkey) is released
  // later, outside UCX.
  before.then([self, outer, next = std::move(next)](bool ok, const std::string& message) mutable {
    Request posted;
    bool is_posted = false;
    ErrorKind kind = ErrorKind::kConnection;
    std::string why = message;
    if (ok) {
      if (auto channel = self.lock()) {
        try {
          posted = next(*channel);
          is_posted = true;
        } catch (const Error& e) {
          kind = e.kind();
          why = e.what();
        }
        defer_release(std::move(channel));
      } else {
        why = "channel closed";
      }
    }
    // What `next` captured goes now, while `outer` still holds the owners
    // (released outside UCX when it settles): never a last reference here.
    next = nullptr;
    if (!is_posted) return settle_chain(outer, false, kind, why);
    posted.then([outer](bool done, const std::string& w) { settle_chain(outer, done, ErrorKind::kConnection, w); });
  });
  return Request(outer);
}

}  // namespace detail

// ---- public Channel ----

using control::kExportCall;

namespace {
detail::ChannelImpl& impl_of(const std::shared_ptr<detail::ChannelImpl>& impl) {
  if (!impl) throw InvalidArgument("empty channel");
  return *impl;
}
}  // namespace

Request Channel::write_flagged(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                               std::size_t remote_offset, std::size_t length, std::size_t flag_local_offset,
                               std::size_t flag_remote_offset, bool landed) {
  return impl_of(impl_).write_flagged(local, local_offset, remote, remote_offset, length, flag_local_offset,
                                      flag_remote_offset, landed);
}

Request Channel::write(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                       std::size_t remote_offset, std::size_t length) {
  return impl_of(impl_).rma(true, local, local_offset, remote, remote_offset, length);
}

Request Channel::read(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                      std::size_t remote_offset, std::size_t length) {
  return impl_of(impl_).rma(false, local, local_offset, remote, remote_offset, length);
}

Request Channel::write_batch(const std::vector<Transfer>& transfers) { return impl_of(impl_).batch(true, transfers); }
Request Channel::read_batch(const std::vector<Transfer>& transfers) { return impl_of(impl_).batch(false, transfers); }

void Channel::fence() { impl_of(impl_).fence(); }
Request Channel::write_ordered(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                               std::size_t remote_offset, std::size_t length) {
  return impl_of(impl_).write_ordered(local, local_offset, remote, remote_offset, length);
}
Request Channel::flush() { return impl_of(impl_).flush(); }
int Channel::lane() const { return impl_of(impl_).lane_index; }
bool Channel::maps(const RemoteRegion& remote, const LocalRegion& local) const {
  return impl_of(impl_).direct_target(remote, local) != nullptr;
}
std::vector<std::string> Channel::transports() const { return impl_of(impl_).lane().transports(); }
ChannelForm Channel::form() const {
  return impl_of(impl_).lane().rma_is_messages() ? ChannelForm::kMessages : ChannelForm::kRma;
}
Request Channel::write_streaming(const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                                 std::size_t remote_offset, std::size_t length) {
  return impl_of(impl_).write_streaming(local, local_offset, remote, remote_offset, length);
}
ChannelStats Channel::stats() const { return impl_of(impl_).stats(); }
PeerInfo Channel::peer() const { return impl_of(impl_).peer->info; }
unsigned Channel::progress() { return impl_of(impl_).worker->progress(); }

std::string Channel::transport_info() const {
  auto& ch = impl_of(impl_);
  ch.check_usable();
  return ch.lane().info();
}

RemoteRegion Channel::lookup(const std::string& name, double timeout_s) {
  auto& ch = impl_of(impl_);
  auto dev = ch.peer->device.lock();
  if (!dev) throw ConnectionError("device is closed");
  std::string body = dev->control_call(ch.peer, control::MsgType::kLookup, name, timeout_s);
  RegionDescriptor d = RegionDescriptor::from_bytes(body.data(), body.size());
  if (d.device_id != ch.peer->hello.device_id) {
    throw ProtocolMismatch("lookup of '" + name + "' returned a region of another device");
  }
  return RemoteRegion(ch.peer->accept_export(d));
}

RemoteRegion Channel::remote_region(const RegionDescriptor& d) {
  auto& ch = impl_of(impl_);
  if (d.device_id != ch.peer->hello.device_id) {
    throw InvalidArgument("the region descriptor belongs to another device than this channel's peer");
  }
  return RemoteRegion(ch.peer->remote_region(d));
}

RegionDescriptor Channel::export_region(const LocalRegion& local, double timeout_s) {
  auto& ch = impl_of(impl_);
  auto dev = ch.peer->device.lock();
  if (!dev) throw ConnectionError("device is closed");
  if (!local.address || !local.rkey) throw InvalidArgument("export_region: local memory is not registered");
  RegionDescriptor d;
  d.device_id = dev->id;
  d.address = reinterpret_cast<std::uint64_t>(local.address);
  d.length = local.length;
  d.rkey = *local.rkey;
  if (detail::gpu_memory(local)) d.memory_type = MemoryType::kCuda;  // the receiver reads it as GPU memory
  d = dev->export_for(std::move(d), *ch.peer);
  call(kExportCall, d.to_bytes(), timeout_s);
  return d;
}

std::string Channel::call(const std::string& name, const std::string& payload, double timeout_s) {
  auto& ch = impl_of(impl_);
  auto dev = ch.peer->device.lock();
  if (!dev) throw ConnectionError("device is closed");
  detail::ByteWriter w;
  w.put_bytes16(name);
  w.put_bytes32(payload);
  return dev->control_call(ch.peer, control::MsgType::kCall, w.str(), timeout_s);
}

}  // namespace tensorwire
