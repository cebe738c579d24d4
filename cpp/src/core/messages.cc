// Copyright tensorwire authors.
//
// Data messages: the wire header, the payload's landing, and the target side
// of plain write/read in the message form (DeviceImpl::on_data_message).
#include "core/messages.h"
#include "cuda/driver.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "core/device_impl.h"
#include "ucx/features.h"

namespace tensorwire::detail {

std::string DataHeader::encode(std::string_view extra) const {
  ByteWriter w;
  w.put<std::uint32_t>(kDataMagic);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(kind));
  w.put<std::uint8_t>(0);
  w.put<std::uint16_t>(0);
  w.put<std::uint64_t>(token);
  w.put<std::uint64_t>(target);
  w.put<std::uint64_t>(a);
  w.put<std::uint64_t>(b);
  w.put_raw(extra);
  return std::move(w.str());
}

DataHeader DataHeader::decode(ByteReader& r) {
  if (r.get<std::uint32_t>() != kDataMagic) throw InvalidArgument("data message with a bad magic");
  DataHeader h;
  const auto kind = r.get<std::uint8_t>();
  if (kind < 1 || kind > static_cast<std::uint8_t>(MsgKind::kPutFlagged)) {
    throw InvalidArgument("data message of unknown kind " + std::to_string(kind));
  }
  h.kind = static_cast<MsgKind>(kind);
  r.get<std::uint8_t>();
  r.get<std::uint16_t>();
  h.token = r.get<std::uint64_t>();
  h.target = r.get<std::uint64_t>();
  h.a = r.get<std::uint64_t>();
  h.b = r.get<std::uint64_t>();
  return h;
}

namespace {

struct Landing {
  std::function<void(bool)> done;
  std::shared_ptr<const void> keep;
};

void on_landed(void* request, ucs_status_t status, std::size_t, void* user_data) {
  auto* l = static_cast<Landing*>(user_data);
  l->done(status == UCS_OK);
  defer_release(std::move(l->keep));  // inside UCX: no memory or rkey release here
  delete l;
  ucp_request_free(request);
}

// Fire-and-forget sends (replies): the request is freed on completion.
void on_reply_sent(void* request, ucs_status_t status, void*) {
  if (status != UCS_OK && status != UCS_ERR_CANCELED) {
    TW_LOG_DEBUG("data reply not sent: %s", ucs_status_string(status));
  }
  ucp_request_free(request);
}

// A reply whose payload the send owns (a get's over UCX, which may read it after the send returns).
void on_owned_reply_sent(void* request, ucs_status_t status, void* user_data) {
  delete static_cast<std::string*>(user_data);
  on_reply_sent(request, status, nullptr);
}

void send_reply(const ReplyPath& to, const DataHeader& h, const void* payload, std::size_t length) {
  if (to.conn) {
    try {
      to.conn->send(h.encode(), payload, length, nullptr, /*reply=*/true);
    } catch (const Error& e) {
      TW_LOG_DEBUG("data reply not sent: %s", e.what());
    }
    return;
  }
  if (!to.ep) return;
  ucs_status_ptr_t p = post_message(to.ep, h.encode(), payload, length, nullptr, on_reply_sent, nullptr);
  if (UCS_PTR_IS_ERR(p)) TW_LOG_DEBUG("data reply not sent: %s", ucs_status_string(UCS_PTR_STATUS(p)));
}

}  // namespace

std::string LaneIntro::encode() const {
  ByteWriter w;
  w.put<std::uint32_t>(kMagic);
  w.put<std::uint16_t>(version);
  w.put<std::uint16_t>(worker);
  w.put<std::uint32_t>(lane);
  w.put<std::uint64_t>(token);
  return std::move(w.str());
}

bool LaneIntro::decode(const char* header, std::size_t length, LaneIntro* out) {
  if (length != kSize) return false;
  ByteReader r(header, length, "lane introduction");
  if (r.get<std::uint32_t>() != kMagic) return false;
  out->version = r.get<std::uint16_t>();
  out->worker = r.get<std::uint16_t>();
  out->lane = r.get<std::uint32_t>();
  out->token = r.get<std::uint64_t>();
  return true;
}

Incoming::~Incoming() = default;  // an untaken payload is dropped (by UCX, or read and discarded by the socket)

