// Copyright tensorwire authors.
#include <dirent.h>
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "common/log.h"
#include "core/bulk_copy.h"
#include "core/device_impl.h"
#include "core/waiter.h"

namespace tensorwire {
namespace detail {

namespace {

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::uint64_t process_start_time() {
  // Field 22 of /proc/self/stat; the command name (field 2) may hold spaces.
  std::string stat = read_first_line("/proc/self/stat");
  auto pos = stat.rfind(')');
  if (pos == std::string::npos) return 0;
  std::istringstream is(stat.substr(pos + 2));
  std::string field;
  for (int i = 3; i <= 22 && is >> field; ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

std::uint64_t random_id() {
  std::random_device rd;
  std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  return v ? v : 1;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0;
}

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

bool has_rdma_devices() {
  DIR* d = opendir("/sys/class/infiniband");
  if (!d) return false;
  bool any = false;
  while (dirent* e = readdir(d)) any = any || e->d_name[0] != '.';
  closedir(d);
  return any;
}

std::vector<std::pair<std::string, std::string>> data_overrides(const DeviceConfig& c) {
  auto o = ucx::transport_overrides(c.transport);
  // Measured on loopback tcp (2 vCPUs): 4 MiB socket buffers lift 1 MiB
  // writes from ~1.65 to ~2.5 GB/s (bench/results/tcp_tuning.md).
  o.emplace_back("?TCP_SNDBUF", "4M");
  o.emplace_back("?TCP_RCVBUF", "4M");
  // UCX estimates cma at 11 GB/s and so writes everything above ~4 KiB with
  // a process_vm_writev syscall, even into pool slabs that shared memory maps.
  // Measured here, a plain memcpy into the mapping is 2-3x faster up to our
  // large-block size (static-slot transfer at 64 KiB: 9.5 -> 4.3 us; at 256
  // KiB: 27.5 -> 9.4 us). Large blocks are not mapped: cma stays their path.
  o.emplace_back("?CMA_BW", "4000MBps");
  // A message's large payload goes by UCX's rendezvous (core/messages.h).
  // Over tcp UCX's default scheme copies fragments in and out: ~1 GB/s here.
  // put_zcopy lands the bytes from the socket in the buffer the receiver
  // named: 4-5 GB/s (bench/results/lane_forms_tcp.txt). From 32 KiB: below
  // UCX's own threshold (~270 KiB) a 256 KiB tensor took 215 us as copied
  // eager fragments and 85 us by rendezvous. Only without RDMA devices: over
  // verbs slots keep their one-sided form and UCX's own choices stand.
  if (!has_rdma_devices()) {
    o.emplace_back("?RNDV_SCHEME", "put_zcopy");
    o.emplace_back("?RNDV_THRESH", "32K");
  }
  if (c.net_devices == "auto") {
    // A device bound to loopback talks over loopback, unless the user chose.
    if (is_loopback(c.host) && !std::getenv("UCX_NET_DEVICES")) o.emplace_back("NET_DEVICES", "lo");
  } else if (!c.net_devices.empty()) {
    o.emplace_back("NET_DEVICES", c.net_devices);
  }
  return o;
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

// The data workers' message handler: its argument is owned by the worker.
struct DataArg {
  std::weak_ptr<DeviceImpl> device;
  int worker_index;
};

ucs_status_t on_data_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                        const ucp_am_recv_param_t* param) {
  auto* a = static_cast<DataArg*>(arg);
  auto dev = a->device.lock();
  if (!dev) return UCS_OK;
  if (!dev->closed()) {
    try {
      dev->on_data_message(a->worker_index, header, header_length, data, length, param);
    } catch (const std::exception& e) {
      TW_LOG_WARN("dropping a data message: %s", e.what());
    }
  }
  defer_release(std::move(dev));  // never the last reference inside UCX
  return UCS_OK;
}

void on_conn_request(ucp_conn_request_h request, void* arg) {
  if (auto dev = device_of(arg)) dev->on_connection_request(request);
}

void on_control_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  if (auto dev = device_of(arg)) dev->on_control_error(ep, status);
}

// Control sends are fire-and-forget: the callback owns the message and the request.
void on_am_sent(void* request, ucs_status_t status, void* user_data) {
  delete static_cast<std::string*>(user_data);
  ucp_request_free(request);
  if (status != UCS_OK && status != UCS_ERR_CANCELED) {
    TW_LOG_DEBUG("control message not sent: %s", ucs_status_string(status));
  }
}

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

DeviceImpl::DeviceImpl(const DeviceConfig& c) : config(c) {
  if (config.workers < 1 || config.workers > 256) {
    throw InvalidArgument("workers must be in 1..256, got " + std::to_string(config.workers));
  }
  if (config.slab_size < 4096) throw InvalidArgument("slab_size must be at least 4096 bytes");
  if (config.connect_timeout_s <= 0) throw InvalidArgument("connect_timeout_s must be > 0");
  if (config.keepalive_s <= 0) throw InvalidArgument("keepalive_s must be > 0");
  if (!(config.liveness_s > 0)) throw InvalidArgument("liveness_s must be > 0");
  if (const char* map = std::getenv("TENSORWIRE_MAP_SHARED_MEMORY")) {
    // Lets a user compare with UCX's own shared-memory path without code changes.
    config.map_shared_memory = std::string(map) != "0";
  }
  // Progress policy from the environment: tune a program without editing it.
  if (const char* mode = std::getenv("TENSORWIRE_PROGRESS")) {
    const std::string m(mode);
    if (m == "blocking") config.progress = ProgressMode::kBlocking;
    else if (m == "polling") config.progress = ProgressMode::kPolling;
    else if (m == "inline") config.progress = ProgressMode::kInline;
    else throw InvalidArgument("TENSORWIRE_PROGRESS must be blocking, polling or inline, got '" + m + "'");
  }
  if (const char* spin = std::getenv("TENSORWIRE_SPIN_US")) {
    char* end = nullptr;
    unsigned long v = std::strtoul(spin, &end, 10);
    if (!*spin || *end || v > 1000000) {
      throw InvalidArgument(std::string("TENSORWIRE_SPIN_US must be 0..1000000 microseconds, got '") + spin + "'");
    }
    config.spin_us = static_cast<unsigned>(v);
  }
  streaming_copy_min_from_env();  // a bad TENSORWIRE_STREAMING_COPY_MIN fails here, not at a copy
  if (const char* forms = std::getenv("TENSORWIRE_LANE_FORM")) {
    // auto (default), rma or messages; a comma list gives lane i the form i % n.
    std::string f(forms);
    std::size_t at = 0;
    while (at <= f.size()) {
      std::size_t end = f.find(',', at);
      if (end == std::string::npos) end = f.size();
      const std::string one = f.substr(at, end - at);
      if (one == "auto") lane_forms.push_back(LaneForm::kAuto);
      else if (one == "rma") lane_forms.push_back(LaneForm::kRma);
      else if (one == "messages") lane_forms.push_back(LaneForm::kMessages);
      else throw InvalidArgument("TENSORWIRE_LANE_FORM must be auto, rma or messages, or a comma list of them; got '" + f + "'");
      at = end + 1;
    }
  }
  id = random_id();
  self_proof_ = std::to_string(random_id()) + std::to_string(random_id());
  boot_id_ = read_first_line("/proc/sys/kernel/random/boot_id");
  start_time_ = process_start_time();
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  hostname_ = host;

  data_context = std::make_shared<ucx::Context>(data_overrides(config), UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | UCP_FEATURE_RMA,
                                                 "tensorwire");
  // The control plane always runs over tcp with peer error handling: it is
  // what detects a dead peer, whatever the data transport is.
  std::vector<std::pair<std::string, std::string>> ctl{{"TLS", "tcp"}};
  if (is_loopback(config.host)) ctl.emplace_back("NET_DEVICES", "lo");
  char keepalive[32];
  std::snprintf(keepalive, sizeof(keepalive), "%.3fs", config.keepalive_s);
  ctl.emplace_back("KEEPALIVE_INTERVAL", keepalive);
  control_context = std::make_shared<ucx::Context>(ctl, UCP_FEATURE_AM | UCP_FEATURE_WAKEUP, "tensorwire-control");

  for (int i = 0; i < config.workers; ++i) {
    workers.push_back(std::make_shared<WorkerCtl>(std::make_shared<ucx::Worker>(data_context), config.progress,
                                                  config.spin_us, "tw-progress-" + std::to_string(i)));
  }
  // The control worker always has its own blocking thread: control messages
  // must be answered even when the data path runs inline.
  control_worker = std::make_shared<WorkerCtl>(std::make_shared<ucx::Worker>(control_context),
                                               ProgressMode::kBlocking, 50, "tw-control");
  control_worker->enable_progress_guard();  // see connect()
  exact_export_ = data_context->has_hardware_keys();
  if (const char* exact = std::getenv("TENSORWIRE_EXACT_EXPORT")) {
    // Forces it either way: tests of the exact path on machines without RDMA.
    const std::string e(exact);
    if (e != "0" && e != "1") throw InvalidArgument("TENSORWIRE_EXACT_EXPORT must be 0 or 1, got '" + e + "'");
    exact_export_ = e == "1";
  }
  pool_impl = std::make_shared<PoolImpl>(data_context, id, config.slab_size, config.pool_limit,
                                         config.map_shared_memory && data_context->has_shared_memory());
  pool = std::make_unique<MemoryPool>(pool_impl);
}

DeviceImpl::~DeviceImpl() { close(); }

void DeviceImpl::start() {
  auto arg = std::make_shared<ControlArg>(ControlArg{weak_from_this()});
  control_worker->worker()->keep_until_destroyed(arg);
  control_arg_ = arg.get();
  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = control::kAmId;
  am.cb = on_am;
  am.arg = control_arg_;
  ucx::check(ucp_worker_set_am_recv_handler(control_worker->get(), &am), "ucp_worker_set_am_recv_handler");
  for (std::size_t i = 0; i < workers.size(); ++i) {
    auto data_arg = std::make_shared<DataArg>(DataArg{weak_from_this(), static_cast<int>(i)});
    workers[i]->worker()->keep_until_destroyed(data_arg);
    ucp_am_handler_param_t dm{};
    dm.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    dm.id = kDataAmId;
    dm.cb = on_data_am;
    dm.arg = data_arg.get();
    dm.flags = UCP_AM_FLAG_WHOLE_MSG;
    ucx::check(ucp_worker_set_am_recv_handler(workers[i]->get(), &dm), "ucp_worker_set_am_recv_handler (data)");
  }

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

  for (auto& w : workers) w->start();
  control_worker->start();
  dispatcher_ = std::thread([this] { dispatcher_loop(); });
  liveness_ = std::thread([this] { liveness_loop(); });
}

void DeviceImpl::check_open() const {
  if (closed()) throw ConnectionError("device is closed");
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

void DeviceImpl::send(const std::shared_ptr<ucx::Endpoint>& ep, const control::Header& h, const std::string& body) {
  if (!ep || !ep->get()) throw ConnectionError("control connection is closed");
  auto* msg = new std::string(control::encode(h, body));
  if (msg->size() > control::kMaxMessage) {
    const std::size_t total = msg->size();
    delete msg;
    throw InvalidArgument("control message of " + std::to_string(total) + " bytes exceeds the 1 MiB limit");
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_am_sent;
  param.user_data = msg;
  param.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t ptr = ucp_am_send_nbx(ep->get(), control::kAmId, nullptr, 0, msg->data(), msg->size(), &param);
  if (ptr == nullptr) {
    delete msg;
  } else if (UCS_PTR_IS_ERR(ptr)) {
    delete msg;
    ucx::check(UCS_PTR_STATUS(ptr), "control message send");
  }
  control_worker->wake();
}

std::shared_ptr<ucx::Endpoint> DeviceImpl::endpoint_for(ucp_ep_h ep) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = endpoints_.find(ep);
  return it == endpoints_.end() ? nullptr : it->second;
}

void DeviceImpl::reply(ucp_ep_h ep, const control::Header& request, control::MsgType type, control::Status status,
                       const std::string& body) {
  auto endpoint = endpoint_for(ep);
  if (!endpoint) {
    TW_LOG_WARN("cannot reply to a control message: unknown endpoint");
    return;
  }
  control::Header h;
  h.type = type;
  h.request_id = request.request_id;
  h.status = status;
  if (config.protocol_version) h.version = config.protocol_version;
  send(endpoint, h, body);
}

std::string DeviceImpl::control_call(const std::shared_ptr<Peer>& peer, control::MsgType type,
                                     const std::string& body, double timeout_s,
                                     std::unique_lock<std::mutex>* release_after_send) {
  check_open();
  if (peer->failed()) throw PeerFailed(peer->describe() + " has failed");
  auto* state = new RequestState(nullptr, 2);  // one ref here, one in pending_
  std::uint64_t rid;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rid = next_request_id_++;
    pending_[rid] = PendingCall{state, peer->control_ep.get()};
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
    send(peer->control_ep, h, body);
    if (release_after_send) release_after_send->unlock();
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
    if (release_after_send && release_after_send->owns_lock()) release_after_send->unlock();
    cleanup();
    state->release();
    throw;
  }
  cleanup();
  std::string out = std::move(state->payload);
  state->release();
  return out;
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

void DeviceImpl::fail_pending_control(const ucx::Endpoint* ep, ErrorKind kind, const std::string& why) {
  std::vector<RequestState*> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rid, call] : pending_) {
      if (call.ep == ep) {
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

std::shared_ptr<Peer> DeviceImpl::peer_on(ucp_ep_h ep) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_by_ep_.find(ep);
  return it == peers_by_ep_.end() ? nullptr : it->second;
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

void DeviceImpl::on_message(ucp_ep_h ep, const void* data, std::size_t length) {
  ByteReader r(data, length, "control message");
  control::Header h = control::decode_header(r);  // throws (message dropped) on a bad magic or type
  if (auto peer = peer_on(ep)) peer->heard();
  try {
    dispatch(ep, h, r);
  } catch (const std::exception& e) {
    // A request we cannot decode gets a clear error instead of a timeout.
    control::MsgType reply_type;
    switch (h.type) {
      case control::MsgType::kHello: reply_type = control::MsgType::kHelloReply; break;
      case control::MsgType::kLookup: reply_type = control::MsgType::kLookupReply; break;
      case control::MsgType::kCall: reply_type = control::MsgType::kCallReply; break;
      default: throw;
    }
    reply(ep, h, reply_type, control::Status::kBadMessage, std::string("malformed request: ") + e.what());
  }
}

void DeviceImpl::dispatch(ucp_ep_h ep, const control::Header& h, ByteReader& r) {
  switch (h.type) {
    case control::MsgType::kHello:
      handle_hello(ep, h, r);
      return;
    case control::MsgType::kHelloReply:
    case control::MsgType::kLookupReply:
    case control::MsgType::kCallReply: {
      RequestState* state = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(h.request_id);
        if (it == pending_.end()) return;  // the caller gave up (timeout)
        state = it->second.state;
        state->retain();
      }
      std::string body = r.get_n(r.left());
      if (h.status == control::Status::kOk && h.type == control::MsgType::kHelloReply) {
        std::lock_guard<std::mutex> lock(mu_);
        auto c = connecting_.find(ep);
        if (c != connecting_.end()) {
          try {
            register_connected(ep, c->second, body);
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
    case control::MsgType::kPing:
      reply(ep, h, control::MsgType::kPong, control::Status::kOk, "");
      return;
    case control::MsgType::kPong:
      return;  // heard() above is all it is for
    case control::MsgType::kLookup: {
      auto asker = peer_on(ep);
      if (!asker) {
        reply(ep, h, control::MsgType::kLookupReply, control::Status::kNoHello,
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
      reply(ep, h, control::MsgType::kLookupReply, status, body);
      return;
    }
    case control::MsgType::kCall: {
      std::string name = r.get_bytes16();
      std::string payload = r.get_bytes32();
      auto endpoint = endpoint_for(ep);
      if (!endpoint) return;
      // The caller is who said HELLO on this connection, whatever the payload claims.
      auto caller = peer_on(ep);
      if (!caller) {
        reply(ep, h, control::MsgType::kCallReply, control::Status::kNoHello,
              "CALL before HELLO: this connection has not introduced itself");
        return;
      }
      if (name == kExportCall) {
        // Built in and never blocks: answered here, without the dispatcher's thread hop.
        control::Status status = control::Status::kOk;
        std::string out;
        try {
          caller->accept_export(RegionDescriptor::from_bytes(payload.data(), payload.size()));
        } catch (const Error& e) {
          status = control::Status::kInvalidArgument;
          out = e.what();
        }
        reply(ep, h, control::MsgType::kCallReply, status, out);
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back([this, endpoint, h, caller, name = std::move(name), payload = std::move(payload)] {
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
            out = e.kind() == ErrorKind::kInvalidArgument ? std::string(e.what())
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
          send(endpoint, rh, out);
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
          send(p->control_ep, ping, "");
        } catch (const Error& e) {
          TW_LOG_DEBUG("cannot ping %s: %s", p->describe().c_str(), e.what());
        }
      }
    }
    lock.lock();
  }
}

RegionDescriptor DeviceImpl::export_for(RegionDescriptor d, Peer& to) {
  // What a message-form write or read from `to` may reach (messages.cc).
  if (d.device_id == id) to.grant(d.address, d.length);
  if (!exact_export_ || d.device_id != id || d.length == 0) return d;
  // A same-host peer with shared memory gets the slab's key, whose mapping
  // is its direct path; it checks every use against our export (Peer::
  // remote_region, RemoteRegionImpl::access_for), and is on our host anyway.
  if (to.info.same_host && config.map_shared_memory && data_context->has_shared_memory()) return d;
  d.rkey = pool_impl->exact_rkey(reinterpret_cast<const void*>(d.address), d.length);
  return d;
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

std::shared_ptr<Peer> DeviceImpl::peer_by_id(std::uint64_t pid) {
  check_open();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(pid);
  if (it == peers_.end()) throw NotFound("no connected peer with device id " + std::to_string(pid));
  return it->second;
}

std::vector<PeerInfo> DeviceImpl::peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerInfo> out;
  for (auto& [pid, p] : peers_) {
    if (!p->failed()) out.push_back(p->info);
  }
  return out;
}

PeerInfo DeviceImpl::wait_for_peer(double timeout_s) {
  check_open();
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] { return !new_peers_.empty() || closed(); };
  if (no_deadline(timeout_s)) {
    peer_cv_.wait(lock, ready);
  } else if (!peer_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
    throw Timeout("no peer connected within " + std::to_string(timeout_s) + " s");
  }
  if (closed()) throw ConnectionError("device is closed");
  auto pid = new_peers_.front();
  new_peers_.pop_front();
  return peers_.at(pid)->info;
}

unsigned DeviceImpl::progress() {
  unsigned n = 0;
  for (auto& w : workers) n += w->progress();
  return n;
}

void DeviceImpl::close() {
  if (closed_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_dispatcher_ = true;
  }
  jobs_cv_.notify_all();
  peer_cv_.notify_all();
  liveness_cv_.notify_all();
  if (dispatcher_.joinable()) dispatcher_.join();
  if (liveness_.joinable()) liveness_.join();
  std::map<std::uint64_t, std::shared_ptr<Peer>> peers;
  std::map<ucp_ep_h, std::shared_ptr<ucx::Endpoint>> endpoints;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers.swap(peers_);
    endpoints.swap(endpoints_);
    peers_by_ep_.clear();
  }
  for (auto& [pid, p] : peers) p->fail(ErrorKind::kConnection, "device is closed");
  for (auto& [h, ep] : endpoints) fail_pending_control(ep.get(), ErrorKind::kConnection, "device is closed");
  drop_message_ops(nullptr, "device is closed");
  if (listener_) {
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
  }
  // Graceful close of control endpoints lets peers see the disconnect now.
  for (auto& [h, ep] : endpoints) ep->close(false);
  for (auto& w : workers) w->stop();
  control_worker->stop();
  drain_deferred_releases();
}

std::string DeviceImpl::describe() const {
  std::ostringstream os;
  os << "address: " << address << "\n";
  os << "device id: 0x" << std::hex << id << std::dec << "\n";
  os << "workers: " << workers.size() << ", progress: "
     << (config.progress == ProgressMode::kPolling ? "polling"
         : config.progress == ProgressMode::kBlocking ? "blocking"
                                                     : "inline")
     << "\n";
  os << "data transports (UCX_TLS): " << data_context->transports() << "\n";
  os << "control transports: " << control_context->transports() << "\n";
  char* buf = nullptr;
  size_t size = 0;
  if (FILE* f = open_memstream(&buf, &size)) {
    ucp_context_print_info(data_context->get(), f);
    std::fclose(f);
    os << std::string(buf, size);
    std::free(buf);
  }
  return os.str();
}

}  // namespace detail

// ---- public Device ----

Device::Device(const DeviceConfig& config) : impl_(std::make_shared<detail::DeviceImpl>(config)) { impl_->start(); }
Device::~Device() {
  try {
    impl_->close();
  } catch (const std::exception& e) {
    TW_LOG_WARN("error while closing a device: %s", e.what());
  }
}
std::string Device::address() const { return impl_->address; }
std::uint64_t Device::id() const { return impl_->id; }
const DeviceConfig& Device::config() const { return impl_->config; }
MemoryPool& Device::pool() {
  impl_->check_open();
  return *impl_->pool;
}
void Device::publish(const std::string& name, const RegionDescriptor& region) { impl_->publish(name, region); }
void Device::unpublish(const std::string& name) { impl_->unpublish(name); }
void Device::on_call(const std::string& name, CallHandler handler) {
  if (!handler) return impl_->on_call(name, nullptr);
  impl_->on_call(name, [h = std::move(handler)](const std::shared_ptr<detail::Peer>&, const std::string& payload) {
    return h(payload);
  });
}
void Device::on_peer_call(const std::string& name, PeerCallHandler handler) {
  if (!handler) return impl_->on_call(name, nullptr);
  impl_->on_call(name, [h = std::move(handler)](const std::shared_ptr<detail::Peer>& caller,
                                                const std::string& payload) { return h(caller->hello.device_id, payload); });
}
Channel Device::connect(const std::string& address, int lane) { return Channel(impl_->connect(address)->channel(lane)); }
Channel Device::channel_to(std::uint64_t peer_device_id, int lane) {
  return Channel(impl_->peer_by_id(peer_device_id)->channel(lane));
}
std::vector<PeerInfo> Device::peers() const { return impl_->peers(); }
PeerInfo Device::wait_for_peer(double timeout_s) { return impl_->wait_for_peer(timeout_s); }
unsigned Device::progress() { return impl_->progress(); }
void Device::close() { impl_->close(); }
bool Device::closed() const { return impl_->closed(); }
std::string Device::describe() const { return impl_->describe(); }
std::uint64_t Device::refusals() const { return impl_->refusal_count(); }

std::string ucx_version() { return ucp_get_version_string(); }
std::string ucx_header_version() {
  return std::to_string(UCP_API_MAJOR) + "." + std::to_string(UCP_API_MINOR);
}
std::string ucx_library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ucp_init_version), &info) && info.dli_fname) return info.dli_fname;
  return "unknown";
}
std::uint16_t protocol_version() { return control::kProtocolVersion; }

}  // namespace tensorwire
