// Copyright tensorwire authors.
//
// The control plane's messages (DeviceImpl, core/device_impl.h): sending and
// replying, control_call, decoding and dispatching what arrives (LOOKUP,
// CALL, PING, replies), the call dispatcher and liveness threads, and the
// name registry (publish, on_call). Connections and HELLO are in
// core/connect.cc; the wire format in core/control_wire.h.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <thread>

#include "common/log.h"
#include "core/device_impl.h"
#include "core/waiter.h"

namespace tensorwire::detail {

namespace {

// Lanes a peer may ask us to dial (control::kLaneCall): as many as it may dial to us (Peer's inbound bound).
constexpr std::uint32_t kMaxRequestedLane = 1024;

ErrorKind kind_of(control::Status s) {
  switch (s) {
    case control::Status::kNotFound: return ErrorKind::kNotFound;
    case control::Status::kVersionMismatch: return ErrorKind::kProtocolMismatch;
    case control::Status::kTokenMismatch: return ErrorKind::kConnection;
    case control::Status::kBadMessage: return ErrorKind::kInvalidArgument;
    case control::Status::kInvalidArgument: return ErrorKind::kInvalidArgument;
    case control::Status::kIdentityRefused: return ErrorKind::kConnection;
    case control::Status::kNoHello: return ErrorKind::kConnection;
    default: return ErrorKind::kGeneric;
  }
}

}  // namespace

void DeviceImpl::send(const std::shared_ptr<net::Conn>& conn, const control::Header& h, const std::string& body,
                      bool is_reply) {
  if (!conn) throw ConnectionError("control connection is closed");
  std::string msg = control::encode(h, body);
  if (msg.size() > control::kMaxMessage) {
    throw InvalidArgument("control message of " + std::to_string(msg.size()) + " bytes exceeds the 1 MiB limit");
  }
  conn->send(msg, nullptr, 0, nullptr, is_reply);  // a header-only frame; queued when the socket is full
}

void DeviceImpl::reply(const std::shared_ptr<net::Conn>& conn, const control::Header& request, control::MsgType type,
                       control::Status status, const std::string& body) {
  control::Header h;
  h.type = type;
  h.request_id = request.request_id;
  h.status = status;
  if (config.protocol_version) h.version = config.protocol_version;
  try {
    send(conn, h, body, /*is_reply=*/true);
  } catch (const Error& e) {
    TW_LOG_DEBUG("cannot reply to a control message: %s", e.what());
  }
}

std::string DeviceImpl::control_call(const std::shared_ptr<Peer>& peer, control::MsgType type, const std::string& body,
                                     double timeout_s) {
  check_open();
  if (peer->failed()) throw PeerFailed(peer->describe() + " has failed");
  auto* state = new RequestState(nullptr, 2);  // one ref here, one in pending_
  std::uint64_t rid;
  {
    std::lock_guard<std::mutex> lock(mu_);
    do {
      rid = request_ids_();
    } while (rid == 0 || pending_.count(rid));
    pending_[rid] = PendingCall{state, peer->control_conn.get()};
  }
  auto cleanup = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.erase(rid)) state->release();
  };
  try {
    control::Header h;
    h.type = type;
    h.request_id = rid;
    if (config.protocol_version) h.version = config.protocol_version;
    send(peer->control_conn, h, body);
    double left = timeout_s;
    if (config.progress == ProgressMode::kInline) {
      // Nobody else moves an inline device's data workers, and the peer's
      // handler may need them while we wait (a slot attach connects a data
      // endpoint back to us over tcp, which our worker must accept). The
      // reply itself completes on the control worker, which raises no event
      // on theirs: watch naps.
      Drivers drivers;
      for (auto& w : workers) drivers.add(w.get());
      const auto deadline = deadline_after(timeout_s);
      wait_for(drivers, [&] { return state->finished(); }, [] { return false; }, deadline, WaitPolicy{});
      if (timeout_s >= 0) {
        left = std::max(0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
      }
    }
    state->wait(left);
  } catch (...) {
    cleanup();
    state->release();
    throw;
  }
  cleanup();
  std::string out = std::move(state->payload);
  state->release();
  return out;
}

void DeviceImpl::fail_pending_control(const net::Conn* conn, ErrorKind kind, const std::string& why) {
  std::vector<RequestState*> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rid, call] : pending_) {
      if (call.conn == conn) {
        call.state->retain();
        failed.push_back(call.state);
      }
    }
  }
  for (auto* s : failed) {
    s->complete_error(kind, why);
    s->release();
  }
}

std::shared_ptr<Peer> DeviceImpl::peer_on(const net::Conn* conn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_by_conn_.find(conn);
  return it == peers_by_conn_.end() ? nullptr : it->second;
}