void Incoming::receive_into(void* dst, ucp_mem_h memh, std::function<void(bool)> done, std::shared_ptr<const void> keep,
                            std::shared_ptr<net::LandingGuard> guard) {
  taken_ = true;
  const bool gpu = length_ && cuda::in_use() && cuda::query(dst).device;
  if (frame_) {
    if (gpu) {
      // A socket reads into host memory: GPU memory takes it from a bounce buffer.
      auto bounce = std::make_shared<std::string>(length_, '\0');
      frame_->land(bounce->data(),
                   [dst, bounce, guard, done = std::move(done), keep = std::move(keep)](bool ok) mutable {
                     if (ok) {
                       std::unique_lock<std::mutex> lock;
                       if (guard) lock = std::unique_lock<std::mutex>(guard->mu);
                       ok = !guard || !guard->discard;
                       if (ok) cuda::copy(dst, bounce->data(), bounce->size());
                     }
                     done(ok);
                     defer_release(std::move(keep));
                   });
      return;
    }
    frame_->land(
        dst,
        [done = std::move(done), keep = std::move(keep)](bool ok) mutable {
          done(ok);
          defer_release(std::move(keep));
        },
        std::move(guard));
    return;
  }
  if (rendezvous_ && guard) {
    // UCX lands a rendezvous when it likes, past any guard: it lands in a
    // bounce buffer, copied out under the guard.
    auto bounce = std::make_shared<std::string>(length_, '\0');
    receive_into(
        bounce->data(), nullptr,
        [dst, gpu, bounce, guard, done = std::move(done)](bool ok) {
          if (ok) {
            std::lock_guard<std::mutex> lock(guard->mu);
            ok = !guard->discard;
            if (ok && gpu) cuda::copy(dst, bounce->data(), bounce->size());
            if (ok && !gpu) std::memcpy(dst, bounce->data(), bounce->size());
          }
          done(ok);
        },
        std::move(keep));
    return;
  }
  if (!rendezvous_) {
    // An eager payload is in host memory; GPU memory takes it by the driver.
    if (length_ && cuda::in_use() && cuda::query(dst).device) {
      cuda::copy(dst, data_, length_);
    } else if (length_) {
      std::memcpy(dst, data_, length_);
    }
    done(true);
    defer_release(std::move(keep));
    return;
  }
  auto* landing = new Landing{std::move(done), std::move(keep)};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = on_landed;
  param.user_data = landing;
  if (memh) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }
  ucs_status_ptr_t p = ucp_am_recv_data_nbx(worker_, data_, dst, length_, &param);
  if (p == nullptr || UCS_PTR_IS_ERR(p)) {
    landing->done(p == nullptr);
    defer_release(std::move(landing->keep));
    delete landing;
  }
}

#if !TW_UCX_HAS_AM_COPY_HEADER
namespace {

// UCX before 1.14 reads the header of a pending send until it completes: the
// send carries its own copy, freed after the caller's callback.
struct HeldHeader {
  std::string header;
  ucp_send_nbx_callback_t cb;
  void* user_data;
};

void on_held_sent(void* request, ucs_status_t status, void* user_data) {
  auto* held = static_cast<HeldHeader*>(user_data);
  held->cb(request, status, held->user_data);
  delete held;
}

}  // namespace
#endif

ucs_status_ptr_t post_message(ucp_ep_h ep, const std::string& header, const void* payload, std::size_t length,
                              ucp_mem_h memh, ucp_send_nbx_callback_t cb, void* user_data, bool eager) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = cb;
  param.user_data = user_data;
  if (memh) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }
#if TW_UCX_HAS_AM_COPY_HEADER
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER | (eager ? UCP_AM_SEND_FLAG_EAGER : 0);
  return ucp_am_send_nbx(ep, kDataAmId, header.data(), header.size(), payload, length, &param);
#else
  param.flags = UCP_AM_SEND_FLAG_REPLY | (eager ? UCP_AM_SEND_FLAG_EAGER : 0);
  auto* held = new HeldHeader{header, cb, user_data};
  param.cb.send = on_held_sent;
  param.user_data = held;
  ucs_status_ptr_t p =
      ucp_am_send_nbx(ep, kDataAmId, held->header.data(), held->header.size(), payload, length, &param);
  if (!UCS_PTR_IS_PTR(p)) delete held;  // done at once or failed: no callback comes
  return p;
#endif
}

// ---- DeviceImpl: tables of the message form ----

std::uint64_t DeviceImpl::add_message_op(const MessageOp& op) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  const std::uint64_t op_id = next_op_id_++;
  message_ops_.emplace(op_id, op);
  return op_id;
}

