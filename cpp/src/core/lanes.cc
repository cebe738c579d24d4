// Copyright tensorwire authors.
//
// The lanes of core/lane.h: a UCX endpoint, a channel's endpoint to this
// very device, tensorwire's own socket.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "core/channel_impl.h"
#include "cuda/driver.h"
#include "ucx/features.h"

namespace tensorwire::detail {

namespace {

// UCX completion callback for put/get/flush/send. Runs on whichever thread
// progresses the worker; settles the race with the poster through the slot
// that lives in the UCX request (see UcxLane::finish_post).
void on_rma_complete(void* request, ucs_status_t status, void* user_data) {
  auto* slot = static_cast<ucx::RequestSlot*>(request);
  slot->status = status;
  std::uintptr_t prev = slot->state.exchange(ucx::kSlotDone, std::memory_order_acq_rel);
  if (prev > ucx::kSlotDone) {
    // The poster attached and left: we own the UCX request now.
    slot->state.store(0, std::memory_order_relaxed);  // ready for reuse by UCX
    static_cast<PendingOps*>(user_data)->settle(reinterpret_cast<RequestState*>(prev), status);
    ucp_request_free(request);
  }
}

// A socket sends from host memory: a GPU payload is copied to a host buffer
// first (returned, to keep alive until sent; *payload then points into it).
std::shared_ptr<std::string> stage_gpu(const void** payload, std::size_t length) {
  if (!*payload || !length || !cuda::in_use() || !cuda::query(*payload).device) return nullptr;
  auto staged = std::make_shared<std::string>(length, '\0');
  cuda::copy(staged->data(), *payload, length);
  *payload = staged->data();
  return staged;
}

// ---- UCX ----

class UcxLane : public Lane {
 public:
  UcxLane(LaneContext context, std::shared_ptr<ucx::Endpoint> ep, LaneForm form, std::shared_ptr<PoolImpl> pool,
          std::uint32_t peer_pid, bool verify)
      : Lane(std::move(context)),
        ep_(std::move(ep)),
        form_(form),
        pool_(std::move(pool)),
        peer_pid_(peer_pid),
        verify_(verify) {}

  LaneKind kind() const override { return LaneKind::kUcx; }

  bool rma_is_messages() const override {
    int known = messages_.load(std::memory_order_relaxed);
    if (known >= 0) return known != 0;
    const bool use = form_ == LaneForm::kMessages || (form_ == LaneForm::kAuto && needs_target_progress());
    messages_.store(use ? 1 : 0, std::memory_order_relaxed);
    return use;
  }

  bool needs_target_progress() const override {
    int known = target_progress_.load(std::memory_order_relaxed);
    if (known >= 0) return known != 0;
    const std::vector<std::string> lanes = transports();
    // Unknown (an older UCX): assume the RMA is emulated, i.e. the message form,
    // correct on every transport.
    if (lanes.empty()) return true;
    // Transports whose puts complete in the target's memory on their own.
    static const char* const kOneSided[] = {"posix",    "sysv",     "xpmem",     "cma",     "knem",
                                            "self",     "rc_verbs", "rc_mlx5",   "dc_mlx5", "cuda_copy",
                                            "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc"};
    bool needs = false;
    for (const std::string& lane : lanes) {
      const std::string name = lane.substr(0, lane.find('/'));
      bool one_sided = false;
      for (const char* t : kOneSided) one_sided = one_sided || name == t;
      needs = needs || !one_sided;
    }
    target_progress_.store(needs ? 1 : 0, std::memory_order_relaxed);
    return needs;
  }

  // An eager message is applied by the target at once, in the order sent on
  // the endpoint, when one transport connection carries them all; a larger
  // payload may come by rendezvous and land later.
  bool write_message_in_order(std::size_t length) const override { return length <= kOrderedPutMax && one_transport(); }
  bool one_sided() const override { return true; }
  bool unanswered_flagged_writes() const override { return false; }

  bool usable() const override { return ep_ && ep_->get(); }
  void close() override { ep_->close(true); }

