// Copyright tensorwire authors.
//
// The control plane's connections (DeviceImpl, core/device_impl.h): the
// listener, connect() and its HELLO, accepting a connection and answering its
// HELLO, control endpoint failures. Messages, calls and the name registry are
// in core/control_plane.cc.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "core/device_impl.h"

namespace tensorwire::detail {

namespace {

sockaddr_storage resolve(const std::string& host, std::uint16_t port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || !res) throw InvalidArgument("cannot resolve host '" + host + "': " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

std::pair<std::string, std::uint16_t> split_address(const std::string& address) {
  auto pos = address.rfind(':');
  if (pos == std::string::npos || pos == 0 || pos + 1 == address.size()) {
    throw InvalidArgument("address must be host:port, got '" + address + "'");
  }
  char* end = nullptr;
  unsigned long port = std::strtoul(address.c_str() + pos + 1, &end, 10);
  if (*end != '\0' || port == 0 || port > 65535) throw InvalidArgument("bad port in address '" + address + "'");
  return {address.substr(0, pos), static_cast<std::uint16_t>(port)};
}

// Callback arguments of the control worker: UCX may call them after the
// device is gone (endpoints held by users keep the worker alive), so they
// reach the device weakly and are owned by the worker.
struct ControlArg {
  std::weak_ptr<DeviceImpl> device;
};

std::shared_ptr<DeviceImpl> device_of(void* arg) { return static_cast<ControlArg*>(arg)->device.lock(); }

ucs_status_t on_am(void* arg, const void*, size_t, void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto dev = device_of(arg);
  if (!dev) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    TW_LOG_WARN("dropping a control message that arrived by rendezvous (%zu bytes)", length);
    return UCS_OK;
  }
  ucp_ep_h reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  try {
    dev->on_message(reply_ep, data, length);
  } catch (const std::exception& e) {
    TW_LOG_WARN("dropping a bad control message: %s", e.what());
  }
  return UCS_OK;
}

void on_conn_request(ucp_conn_request_h request, void* arg) {
  if (auto dev = device_of(arg)) dev->on_connection_request(request);
}

void on_control_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  if (auto dev = device_of(arg)) dev->on_control_error(ep, status);
}

}  // namespace