bool DeviceImpl::take_message_op(std::uint64_t op_id, const Peer* from, MessageOp* out) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  auto it = message_ops_.find(op_id);
  if (it == message_ops_.end() || it->second.peer != from) return false;  // only the asked peer answers
  *out = it->second;
  message_ops_.erase(it);
  return true;
}

void DeviceImpl::drop_message_ops(const Peer* peer, const std::string& why) {
  std::vector<MessageOp> dropped;
  {
    std::lock_guard<std::mutex> lock(msg_mu_);
    for (auto it = message_ops_.begin(); it != message_ops_.end();) {
      if (!peer || it->second.peer == peer) {
        dropped.push_back(it->second);
        it = message_ops_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& op : dropped) {
    op.state->complete_error(ErrorKind::kPeerFailed, why);
    op.ops->settle_message(op.state, UCS_ERR_CONNECTION_RESET);
  }
}

std::uint64_t DeviceImpl::add_sink(std::weak_ptr<MessageSink> sink) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  const std::uint64_t sink_id = next_sink_id_++;
  sinks_.emplace(sink_id, std::move(sink));
  return sink_id;
}

void DeviceImpl::remove_sink(std::uint64_t sink_id) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  sinks_.erase(sink_id);
}

std::shared_ptr<MessageSink> DeviceImpl::message_sink(std::uint64_t sink_id) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  auto it = sinks_.find(sink_id);
  return it == sinks_.end() ? nullptr : it->second.lock();
}

void DeviceImpl::register_token(std::uint64_t token, const std::shared_ptr<Peer>& peer) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  by_token_[token] = peer;
}

void DeviceImpl::forget_token(std::uint64_t token) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  by_token_.erase(token);
  departed_tokens_.push_back(token);
  if (departed_tokens_.size() > kDepartedTokens) departed_tokens_.pop_front();
}

bool DeviceImpl::departed(std::uint64_t token) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  return std::find(departed_tokens_.begin(), departed_tokens_.end(), token) != departed_tokens_.end();
}

std::shared_ptr<Peer> DeviceImpl::peer_by_token(std::uint64_t token) {
  std::lock_guard<std::mutex> lock(msg_mu_);
  auto it = by_token_.find(token);
  if (it == by_token_.end()) return nullptr;
  auto peer = it->second.lock();
  if (!peer) by_token_.erase(it);
  return peer;
}

void DeviceImpl::refuse_message(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  refuse_message_v(fmt, ap);
  va_end(ap);
}

void DeviceImpl::refuse_message_v(const char* fmt, va_list ap) {
  const std::uint64_t n = message_refusals_.fetch_add(1) + 1;
  if (n > 16 && (n & (n - 1)) != 0) return;  // the first 16, then every power of two
  char buf[512];
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  TW_LOG_WARN("refused a data message (%llu so far): %s", static_cast<unsigned long long>(n), buf);
}

// ---- DeviceImpl: what outlives a data message's handler ----

std::uint64_t DeviceImpl::add_landing(std::uint64_t start, std::uint64_t end, std::uint64_t flag_at,
                                      std::shared_ptr<net::LandingGuard> guard) {
  std::lock_guard<std::mutex> lock(landings_mu_);
  const std::uint64_t id = next_landing_++;
  landings_.emplace(id, Landing{start, end, flag_at, std::move(guard)});
  return id;
}

void DeviceImpl::end_landing(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(landings_mu_);
  landings_.erase(id);
}

std::size_t DeviceImpl::live_landings() const {
  std::lock_guard<std::mutex> lock(landings_mu_);
  return landings_.size() + queued_replies_.size();
}