  std::vector<std::string> transports() const override {
    std::vector<std::string> out;
    if (!ep_ || !ep_->get()) return out;
#if !TW_UCX_HAS_EP_TRANSPORTS
    return out;  // this UCX cannot name an endpoint's transports (ucx_limits)
#else
    ucp_transport_entry_t entries[16];
    ucp_ep_attr_t attr{};
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    if (ucp_ep_query(ep_->get(), &attr) != UCS_OK) return out;
    for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
      std::string name = std::string(entries[i].transport_name ? entries[i].transport_name : "?") + "/" +
                         (entries[i].device_name ? entries[i].device_name : "?");
      if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(std::move(name));
    }
    return out;
#endif
  }

  std::string info() const override {
    char* buf = nullptr;
    size_t size = 0;
    FILE* f = open_memstream(&buf, &size);
    if (!f) return {};
    ucp_ep_print_info(ep_->get(), f);
    std::fclose(f);
    std::string out(buf, size);
    std::free(buf);
    return out;
  }

  RemoteRegionImpl::Access access(const RemoteRegion& remote) const override {
    return remote.impl()->access_for(ep_, pool_.get(), peer_pid_, verify_);
  }
  char* mapping(const RemoteRegion& remote) const override { return access(remote).mapped; }

  Request rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
              ucp_rkey_h rkey, std::uint64_t raddr, std::size_t length) override {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    param.cb.send = on_rma_complete;
    param.user_data = ctx_.ops;
    param.memh = local.memh;
    void* buffer = static_cast<char*>(local.address) + local_offset;
    WorkerCtl::Caller caller(ctx_.worker.get());
    WorkerCtl::Use use(ctx_.worker.get());
    ucs_status_ptr_t ptr = is_write ? ucp_put_nbx(ep_->get(), buffer, length, raddr, rkey, &param)
                                    : ucp_get_nbx(ep_->get(), buffer, length, raddr, rkey, &param);
    return finish_post(ptr, is_write ? "write" : "read", &local.owner, &remote);
  }

  Request flush() override {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = on_rma_complete;
    param.user_data = ctx_.ops;
    WorkerCtl::Caller caller(ctx_.worker.get());
    WorkerCtl::Use use(ctx_.worker.get());
    return finish_post(ucp_ep_flush_nbx(ep_->get(), &param), "flush");
  }

  void fence() override {
    WorkerCtl::Caller caller(ctx_.worker.get());
    WorkerCtl::Use use(ctx_.worker.get());
    ucx::check(ucp_worker_fence(ctx_.worker->get()), "fence");
  }

  Request send(const std::string& header, const void* payload, std::size_t length, ucp_mem_h memh,
               const std::shared_ptr<const void>* local_owner) override {
    WorkerCtl::Caller caller(ctx_.worker.get());
    WorkerCtl::Use use(ctx_.worker.get());
    ucs_status_ptr_t ptr = post_message(ep_->get(), header, payload, length, memh, on_rma_complete, ctx_.ops);
    return finish_post(ptr, "send", local_owner);
  }

  void post(const std::string& header, const void* payload, std::size_t length, ucp_mem_h memh,
            bool in_order) override {
    ucs_status_ptr_t ptr;
    {
      WorkerCtl::Caller caller(ctx_.worker.get());
      WorkerCtl::Use use(ctx_.worker.get());
      // The operation completes on the target's reply, which comes only
      // after the payload left: the send itself needs no tracking. An
      // in-order write goes eager (never a rendezvous that lands later).
      ptr = post_message(
          ep_->get(), header, payload, length, memh,
          [](void* request, ucs_status_t, void*) { ucp_request_free(request); }, nullptr, in_order);
    }
    if (UCS_PTR_IS_ERR(ptr)) {
      const ucs_status_t st = UCS_PTR_STATUS(ptr);
      throw_error(ucx::error_kind(st), ucs_status_string(st), st);
    }
    // Still going out: someone must progress it. Else it left at once, and
    // what remains, the target's reply, arrives as an event of this worker:
    // a sleeping progress thread wakes for it, and a caller that waits
    // handles it first. Waking the progress thread per post cost a third of
    // a CPU in a tcp ping-pong of two ranks on two cores.
    if (UCS_PTR_IS_PTR(ptr)) ctx_.worker->wake();
  }

 private:
  // Whether one transport connection carries every message (unknown, on an
  // older UCX: not assumed).
  bool one_transport() const {
    int known = one_transport_.load(std::memory_order_relaxed);
    if (known >= 0) return known != 0;
    const bool one = transports().size() == 1;
    one_transport_.store(one ? 1 : 0, std::memory_order_relaxed);
    return one;
  }