void DeviceImpl::listen() {
  auto arg = std::make_shared<ControlArg>(ControlArg{weak_from_this()});
  control_worker->worker()->keep_until_destroyed(arg);
  control_arg_ = arg.get();
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = control::kAmId;
  am.cb = on_am;
  am.arg = control_arg_;
  ucx::check(ucp_worker_set_am_recv_handler(control_worker->get(), &am), "ucp_worker_set_am_recv_handler");

  socklen_t len = 0;
  sockaddr_storage ss = resolve(config.host, config.port, &len);
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  lp.sockaddr.addrlen = len;
  lp.conn_handler.cb = on_conn_request;
  lp.conn_handler.arg = control_arg_;
  ucs_status_t st = ucp_listener_create(control_worker->get(), &lp, &listener_);
  if (st != UCS_OK) {
    throw ConnectionError("cannot listen on " + config.host + ":" + std::to_string(config.port) + ": " +
                              ucs_status_string(st),
                          st);
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  ucx::check(ucp_listener_query(listener_, &attr), "ucp_listener_query");
  char ip[INET6_ADDRSTRLEN] = {0};
  auto* sin = reinterpret_cast<sockaddr_in*>(&attr.sockaddr);
  inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof(ip));
  std::string host = ip;
  if (host == "0.0.0.0") host = hostname_;  // reachable name for peers
  address = host + ":" + std::to_string(ntohs(sin->sin_port));
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
  auto [host, port] = split_address(addr);
  std::lock_guard<std::mutex> connect_lock(connect_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [pid, peer] : peers_) {
      if (peer->hello.address == addr && !peer->failed()) return peer;
    }
  }
  socklen_t len = 0;
  sockaddr_storage ss = resolve(host, port, &len);
  const auto* sin = reinterpret_cast<const sockaddr_in*>(&ss);
  if (is_loopback(config.host) && (ntohl(sin->sin_addr.s_addr) >> 24) != 127) {
    // Both UCX contexts of a loopback device are limited to `lo`: say so
    // instead of UCX's "Destination is unreachable".
    throw InvalidArgument("cannot reach " + addr + " from a device listening on " + config.host +
                          " (loopback only): create the device with host= an address of this machine "
                          "that reaches " + host);
  }
  // Fix: hold the control worker's progress guard from ucp_ep_create until
  // the HELLO is sent. Otherwise the control thread may apply a refused
  // connection (nobody listening) in between, and UCX 1.22 then spins forever
  // in ucp_am_send_nbx on the failed, never wired-up endpoint, holding the
  // worker lock (seen 1 in ~5 connects to a closed port). With the guard the
  // HELLO is queued first and fails with the endpoint: ConnectionError.
  std::unique_lock<std::mutex> guard(control_worker->progress_guard());
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  params.sockaddr.addrlen = len;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_control_ep_error;
  params.err_handler.arg = control_arg_;
  ucp_ep_h handle = nullptr;
  ucs_status_t st = ucp_ep_create(control_worker->get(), &params, &handle);
  if (st != UCS_OK) throw ConnectionError("cannot connect to " + addr + ": " + ucs_status_string(st), st);
  auto ep = std::make_shared<ucx::Endpoint>(control_worker->worker(), handle);
  {
    std::lock_guard<std::mutex> lock(mu_);
    endpoints_[handle] = ep;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    connecting_[handle] = Connecting{addr, ep, nullptr, {}};
  }
  auto drop = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    endpoints_.erase(handle);
    connecting_.erase(handle);
  };
  // A provisional peer carries the endpoint through control_call.
  control::Hello unknown;
  unknown.address = addr;
  auto provisional = std::make_shared<Peer>(weak_from_this(), unknown, ep, false);
  control::Hello mine = my_hello();
  if (addr == address) mine.self_proof = self_proof_;  // a channel to this very device
  mine.data_token = random_id();
  {
    std::lock_guard<std::mutex> lock(mu_);
    connecting_[handle].token = mine.data_token;
  }
  std::string body;
  try {
    body = control_call(provisional, control::MsgType::kHello, control::encode_hello(mine),
                        config.connect_timeout_s, &guard);
  } catch (const Timeout&) {
    drop();
    throw ConnectionError("cannot connect to " + addr + ": no answer within " +
                          std::to_string(config.connect_timeout_s) + " s");
  } catch (const ProtocolMismatch& e) {
    drop();
    // Fix: close gracefully — the peer answered, so this is quick, and it
    // tells the peer; a forced close left the refused endpoint open on its
    // side until its close(), which then stalled 2 s on it.
    ep->close(false);
    throw ProtocolMismatch("connection to " + addr + " refused: " + e.what());
  } catch (const Error& e) {
    drop();
    ep->close(false);  // as above (token refusal); on a failed endpoint it returns at once
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
    auto c = connecting_.find(handle);
    if (c != connecting_.end()) {
      peer = c->second.peer;
      refused = c->second.refused;
      connecting_.erase(c);
    }
  }
  if (!peer) {
    drop();
    ep->close(false);  // outside mu_: closing progresses the worker
    throw ConnectionError("connection to " + addr + " refused: " + refused);
  }
  return peer;
}

void DeviceImpl::register_connected(ucp_ep_h handle, Connecting& c, const std::string& body) {
  ByteReader r(body.data(), body.size(), "HELLO reply");
  control::Hello hello = control::decode_hello(r);
  if (c.address == address) hello.self_proof = self_proof_;  // we asked ourselves: the reply is ours
  c.refused = identity_conflict(hello);
  if (!c.refused.empty()) return;
  bool same_host = hello.boot_id == boot_id_ && hello.hostname == hostname_;
  hello.address = c.address;  // the address we reached it at
  auto peer = std::make_shared<Peer>(weak_from_this(), std::move(hello), c.ep, same_host);
  peer->inbound_token = c.token;
  register_token(c.token, peer);
  c.peer = peer;
  if (peer->hello.device_id == id) {
    // A channel to this very device: calls arriving on the accepted end of
    // the connection come from this same peer (one export table, one channel).
    auto accepted = peers_.find(id);
    if (accepted != peers_.end() && accepted->second->hello.self_proof == self_proof_) {
      peers_by_ep_[accepted->second->control_ep->get()] = peer;
    }
  }
  peers_[peer->hello.device_id] = peer;
  peers_by_ep_[handle] = peer;
}