void DeviceImpl::send_memory_reply(const ReplyPath& to, const DataHeader& h, const void* payload, std::size_t length) {
  if (length && cuda::in_use() && cuda::query(payload).device) {
    // A socket or an unregistered UCX send reads host memory: a copy, owned by the send.
    auto* copy = new std::string(length, '\0');
    cuda::copy(copy->data(), payload, length);
    if (to.conn) {
      std::shared_ptr<std::string> owned(copy);
      try {
        to.conn->send(h.encode(), owned->data(), length, [owned]() -> net::SendDone { return [owned](bool) {}; }, true);
      } catch (const Error& e) {
        TW_LOG_DEBUG("data reply not sent: %s", e.what());
      }
      return;
    }
    if (!to.ep) {
      delete copy;
      return;
    }
    ucs_status_ptr_t p = post_message(to.ep, h.encode(), copy->data(), length, nullptr, on_owned_reply_sent, copy);
    if (!UCS_PTR_IS_PTR(p)) delete copy;
    return;
  }
  if (to.conn) {
    // What the socket takes now is read under hold_grants; what it queues
    // is registered, and copied out by revoke_grants if the memory goes
    // before the socket sent it.
    const auto start = reinterpret_cast<std::uint64_t>(payload);
    std::weak_ptr<DeviceImpl> weak_dev = weak_from_this();
    std::weak_ptr<net::Conn> weak_conn = to.conn;
    try {
      to.conn->send(
          h.encode(), payload, length,
          [&]() -> net::SendDone {
            std::uint64_t id;
            {
              std::lock_guard<std::mutex> lock(landings_mu_);
              id = next_landing_++;
              queued_replies_.emplace(id, QueuedReply{start, start + length, weak_conn});
            }
            return [weak_dev, id](bool) {
              if (auto dev = weak_dev.lock()) {
                {
                  std::lock_guard<std::mutex> lock(dev->landings_mu_);
                  dev->queued_replies_.erase(id);
                }
                defer_release(std::move(dev));
              }
            };
          },
          /*reply=*/true);
    } catch (const Error& e) {
      TW_LOG_DEBUG("data reply not sent: %s", e.what());
    }
    return;
  }
  if (!to.ep) return;
  // UCX may read a payload after the send returned (a rendezvous): a copy, owned by the send.
  auto* copy = new std::string(static_cast<const char*>(payload), length);
  ucs_status_ptr_t p = post_message(to.ep, h.encode(), copy->data(), length, nullptr, on_owned_reply_sent, copy);
  if (!UCS_PTR_IS_PTR(p)) delete copy;
}

// ---- DeviceImpl: the receiving side of data messages ----

