// Copyright tensorwire authors.
//
// The control plane's connections (DeviceImpl, core/device_impl.h): the
// listener, connect() and its HELLO, accepting a connection and answering its
// HELLO, a control connection's end. Every connection is tensorwire's own
// socket (net/socket.h): UCX's tcp transport would let a peer's packets write
// anywhere in this process (docs/contracts.md §11). Messages, calls and the
// name registry are in core/control_plane.cc.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "core/device_impl.h"

namespace tensorwire::detail {

namespace {

std::string describe_fd(int fd) {
  sockaddr_in sin{};
  socklen_t len = sizeof(sin);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sin), &len) != 0) return "an unknown peer";
  char ip[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &sin.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(sin.sin_port));
}

}  // namespace

void DeviceImpl::listen() {
  socklen_t len = 0;
  sockaddr_storage ss = net::resolve(config.host, config.port, &len);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw ConnectionError(std::string("cannot create the listening socket: ") + std::strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&ss), len) != 0 || ::listen(fd, 512) != 0) {
    const int err = errno;
    ::close(fd);
    throw ConnectionError("cannot listen on " + config.host + ":" + std::to_string(config.port) + ": " +
                          std::strerror(err));
  }
  sockaddr_in bound{};
  socklen_t blen = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  char ip[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &bound.sin_addr, ip, sizeof(ip));
  std::string host = ip;
  if (host == "0.0.0.0") host = hostname_;  // reachable name for peers
  address = host + ":" + std::to_string(ntohs(bound.sin_port));
  control_poller_ = std::make_unique<net::Poller>();
  control_poller_->listen(fd, [weak = weak_from_this()](int accepted) {
    if (auto dev = weak.lock()) {
      dev->on_accept(accepted);
    } else {
      ::close(accepted);
    }
  });
}

void DeviceImpl::control_loop() {
  // The control thread: accepts, reads and answers control messages, and
  // hands data lanes to their workers. Never blocks on anything but the
  // poller (calls run on the dispatcher's thread).
  while (!stop_control_.load(std::memory_order_acquire)) control_poller_->progress(100);
}

void DeviceImpl::on_accept(int fd) {
  auto conn = std::make_shared<net::Conn>(fd, "a connection from " + describe_fd(fd));
  if (closed()) return;  // conn's destructor closes the socket
  net::tune(fd, config.keepalive_s);
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns_[conn.get()] = conn;
  }
  std::weak_ptr<DeviceImpl> weak = weak_from_this();
  control_poller_->add(
      conn,
      [weak](const std::shared_ptr<net::Conn>& c, const char* header, std::size_t length, net::Payload& payload) {
        if (auto dev = weak.lock()) dev->on_first_frame(c, header, length, payload);
      },
      control_handlers().second);
}

std::pair<net::FrameHandler, net::CloseHandler> DeviceImpl::control_handlers() {
  std::weak_ptr<DeviceImpl> weak = weak_from_this();
  net::FrameHandler on_frame = [weak](const std::shared_ptr<net::Conn>& c, const char* header, std::size_t length,
                                      net::Payload&) {
    if (auto dev = weak.lock()) dev->on_message_logged(c, header, length);
  };
  net::CloseHandler on_close = [weak](const std::shared_ptr<net::Conn>& c, const std::string& why) {
    if (auto dev = weak.lock()) dev->on_control_closed(c, why);
  };
  return {std::move(on_frame), std::move(on_close)};
}

void DeviceImpl::on_message_logged(const std::shared_ptr<net::Conn>& conn, const void* data, std::size_t length) {
  try {
    on_message(conn, data, length);
  } catch (const std::exception& e) {
    TW_LOG_WARN("dropping a bad control message: %s", e.what());
  }
}

void DeviceImpl::add_control(const std::shared_ptr<net::Conn>& conn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns_[conn.get()] = conn;
  }
  auto [on_frame, on_close] = control_handlers();
  control_poller_->add(conn, std::move(on_frame), std::move(on_close));
}