void DeviceImpl::on_message(const std::shared_ptr<net::Conn>& conn, const void* data, std::size_t length) {
  ByteReader r(data, length, "control message");
  control::Header h = control::decode_header(r);  // throws (message dropped) on a bad magic or type
  if (auto peer = peer_on(conn.get())) peer->heard();
  try {
    dispatch(conn, h, r);
  } catch (const std::exception& e) {
    // A request we cannot decode gets a clear error instead of a timeout.
    control::MsgType reply_type;
    switch (h.type) {
      case control::MsgType::kHello: reply_type = control::MsgType::kHelloReply; break;
      case control::MsgType::kLookup: reply_type = control::MsgType::kLookupReply; break;
      case control::MsgType::kCall: reply_type = control::MsgType::kCallReply; break;
      default: throw;
    }
    reply(conn, h, reply_type, control::Status::kBadMessage, std::string("malformed request: ") + e.what());
  }
}

void DeviceImpl::dispatch(const std::shared_ptr<net::Conn>& conn, const control::Header& h, ByteReader& r) {
  switch (h.type) {
    case control::MsgType::kHello: handle_hello(conn, h, r); return;
    case control::MsgType::kHelloReply:
    case control::MsgType::kLookupReply:
    case control::MsgType::kCallReply: {
      RequestState* state = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(h.request_id);
        if (it == pending_.end()) return;  // the caller gave up (timeout)
        if (it->second.conn != conn.get()) {
          // An answer to a call that went to another connection: another peer's to give.
          refusals_.fetch_add(1);
          TW_LOG_WARN("dropped a reply from %s to a call it was not sent", conn->name().c_str());
          return;
        }
        state = it->second.state;
        state->retain();
      }
      std::string body = r.get_n(r.left());
      if (h.status == control::Status::kOk && h.type == control::MsgType::kHelloReply) {
        std::lock_guard<std::mutex> lock(mu_);
        auto c = connecting_.find(conn.get());
        if (c != connecting_.end()) {
          try {
            register_connected(conn.get(), c->second, body);
          } catch (const Error& e) {
            c->second.refused = std::string("bad HELLO reply: ") + e.what();
          }
        }
      }
      if (h.status == control::Status::kOk) {
        state->payload = std::move(body);
        state->complete_ok();
      } else {
        state->complete_error(kind_of(h.status), body);
      }
      state->release();
      return;
    }
    case control::MsgType::kPing: reply(conn, h, control::MsgType::kPong, control::Status::kOk, ""); return;
    case control::MsgType::kPong: return;  // heard() above is all it is for
    case control::MsgType::kLookup: {
      auto asker = peer_on(conn.get());
      if (!asker) {
        reply(conn, h, control::MsgType::kLookupReply, control::Status::kNoHello,
              "LOOKUP before HELLO: this connection has not introduced itself");
        return;
      }
      std::string name = r.get_n(r.left());
      std::string body;
      control::Status status = control::Status::kOk;
      std::optional<RegionDescriptor> found;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = published_.find(name);
        if (it == published_.end()) {
          status = control::Status::kNotFound;
          body = "no region named '" + name + "' is published on " + address;
        } else {
          found = it->second;
        }
      }
      if (found) body = export_for(*found, *asker).to_bytes();
      reply(conn, h, control::MsgType::kLookupReply, status, body);
      return;
    }
    case control::MsgType::kCall: {
      std::string name = r.get_bytes16();
      std::string payload = r.get_bytes32();
      // The caller is who said HELLO on this connection, whatever the payload claims.
      auto caller = peer_on(conn.get());
      if (!caller) {
        reply(conn, h, control::MsgType::kCallReply, control::Status::kNoHello,
              "CALL before HELLO: this connection has not introduced itself");
        return;
      }
      if (name == control::kLaneCall) {
        // Built in: the peer that accepted this connection asks us, its
        // dialer, for a lane. Answered at once; the dial goes in a thread of
        // its own, off the control thread and the dispatcher (whose handler
        // may be waiting for this very lane on the other side).
        control::Status status = control::Status::kOk;
        std::string out;
        try {
          ByteReader lr(payload.data(), payload.size(), "lane call");
          const std::uint32_t lane = lr.get<std::uint32_t>();
          if (lr.left() != 0 || lane >= kMaxRequestedLane) {
            throw InvalidArgument("a lane call for lane " + std::to_string(lane) + " (lanes are 0.." +
                                  std::to_string(kMaxRequestedLane - 1) + ")");
          }
          if (caller->accepted) throw InvalidArgument("a lane call from a peer we did not dial");
          std::thread([caller, lane] {
            try {
              caller->channel(static_cast<int>(lane));
            } catch (const std::exception& e) {
              TW_LOG_DEBUG("lane %u to %s, asked for by it: %s", lane, caller->describe().c_str(), e.what());
            }
          }).detach();
        } catch (const Error& e) {
          status = control::Status::kInvalidArgument;
          out = e.what();
        }
        reply(conn, h, control::MsgType::kCallReply, status, out);
        return;
      }
      if (name == control::kClaimCall) {
        // Built in: a device we are connected to asks whether a connection
        // claiming our id is ours (handle_hello). Ours: a connect of ours
        // waiting for its HELLO reply, whose HELLO carried this token.
        bool ours = false;
        if (payload.size() == 8) {
          ByteReader cr(payload.data(), payload.size(), "claim call");
          const std::uint64_t token = cr.get<std::uint64_t>();
          std::lock_guard<std::mutex> lock(mu_);
          for (const auto& [c, pending] : connecting_) ours = ours || (pending.token == token && !pending.peer);
        }
        reply(conn, h, control::MsgType::kCallReply, ours ? control::Status::kOk : control::Status::kInvalidArgument,
              ours ? "" : "no connection of this device carries that token");
        return;
      }
      if (name == control::kExportCall) {
        // Built in and never blocks: answered here, without the dispatcher's thread hop.
        control::Status status = control::Status::kOk;
        std::string out;
        try {
          caller->accept_export(RegionDescriptor::from_bytes(payload.data(), payload.size()));
        } catch (const Error& e) {
          status = control::Status::kInvalidArgument;
          out = e.what();
        }
        reply(conn, h, control::MsgType::kCallReply, status, out);
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back([this, conn, h, caller, name = std::move(name), payload = std::move(payload)] {
        CallFn handler;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = handlers_.find(name);
          if (it != handlers_.end()) handler = it->second;
        }
        control::Status status = control::Status::kOk;
        std::string out;
        if (!handler) {
          status = control::Status::kNotFound;
          out = "no call handler named '" + name + "' on " + address;
        } else {
          try {
            out = handler(caller, payload);
          } catch (const Error& e) {
            // A refusal keeps its kind across the wire; other failures are the handler's.
            status = e.kind() == ErrorKind::kInvalidArgument ? control::Status::kInvalidArgument
                     : e.kind() == ErrorKind::kNotFound      ? control::Status::kNotFound
                                                             : control::Status::kHandlerError;
            out = e.kind() == ErrorKind::kInvalidArgument
                      ? std::string(e.what())
                      : std::string("call handler '") + name + "' failed: " + e.what();
          } catch (const std::exception& e) {
            status = control::Status::kHandlerError;
            out = std::string("call handler '") + name + "' failed: " + e.what();
          }
          if (out.size() > control::kMaxMessage - 64) {
            status = control::Status::kHandlerError;
            out = "the reply of call handler '" + name + "' (" + std::to_string(out.size()) +
                  " bytes) exceeds the 1 MiB control-message limit";
          }
        }
        control::Header rh;
        rh.type = control::MsgType::kCallReply;
        rh.request_id = h.request_id;
        rh.status = status;
        if (config.protocol_version) rh.version = config.protocol_version;
        try {
          send(conn, rh, out, /*is_reply=*/true);
        } catch (const std::exception& e) {
          TW_LOG_WARN("cannot send a call reply: %s", e.what());
        }
      });
      jobs_cv_.notify_one();
      return;
    }
  }
}