void DeviceImpl::on_data_message(int worker_index, const void* header, std::size_t header_length, Incoming& payload,
                                 const ReplyPath& reply_ep, const Peer* bound) {
  const std::size_t length = payload.length();
  ByteReader r(header, header_length, "data message");
  DataHeader h;
  try {
    h = DataHeader::decode(r);
  } catch (const Error& e) {
    refuse_message("%s", e.what());
    return;
  }
  std::shared_ptr<Peer> from = peer_by_token(h.token);
  if (!from) {
    refuse_message("a data message from an unknown peer (kind %d)", static_cast<int>(h.kind));
    return;
  }
  if (from->failed()) {
    // Normal when a peer leaves: what it sent before its end is still
    // buffered here (its ops failed with it). Counted, not logged.
    message_refusals_.fetch_add(1);
    TW_LOG_DEBUG("a data message from %s, which failed (kind %d)", from->describe().c_str(), static_cast<int>(h.kind));
    return;
  }
  if (bound && from.get() != bound) {
    refuse_message("a data message on %s's tcp lane carries another peer's token (kind %d)", bound->describe().c_str(),
                   static_cast<int>(h.kind));
    return;
  }
  switch (h.kind) {
    case MsgKind::kPut:
    case MsgKind::kPutFlagged: {
      DataHeader done{MsgKind::kPutDone, from->hello.data_token, h.target, 0,
                      static_cast<std::uint64_t>(AccessStatus::kOk)};
      const bool flagged = h.kind == MsgKind::kPutFlagged;
      const bool answered = !flagged || h.target != kUnanswered;
      std::uint64_t flag = 0;
      bool flag_ok = true;
      if (flagged) {
        try {
          flag = r.get<std::uint64_t>();
        } catch (const Error&) {
          flag_ok = false;
        }
        // The flag is a word a waiter polls: aligned, and exported like the data.
        flag_ok = flag_ok && h.b % 8 == 0 && from->granted(h.b, 8);
      }
      // The target checks the ranges against what it exported to this peer
      // before any byte lands (contracts §11), and no byte lands once that
      // grant ended (hold_grants): an eager payload lands under the lock, a
      // streamed one under a guard that revoke_grants calls off.
      auto access = hold_grants();
      if (!from->granted(h.a, length) || !flag_ok) {
        access.unlock();
        refuse_message("%s wrote %zu bytes at 0x%llx%s, outside what was exported to it", from->describe().c_str(),
                       length, static_cast<unsigned long long>(h.a), flagged ? " and a flag" : "");
        done.b = static_cast<std::uint64_t>(AccessStatus::kNotExported);
        if (answered) send_reply(reply_ep, done, nullptr, 0);
        return;
      }
      std::shared_ptr<net::LandingGuard> guard;
      std::uint64_t landing = 0;
      if (!payload.immediate()) {
        guard = std::make_shared<net::LandingGuard>();
        landing = add_landing(h.a, h.a + length, flagged ? h.b : ~std::uint64_t(0), guard);
      }
      std::weak_ptr<DeviceImpl> weak_dev = weak_from_this();
      // The reply of a put that landed in place waits for the worker's next
      // flush point (WorkerCtl::defer): a waiter that drove this handler
      // returns to its caller first, and the caller's next message (a
      // ping-pong's answer) leaves before the reply. Sent at once it cost the
      // one-way trip a send (torch.distributed's 8 B send/recv over tcp).
      // Inline progress has no thread that would flush it: sent at once there.
      WorkerCtl* worker = workers[worker_index].get();
      std::weak_ptr<Peer> peer = from;
      payload.receive_into(
          reinterpret_cast<void*>(h.a), nullptr,
          [reply_ep, done, flagged, answered, at = h.b, flag, worker, peer, guard, landing, weak_dev](bool ok) mutable {
            // After the payload: a waiter that sees the flag sees every byte
            // before it. Under the guard: its grant may have ended meanwhile
            // (an immediate landing runs inside hold_grants).
            if (ok && flagged) {
              std::unique_lock<std::mutex> lock;
              if (guard) lock = std::unique_lock<std::mutex>(guard->mu);
              ok = !guard || !guard->discard;
              if (ok) __atomic_store_n(reinterpret_cast<std::uint64_t*>(at), flag, __ATOMIC_RELEASE);
            }
            if (landing) {
              if (auto dev = weak_dev.lock()) {
                dev->end_landing(landing);
                defer_release(std::move(dev));
              }
            }
            if (!ok) done.b = static_cast<std::uint64_t>(AccessStatus::kFailed);
            if (!answered) return;
            if (!ok || worker->mode() == ProgressMode::kInline) {
              send_reply(reply_ep, done, nullptr, 0);
              return;
            }
            worker->defer([reply_ep, done, peer] {
              auto p = peer.lock();
              if (p && !p->failed()) send_reply(reply_ep, done, nullptr, 0);
            });
          },
          nullptr, std::move(guard));
      return;
    }
    case MsgKind::kGet: {
      DataHeader reply{MsgKind::kGetData, from->hello.data_token, h.target, 0,
                       static_cast<std::uint64_t>(AccessStatus::kOk)};
      auto access = hold_grants();
      if (!from->granted(h.a, h.b)) {
        access.unlock();
        refuse_message("%s read %llu bytes at 0x%llx, outside what was exported to it", from->describe().c_str(),
                       static_cast<unsigned long long>(h.b), static_cast<unsigned long long>(h.a));
        reply.b = static_cast<std::uint64_t>(AccessStatus::kNotExported);
        send_reply(reply_ep, reply, nullptr, 0);
        return;
      }
      send_memory_reply(reply_ep, reply, reinterpret_cast<const void*>(h.a), h.b);
      return;
    }
    case MsgKind::kPutDone:
    case MsgKind::kGetData: {
      MessageOp op;
      if (!take_message_op(h.target, from.get(), &op)) {
        refuse_message("%s answered an operation it was not asked (id %llu)", from->describe().c_str(),
                       static_cast<unsigned long long>(h.target));
        return;
      }
      const auto status = static_cast<AccessStatus>(h.b);
      if (status != AccessStatus::kOk) {
        op.state->complete_error(
            status == AccessStatus::kNotExported ? ErrorKind::kInvalidArgument : ErrorKind::kConnection,
            std::string(h.kind == MsgKind::kPutDone ? "write" : "read") + " refused by " + from->describe() +
                (status == AccessStatus::kNotExported ? ": the range is not one it exported to this device"
                                                      : ": the target could not place the data"));
        op.ops->settle_message(op.state, UCS_OK);
        return;
      }
      if (h.kind == MsgKind::kPutDone) {
        op.ops->settle_message(op.state, UCS_OK);
        return;
      }
      if (length != op.length) {
        op.state->complete_error(ErrorKind::kProtocolMismatch, "read: " + from->describe() + " sent " +
                                                                   std::to_string(length) + " bytes for " +
                                                                   std::to_string(op.length));
        op.ops->settle_message(op.state, UCS_OK);
        return;
      }
      RequestState* state = op.state;
      PendingOps* ops = op.ops;
      payload.receive_into(
          op.dest, op.memh, [state, ops](bool ok) { ops->settle_message(state, ok ? UCS_OK : UCS_ERR_IO_ERROR); },
          nullptr);
      return;
    }
    default: {
      std::shared_ptr<MessageSink> sink = message_sink(h.target);
      if (!sink) {
        // Normal at teardown (a release for a sender just dropped): counted, not logged.
        message_refusals_.fetch_add(1);
        TW_LOG_DEBUG("a data message for sink %llu, which does not exist (kind %d)",
                     static_cast<unsigned long long>(h.target), static_cast<int>(h.kind));
        return;
      }
      try {
        sink->on_message(from, h, r, payload, worker_index);
      } catch (const std::exception& e) {
        refuse_message("%s", e.what());
      }
      defer_release(std::move(sink));  // the last reference may free memory: not inside UCX
      return;
    }
  }
}