void DeviceImpl::on_first_frame(const std::shared_ptr<net::Conn>& conn, const char* header, std::size_t length,
                                net::Payload& payload) {
  if (accept_lane(conn, header, length)) return;  // a data lane (core/messages.cc): moved to its worker
  // Anything else is the control plane: from now on every frame goes to on_message.
  auto [on_frame, on_close] = control_handlers();
  conn->move_to(control_poller_.get(), std::move(on_frame), std::move(on_close));
  on_message_logged(conn, header, length);
}

control::Hello DeviceImpl::my_hello() const {
  control::Hello h;
  h.device_id = id;
  h.pid = static_cast<std::uint32_t>(getpid());
  h.start_time = start_time_;
  h.boot_id = boot_id_;
  h.hostname = hostname_;
  h.address = address;
  h.token = config.token;
  for (auto& w : workers) h.workers.push_back(w->worker()->address());
  return h;
}

std::shared_ptr<Peer> DeviceImpl::connect(const std::string& addr) {
  check_open();
  auto [host, port] = net::split_address(addr);
  std::lock_guard<std::mutex> connect_lock(connect_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [pid, peer] : peers_) {
      if (peer->hello.address == addr && !peer->failed()) return peer;
    }
  }
  socklen_t len = 0;
  sockaddr_storage ss = net::resolve(host, port, &len);
  const auto* sin = reinterpret_cast<const sockaddr_in*>(&ss);
  if (is_loopback(config.host) && (ntohl(sin->sin_addr.s_addr) >> 24) != 127) {
    // A loopback device's data transports are limited to `lo`, and the peer
    // could not reach our address: say so instead of failing later.
    throw InvalidArgument("cannot reach " + addr + " from a device listening on " + config.host +
                          " (loopback only): create the device with host= an address of this machine "
                          "that reaches " +
                          host);
  }
  auto conn = net::Conn::dial(ss, len, addr, config.connect_timeout_s, config.keepalive_s);
  add_control(conn);
  auto drop = [&] {
    std::vector<ParkedLane> parked;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conns_.erase(conn.get());
      auto c = connecting_.find(conn.get());
      if (c != connecting_.end()) {
        auto p = parked_lanes_.find(c->second.token);
        if (p != parked_lanes_.end()) {
          parked.swap(p->second);
          parked_lanes_.erase(p);
        }
        connecting_.erase(c);
      }
    }
    for (auto& p : parked) p.conn->close("the connection it belongs to was refused");
  };
  // A provisional peer carries the connection through control_call.
  control::Hello unknown;
  unknown.address = addr;
  auto provisional = std::make_shared<Peer>(weak_from_this(), unknown, conn, false);
  control::Hello mine = my_hello();
  if (addr == address) mine.self_proof = self_proof_;  // a channel to this very device
  mine.data_token = random_id();
  {
    std::lock_guard<std::mutex> lock(mu_);
    connecting_[conn.get()] = Connecting{addr, conn, nullptr, {}, mine.data_token};
  }
  std::string body;
  try {
    body = control_call(provisional, control::MsgType::kHello, control::encode_hello(mine), config.connect_timeout_s);
  } catch (const Timeout&) {
    drop();
    conn->close("no HELLO reply");
    throw ConnectionError("cannot connect to " + addr + ": no answer within " +
                          std::to_string(config.connect_timeout_s) + " s");
  } catch (const ProtocolMismatch& e) {
    drop();
    conn->close("refused");
    throw ProtocolMismatch("connection to " + addr + " refused: " + e.what());
  } catch (const Error& e) {
    drop();
    conn->close("refused");
    if (e.kind() == ErrorKind::kConnection || e.kind() == ErrorKind::kPeerFailed) {
      throw ConnectionError("cannot connect to " + addr + ": " + e.what(), e.ucx_status());
    }
    throw;
  }
  // The control thread registered the peer when the reply arrived
  // (register_connected), before any message the peer sends right after it.
  std::shared_ptr<Peer> peer;
  std::string refused = "no HELLO reply";
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto c = connecting_.find(conn.get());
    if (c != connecting_.end()) {
      peer = c->second.peer;
      refused = c->second.refused;
      connecting_.erase(c);
    }
  }
  if (!peer) {
    drop();
    conn->close("refused");
    throw ConnectionError("connection to " + addr + " refused: " + refused);
  }
  return peer;
}