  Request finish_post(ucs_status_ptr_t ptr, const char* op, const std::shared_ptr<const void>* local_owner = nullptr,
                      const RemoteRegion* remote = nullptr) {
    if (ptr == nullptr) return Request();  // completed in place: nothing allocated
    if (UCS_PTR_IS_ERR(ptr)) {
      ucs_status_t st = UCS_PTR_STATUS(ptr);
      return Request::failed(ucx::error_kind(st),
                             std::string(op) + " to " + ctx_.peer_name + " failed: " + ucs_status_string(st));
    }
    // One ref for the Request, one for UCX's callback (tracked by the ops).
    auto* state = new RequestState(ctx_.worker, 2);
    if (local_owner) state->local_owner = *local_owner;
    if (remote) state->remote_owner = remote->shared();
    ctx_.ops->add(state);
    auto* slot = static_cast<ucx::RequestSlot*>(ptr);
    std::uintptr_t prev = slot->state.exchange(reinterpret_cast<std::uintptr_t>(state), std::memory_order_acq_rel);
    if (prev == ucx::kSlotDone) {
      // The callback ran before we attached: settle and free here. Otherwise
      // the callback frees (ucp_request_free before completion would silence it).
      slot->state.store(0, std::memory_order_relaxed);
      ctx_.ops->settle(state, slot->status);
      ucp_request_free(ptr);
    }
    ctx_.worker->wake();
    return Request(state);
  }

  const std::shared_ptr<ucx::Endpoint> ep_;
  const LaneForm form_;
  const std::shared_ptr<PoolImpl> pool_;  // this device's pool (a peer's key must not map into it); null: none
  const std::uint32_t peer_pid_;
  const bool verify_;
  mutable std::atomic<int> target_progress_{-1};  // -1 unknown, else the answer
  mutable std::atomic<int> messages_{-1};
  mutable std::atomic<int> one_transport_{-1};
};

// A channel to this very device (one process hosting both ends, such as a
// colocated worker and server): the peer's pool blocks are this process's
// own memory, whatever UCX's transports, and are copied; the rest goes
// through UCX's endpoint to our own worker, one-sided.
class SelfLane : public UcxLane {
 public:
  SelfLane(LaneContext context, std::shared_ptr<ucx::Endpoint> ep, std::weak_ptr<PoolImpl> own)
      // It reaches its own memory on purpose: no key is verified.
      : UcxLane(std::move(context), std::move(ep), LaneForm::kRma, nullptr, 0, /*verify=*/false),
        own_(std::move(own)) {}

  LaneKind kind() const override { return LaneKind::kSelf; }
  bool rma_is_messages() const override { return false; }

  // An own pool block: mapped, and its key unpacked only if a copy cannot
  // serve (rma() then asks UCX for it).
  RemoteRegionImpl::Access access(const RemoteRegion& remote) const override {
    if (char* mine = own_memory(remote)) return {nullptr, mine};
    return UcxLane::access(remote);
  }
  char* mapping(const RemoteRegion& remote) const override { return own_memory(remote); }
  Request rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
              ucp_rkey_h rkey, std::uint64_t raddr, std::size_t length) override {
    if (!rkey) rkey = UcxLane::access(remote).rkey;
    return UcxLane::rma(is_write, local, local_offset, remote, rkey, raddr, length);
  }

 private:
  // A pool block of this very device: its first byte, pinned; else nullptr.
  char* own_memory(const RemoteRegion& remote) const {
    auto pool = own_.lock();
    return pool ? remote.impl()->own_memory(*pool) : nullptr;
  }
  const std::weak_ptr<PoolImpl> own_;
};

// ---- tensorwire's own socket ----

// Every operation in the message form; no RMA, no keys, no mapping.
class SocketLane : public Lane {
 public:
  SocketLane(LaneContext context, std::shared_ptr<net::Conn> conn, bool borrowed, int lane, std::string transport)
      : Lane(std::move(context)),
        conn_(std::move(conn)),
        borrowed_(borrowed),
        lane_(lane),
        transport_(std::move(transport)) {}

  LaneKind kind() const override { return LaneKind::kSocket; }
  bool rma_is_messages() const override { return true; }
  bool needs_target_progress() const override { return true; }
  // The target reads one frame at a time: every write is applied in order.
  bool write_message_in_order(std::size_t) const override { return true; }
  bool one_sided() const override { return false; }
  bool unanswered_flagged_writes() const override { return true; }