void DeviceImpl::on_connection_request(ucp_conn_request_h request) {
  if (closed()) {
    ucp_listener_reject(listener_, request);
    return;
  }
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_control_ep_error;
  params.err_handler.arg = control_arg_;
  ucp_ep_h handle = nullptr;
  ucs_status_t st = ucp_ep_create(control_worker->get(), &params, &handle);
  if (st != UCS_OK) {
    TW_LOG_WARN("cannot accept a connection: %s", ucs_status_string(st));
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  endpoints_[handle] = std::make_shared<ucx::Endpoint>(control_worker->worker(), handle);
}

void DeviceImpl::on_control_error(ucp_ep_h ep, ucs_status_t status) {
  std::shared_ptr<Peer> peer;
  std::shared_ptr<ucx::Endpoint> endpoint;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_by_ep_.find(ep);
    if (it != peers_by_ep_.end()) peer = it->second;
    auto e = endpoints_.find(ep);
    if (e != endpoints_.end()) endpoint = e->second;
  }
  if (peer) {
    std::string why = peer->describe() + " disconnected or died (" + ucs_status_string(status) + ")";
    peer->fail(ErrorKind::kPeerFailed, why);
    fail_pending_control(endpoint.get(), ErrorKind::kPeerFailed, why);
  } else if (endpoint) {
    fail_pending_control(endpoint.get(), ErrorKind::kConnection, ucs_status_string(status));
  }
}

void DeviceImpl::handle_hello(ucp_ep_h ep, const control::Header& h, ByteReader& r) {
  const std::uint16_t mine = config.protocol_version ? config.protocol_version : control::kProtocolVersion;
  // The version is checked before the body is decoded: another version may
  // lay HELLO out differently, and it must still get a clear refusal.
  if (h.version != mine) {
    std::string why = "protocol version mismatch: the peer speaks v" + std::to_string(h.version) +
                      ", this device (" + address + ") speaks v" + std::to_string(mine);
    TW_LOG_WARN("refused connection: %s", why.c_str());
    refusals_.fetch_add(1);
    reply(ep, h, control::MsgType::kHelloReply, control::Status::kVersionMismatch, why);
    return;
  }
  control::Hello hello = control::decode_hello(r);
  std::string who = hello.hostname + " (pid " + std::to_string(hello.pid) + ", " + hello.address + ")";
  if (hello.token != config.token) {
    std::string why = "token mismatch: peer " + who + " presented a wrong token";
    TW_LOG_WARN("refused connection: %s", why.c_str());
    refusals_.fetch_add(1);
    reply(ep, h, control::MsgType::kHelloReply, control::Status::kTokenMismatch, why);
    return;
  }
  auto endpoint = endpoint_for(ep);
  if (!endpoint) return;
  std::string conflict = identity_conflict(hello);
  if (!conflict.empty()) {
    TW_LOG_WARN("refused connection from %s: %s", who.c_str(), conflict.c_str());
    refusals_.fetch_add(1);
    reply(ep, h, control::MsgType::kHelloReply, control::Status::kIdentityRefused, conflict);
    return;
  }
  bool same_host = hello.boot_id == boot_id_ && hello.hostname == hostname_;
  auto peer = std::make_shared<Peer>(weak_from_this(), std::move(hello), endpoint, same_host);
  peer->inbound_token = random_id();
  register_token(peer->inbound_token, peer);
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Identity is per connection (peers_by_ep_): a second connection that
    // claims a live peer's id (the same device dialling back, or an
    // impostor) never takes over the first one's entry.
    auto& by_id = peers_[peer->hello.device_id];
    if (!by_id || by_id->failed()) by_id = peer;
    peers_by_ep_[ep] = peer;
    new_peers_.push_back(peer->hello.device_id);
  }
  peer_cv_.notify_all();
  control::Hello ours = my_hello();
  ours.data_token = peer->inbound_token;
  reply(ep, h, control::MsgType::kHelloReply, control::Status::kOk, control::encode_hello(ours));
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