void DeviceImpl::register_connected(const net::Conn* handle, Connecting& c, const std::string& body) {
  ByteReader r(body.data(), body.size(), "HELLO reply");
  control::Hello hello = control::decode_hello(r);
  if (c.address == address) hello.self_proof = self_proof_;  // we asked ourselves: the reply is ours
  c.refused = identity_conflict(hello);
  if (!c.refused.empty()) return;
  bool same_host = hello.boot_id == boot_id_ && hello.hostname == hostname_;
  hello.address = c.address;  // the address we reached it at
  auto peer = std::make_shared<Peer>(weak_from_this(), std::move(hello), c.conn, same_host);
  peer->inbound_token = c.token;
  register_token(c.token, peer);
  c.peer = peer;
  // Lanes the peer dialled right after its reply, which this thread read first (parked by accept_lane).
  auto parked = parked_lanes_.find(c.token);
  if (parked != parked_lanes_.end()) {
    for (auto& p : parked->second) {
      auto [on_frame, on_close] = lane_handlers(p.worker, peer);
      workers[p.worker]->sockets().add(p.conn, std::move(on_frame), std::move(on_close));
      peer->add_inbound_lane(p.lane, p.worker, p.conn);
    }
    parked_lanes_.erase(parked);
  }
  if (peer->hello.device_id == id) {
    // A channel to this very device: calls arriving on the accepted end of
    // the connection come from this same peer (one export table, one channel).
    auto accepted = peers_.find(id);
    if (accepted != peers_.end() && accepted->second->hello.self_proof == self_proof_) {
      peers_by_conn_[accepted->second->control_conn.get()] = peer;
    }
  }
  peers_[peer->hello.device_id] = peer;
  peers_by_conn_[handle] = peer;
}

void DeviceImpl::on_control_closed(const std::shared_ptr<net::Conn>& conn, const std::string& why) {
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_by_conn_.find(conn.get());
    if (it != peers_by_conn_.end()) peer = it->second;
  }
  // The peer fails before it leaves the tables: whoever sees it gone from
  // peers() finds its channels failed too.
  if (peer) {
    forget_token(peer->inbound_token);
    std::string what = peer->describe() + " disconnected or died (" + why + ")";
    peer->fail(ErrorKind::kPeerFailed, what);
    fail_pending_control(conn.get(), ErrorKind::kPeerFailed, what);
  } else {
    fail_pending_control(conn.get(), ErrorKind::kConnection, "connection to " + conn->name() + " closed: " + why);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (peer) {
    // The tables forget the connection and its peer (which holds the
    // socket): kept, they held a descriptor and ~20 KiB per closed
    // connection, and a server stopped accepting at `ulimit -n`. A channel
    // or request of the user's still holds its peer, failed above.
    peers_by_conn_.erase(conn.get());
    auto by_id = peers_.find(peer->hello.device_id);
    if (by_id != peers_.end() && by_id->second == peer) {
      peers_.erase(by_id);
      std::erase(new_peers_, peer->hello.device_id);
    }
  }
  conns_.erase(conn.get());
}

void DeviceImpl::refuse_hello(const std::shared_ptr<net::Conn>& conn, const control::Header& h, control::Status status,
                              const std::string& who, const std::string& why) {
  TW_LOG_WARN("refused connection from %s: %s", who.c_str(), why.c_str());
  refusals_.fetch_add(1);
  reply(conn, h, control::MsgType::kHelloReply, status, why);
}