  bool usable() const override { return !conn_->closed(); }
  // A socket fails what it still queues when its worker's poller sees it closed.
  void close() override {
    if (!borrowed_) conn_->close("channel closed");
  }
  std::vector<std::string> transports() const override { return {transport_}; }
  std::string info() const override {
    return "tcp/socket: lane " + std::to_string(lane_) + " is tensorwire's own socket (" + conn_->name() +
           (borrowed_ ? ", dialled by the peer, used both ways" : "") + ")\n";
  }

  RemoteRegionImpl::Access access(const RemoteRegion&) const override { return {}; }  // the target checks every address
  char* mapping(const RemoteRegion&) const override { return nullptr; }

  Request rma(bool, const LocalRegion&, std::size_t, const RemoteRegion&, ucp_rkey_h, std::uint64_t,
              std::size_t) override {
    no_one_sided();
  }
  Request flush() override { no_one_sided(); }
  void fence() override { no_one_sided(); }

  Request send(const std::string& header, const void* payload, std::size_t length, ucp_mem_h,
               const std::shared_ptr<const void>* local_owner) override {
    auto staged = stage_gpu(&payload, length);
    // Tracked only when the frame could not all leave at once (the common small
    // send is complete on return): one ref for the Request, one for the send's
    // completion (the ops track it).
    RequestState* state = nullptr;
    PendingOps* ops = ctx_.ops;
    try {
      const bool left = conn_->send(header, payload, length, [&]() -> net::SendDone {
        state = new RequestState(ctx_.worker, 2);
        if (local_owner) state->local_owner = *local_owner;
        ops->add(state);
        return [ops, state, staged](bool ok) { ops->settle(state, ok ? UCS_OK : UCS_ERR_CONNECTION_RESET); };
      });
      if (left) return Request();
    } catch (const Error& e) {
      return Request::failed(ErrorKind::kConnection, "send to " + ctx_.peer_name + " failed: " + e.what());
    }
    ctx_.worker->wake();  // the rest leaves when the socket can take it: someone must progress
    return Request(state);
  }

  void post(const std::string& header, const void* payload, std::size_t length, ucp_mem_h, bool) override {
    auto staged = stage_gpu(&payload, length);
    conn_->send(header, payload, length, [&staged]() -> net::SendDone {
      if (!staged) return nullptr;
      return [staged](bool) {};  // keeps the staged copy until it left
    });
  }

  // It rides in the next frame sent on this socket (net::Conn::ride; `key`
  // coalesces: a later one replaces it), or goes at the worker's next flush point.
  bool ride(const void* key, const DataHeader& h) override {
    if (conn_->closed()) return false;  // the caller's own path reports it where it always did
    bool first;
    try {
      first = conn_->ride(key, h.encode());
    } catch (const ConnectionError&) {  // closed since the look above
      return false;
    }
    if (first) {
      std::weak_ptr<net::Conn> weak = conn_;
      ctx_.worker->defer([weak] {
        if (auto conn = weak.lock()) conn->flush_riders();
      });
    }
    return true;
  }

 private:
  [[noreturn]] static void no_one_sided() {
    throw InvalidArgument("a tcp lane has no one-sided operations (its writes and reads are messages)");
  }
  const std::shared_ptr<net::Conn> conn_;
  const bool borrowed_;
  const int lane_;
  const std::string transport_;
};

}  // namespace

std::unique_ptr<Lane> ucx_lane(LaneContext context, std::shared_ptr<ucx::Endpoint> ep, LaneForm form,
                               std::shared_ptr<PoolImpl> pool, std::uint32_t peer_pid) {
  return std::make_unique<UcxLane>(std::move(context), std::move(ep), form, std::move(pool), peer_pid,
                                   /*verify=*/true);
}

std::unique_ptr<Lane> self_lane(LaneContext context, std::shared_ptr<ucx::Endpoint> ep, std::weak_ptr<PoolImpl> own) {
  return std::make_unique<SelfLane>(std::move(context), std::move(ep), std::move(own));
}

std::unique_ptr<Lane> socket_lane(LaneContext context, std::shared_ptr<net::Conn> conn, bool borrowed, int lane,
                                  std::string transport) {
  return std::make_unique<SocketLane>(std::move(context), std::move(conn), borrowed, lane, std::move(transport));
}

}  // namespace tensorwire::detail