// ---- DeviceImpl: tcp lanes ----

bool DeviceImpl::accept_lane(const std::shared_ptr<net::Conn>& conn, const char* header, std::size_t length) {
  LaneIntro intro;
  if (!LaneIntro::decode(header, length, &intro)) return false;
  const std::uint16_t mine = config.protocol_version ? config.protocol_version : control::kProtocolVersion;
  std::shared_ptr<Peer> peer = peer_by_token(intro.token);
  std::string why;
  if (intro.version != mine) {
    why = "protocol version mismatch (v" + std::to_string(intro.version) + ", this device speaks v" +
          std::to_string(mine) + ")";
  } else if (intro.worker >= workers.size()) {
    why = "no worker " + std::to_string(intro.worker) + " here";
  }
  if (why.empty() && ((peer && peer->failed()) || (!peer && departed(intro.token)))) {
    // A lane its peer dialled just before it left, read after its control
    // connection closed: nothing to refuse, nobody to serve.
    TW_LOG_DEBUG("closed a tcp lane from %s: its peer has left", conn->name().c_str());
    conn->close("its peer has left");
    return true;
  }
  if (why.empty() && !peer) {
    // A peer may dial a lane right after answering our HELLO, and this
    // thread may read the lane before the reply: a token our pending HELLO
    // gave is parked (out of every poller) until the reply registers it.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [c, pending] : connecting_) {
      if (!peer && pending.token == intro.token && !pending.peer) {
        auto& parked = parked_lanes_[intro.token];
        if (parked.size() >= kMaxParkedLanes) break;
        parked.push_back({conn, static_cast<int>(intro.worker), intro.lane});
        conns_.erase(conn.get());
        conn->move_to(nullptr, {}, {});
        return true;
      }
    }
    why = "its token names no connected peer";
  }
  if (!why.empty()) {
    refusals_.fetch_add(1);
    TW_LOG_WARN("refused a tcp lane from %s: %s", conn->name().c_str(), why.c_str());
    conn->close("lane refused: " + why);
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns_.erase(conn.get());  // a data lane now, not a control connection
  }
  auto [on_frame, on_close] = lane_handlers(intro.worker, peer);
  conn->move_to(&workers[intro.worker]->sockets(), std::move(on_frame), std::move(on_close));
  peer->add_inbound_lane(intro.lane, intro.worker, conn);
  return true;
}

std::pair<net::FrameHandler, net::CloseHandler> DeviceImpl::lane_handlers(int worker_index,
                                                                          const std::shared_ptr<Peer>& peer) {
  std::weak_ptr<DeviceImpl> weak_dev = weak_from_this();
  std::weak_ptr<Peer> weak_peer = peer;
  net::FrameHandler on_frame = [weak_dev, weak_peer, worker_index](const std::shared_ptr<net::Conn>& conn,
                                                                   const char* header, std::size_t length,
                                                                   net::Payload& frame) {
    auto dev = weak_dev.lock();
    auto from = weak_peer.lock();
    if (!dev || !from || dev->closed()) return;  // a payload nobody lands is read and dropped
    Incoming payload(frame);
    try {
      dev->on_data_message(worker_index, header, length, payload, ReplyPath{nullptr, conn}, from.get());
    } catch (const std::exception& e) {
      TW_LOG_WARN("dropping a data message: %s", e.what());
    }
    defer_release(std::move(dev));
  };
  net::CloseHandler on_close = [weak_peer](const std::shared_ptr<net::Conn>& conn, const std::string& why) {
    if (auto p = weak_peer.lock())
      p->fail(ErrorKind::kPeerFailed, "tcp lane to " + p->describe() + " closed: " + why,
              /*calls_too=*/false);
  };
  return {std::move(on_frame), std::move(on_close)};
}

}  // namespace tensorwire::detail