void DeviceImpl::handle_hello(const std::shared_ptr<net::Conn>& conn, const control::Header& h, ByteReader& r) {
  const std::uint16_t mine = config.protocol_version ? config.protocol_version : control::kProtocolVersion;
  // The version is checked before the body is decoded: another version may
  // lay HELLO out differently, and it must still get a clear refusal.
  if (h.version != mine) {
    std::string why = "protocol version mismatch: the peer speaks v" + std::to_string(h.version) + ", this device (" +
                      address + ") speaks v" + std::to_string(mine);
    TW_LOG_WARN("refused connection: %s", why.c_str());
    refusals_.fetch_add(1);
    reply(conn, h, control::MsgType::kHelloReply, control::Status::kVersionMismatch, why);
    return;
  }
  control::Hello hello = control::decode_hello(r);
  std::string who = hello.hostname + " (pid " + std::to_string(hello.pid) + ", " + hello.address + ")";
  if (hello.token != config.token) {
    refuse_hello(conn, h, control::Status::kTokenMismatch, who,
                 "token mismatch: peer " + who + " presented a wrong token");
    return;
  }
  std::string conflict = identity_conflict(hello);
  if (!conflict.empty()) {
    refuse_hello(conn, h, control::Status::kIdentityRefused, who, conflict);
    return;
  }
  // A device id that a live connection holds is that device's: a second
  // connection claiming it (the same device dialling again, under another
  // address, or an impostor that learned the id from the device's own HELLO)
  // is admitted only if the holder vouches for it: asked over its own
  // connection, it confirms the data token of this HELLO as one of its own
  // pending connects (kClaimCall). Asked from the dispatcher: the answer
  // comes through the control thread.
  std::shared_ptr<Peer> holder;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(hello.device_id);
    if (it != peers_.end() && !it->second->failed() && it->second->control_conn != conn &&
        !(hello.device_id == id && hello.self_proof == self_proof_)) {
      holder = it->second;
    }
  }
  if (!holder) {
    admit_hello(conn, h, std::move(hello));
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.push_back([this, conn, h, hello = std::move(hello), holder, who]() mutable {
    ByteWriter arg;
    arg.put<std::uint64_t>(hello.data_token);
    ByteWriter body;
    body.put_bytes16(control::kClaimCall);
    body.put_bytes32(arg.str());
    std::string why;
    try {
      control_call(holder, control::MsgType::kCall, body.str(), config.connect_timeout_s);
    } catch (const std::exception& e) {
      // A holder that failed meanwhile (its connection ended) holds the id no more.
      if (holder->failed()) {
        admit_hello(conn, h, std::move(hello));
        return;
      }
      char id_hex[24];
      std::snprintf(id_hex, sizeof(id_hex), "0x%llx", static_cast<unsigned long long>(hello.device_id));
      why = std::string("device id ") + id_hex + " is held by a live connection (" + holder->describe() +
            "), which did not vouch for this one: " + e.what();
    }
    if (!why.empty()) {
      refuse_hello(conn, h, control::Status::kIdentityRefused, who, why);
      return;
    }
    admit_hello(conn, h, std::move(hello));
  });
  jobs_cv_.notify_one();
}

void DeviceImpl::admit_hello(const std::shared_ptr<net::Conn>& conn, const control::Header& h, control::Hello hello) {
  if (conn->closed()) return;
  bool same_host = hello.boot_id == boot_id_ && hello.hostname == hostname_;
  auto peer = std::make_shared<Peer>(weak_from_this(), std::move(hello), conn, same_host);
  peer->accepted = true;
  peer->inbound_token = random_id();
  register_token(peer->inbound_token, peer);
  control::Hello ours = my_hello();
  ours.data_token = peer->inbound_token;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Identity is per connection (peers_by_conn_): a second connection that
    // claims a live peer's id (vouched for by it) never takes over the first one's entry.
    auto& by_id = peers_[peer->hello.device_id];
    if (!by_id || by_id->failed()) by_id = peer;
    peers_by_conn_[conn.get()] = peer;
    new_peers_.push_back(peer->hello.device_id);
    // The reply is queued under the lock that finds the peer: a thread here
    // that finds it (channel_to) and sends a LOOKUP at once cannot overtake
    // the reply on this connection (the dialer would refuse the LOOKUP:
    // seen as "LOOKUP before HELLO"). Sending does not block.
    reply(conn, h, control::MsgType::kHelloReply, control::Status::kOk, control::encode_hello(ours));
  }
  peer_cv_.notify_all();
}

std::string DeviceImpl::identity_conflict(const control::Hello& claimed) {
  auto hex = [](std::uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
    return std::string(buf);
  };
  if (claimed.device_id == 0) return "device id 0 is not a device";
  if (claimed.device_id == id && claimed.self_proof != self_proof_) {
    return "the peer claims this device's own id " + hex(id);
  }
  return "";
}

}  // namespace tensorwire::detail