void DeviceImpl::dispatcher_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    jobs_cv_.wait(lock, [&] { return stop_dispatcher_ || !jobs_.empty(); });
    if (stop_dispatcher_) return;
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
}

void DeviceImpl::liveness_loop() {
  // Ping a quiet peer a few times per bound: a stopped process keeps its
  // sockets (the kernel answers tcp keepalive for it), only it never replies.
  const auto tick = std::chrono::duration<double>(config.liveness_s / 4);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_dispatcher_) {
    liveness_cv_.wait_for(lock, tick, [&] { return stop_dispatcher_; });
    if (stop_dispatcher_) return;
    std::vector<std::shared_ptr<Peer>> peers;
    for (auto& [pid, p] : peers_) {
      if (!p->failed()) peers.push_back(p);
    }
    lock.unlock();
    for (auto& p : peers) {
      const double quiet = p->silent_s();
      if (quiet > config.liveness_s) {
        char why[96];
        std::snprintf(why, sizeof(why), " has not answered for %.1f s (stopped or hung; liveness_s=%.1f)", quiet,
                      config.liveness_s);
        p->fail(ErrorKind::kPeerFailed, p->describe() + why);
      } else if (quiet >= tick.count()) {
        try {
          control::Header ping;
          ping.type = control::MsgType::kPing;
          if (config.protocol_version) ping.version = config.protocol_version;
          send(p->control_conn, ping, "");
        } catch (const Error& e) {
          TW_LOG_DEBUG("cannot ping %s: %s", p->describe().c_str(), e.what());
        }
      }
    }
    lock.lock();
  }
}

void DeviceImpl::publish(const std::string& name, const RegionDescriptor& d) {
  check_open();
  if (name.empty() || name.size() > 1024) throw InvalidArgument("region names must be 1..1024 bytes");
  std::lock_guard<std::mutex> lock(mu_);
  published_[name] = d;
}

void DeviceImpl::unpublish(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  published_.erase(name);
}

void DeviceImpl::on_call(const std::string& name, CallFn handler) {
  check_open();
  if (name.empty()) throw InvalidArgument("call handler names must not be empty");
  std::lock_guard<std::mutex> lock(mu_);
  if (handler) {
    handlers_[name] = std::move(handler);
  } else {
    handlers_.erase(name);
  }
}

}  // namespace tensorwire::detail
