// Copyright tensorwire authors.
//
// DeviceImpl (core/device_impl.h): configuration, the contexts, workers and
// pool, the data workers' message handler, start and close, the peer table,
// and the public Device. The control plane is in core/connect.cc and
// core/control_plane.cc.
#include <dirent.h>
#include <dlfcn.h>
#include <net/if.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "common/log.h"
#include "core/bulk_copy.h"
#include "core/device_impl.h"
#include "core/transport_policy.h"
#include "cuda/driver.h"
#include "ucx/features.h"

namespace tensorwire {
namespace detail {

std::uint64_t random_id() {
  std::random_device rd;
  std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  return v ? v : 1;
}

bool is_loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0; }

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
  // A device's tcp lanes are its own sockets (net/socket.h), never UCX's tcp,
  // whose target carries out a put or get at whatever address a peer's
  // packet names (docs/contracts.md §11). UCX keeps what needs no network:
  // registration, the channel to this very device (self), CUDA copies; and
  // under auto every other transport, unless UCX_TLS says otherwise.
  for (auto& [key, value] : o) {
    if (key == "TLS" && c.transport == "tcp") value = value == "tcp" ? "self" : "self,cuda_copy";
  }
  if (c.transport == "auto") o.emplace_back("?TLS", "^tcp");
  // tcp socket buffers stay the kernel's (autotuned): fixed 4 MiB ones kept
  // megabytes queued per flow, which the receiver then copied out of cold
  // cache (bench/results/tcp_tuning.md).
  // UCX estimates cma at 11 GB/s and so writes everything above ~4 KiB with
  // a process_vm_writev syscall, even into pool slabs that shared memory maps.
  // Measured here, a plain memcpy into the mapping is 2-3x faster up to our
  // large-block size (static-slot transfer at 64 KiB: 9.5 -> 4.3 us; at 256
  // KiB: 27.5 -> 9.4 us). Large blocks are not mapped: cma stays their path.
  // (Transport settings: not with UCX 1.13, ucx/features.h.)
#if TW_UCX_HAS_TL_CONFIG_MODIFY
  o.emplace_back("?CMA_BW", "4000MBps");
  // tcp moves an eager message in segments of this size, one send and one
  // receive (and a reassembly copy) each: with UCX's 8 KiB a 64 KiB record
  // of the torch backend took 8 (torch.distributed's 64 KiB send/recv over
  // tcp went from 0.45x gloo to 2.26x with this and the other tcp changes of
  // that run, code feb942d in git history; bench/results/torch_dist_tcp.txt
  // has today's).
  o.emplace_back("?TCP_TX_SEG_SIZE", "64k");
  o.emplace_back("?TCP_RX_SEG_SIZE", "64k");
#endif
  // A message's large payload goes by UCX's rendezvous (core/messages.h).
  // Over tcp UCX's default scheme copies fragments in and out: ~1 GB/s here.
  // put_zcopy lands the bytes from the socket in the buffer the receiver
  // named: 4-5 GB/s (measured 2026-11, a run not kept). From 32 KiB: below
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
      Incoming payload(dev->workers[a->worker_index]->get(), data, length,
                       param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV);
      ReplyPath reply;
      if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) reply.ep = param->reply_ep;
      dev->on_data_message(a->worker_index, header, header_length, payload, reply, nullptr);
    } catch (const std::exception& e) {
      TW_LOG_WARN("dropping a data message: %s", e.what());
    }
  }
  defer_release(std::move(dev));  // never the last reference inside UCX
  return UCS_OK;
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
    if (m == "blocking")
      config.progress = ProgressMode::kBlocking;
    else if (m == "polling")
      config.progress = ProgressMode::kPolling;
    else if (m == "inline")
      config.progress = ProgressMode::kInline;
    else
      throw InvalidArgument("TENSORWIRE_PROGRESS must be blocking, polling or inline, got '" + m + "'");
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
  rep_movsb_min_from_env();       // and TENSORWIRE_REP_MOVSB_MIN
  shared_copy_min_from_env();     // and TENSORWIRE_SHARED_COPY_MIN
  if (const char* forms = std::getenv("TENSORWIRE_LANE_FORM")) {
    // auto (default), rma or messages; a comma list gives lane i the form i % n.
    std::string f(forms);
    std::size_t at = 0;
    while (at <= f.size()) {
      std::size_t end = f.find(',', at);
      if (end == std::string::npos) end = f.size();
      const std::string one = f.substr(at, end - at);
      if (one == "auto")
        lane_forms.push_back(LaneForm::kAuto);
      else if (one == "rma")
        lane_forms.push_back(LaneForm::kRma);
      else if (one == "messages")
        lane_forms.push_back(LaneForm::kMessages);
      else
        throw InvalidArgument("TENSORWIRE_LANE_FORM must be auto, rma or messages, or a comma list of them; got '" + f +
                              "'");
      at = end + 1;
    }
  }
  // Placed bursts sent while an inline receiver consumes: under bbr this
  // host's loopback drops and reorders their segments from 8 MiB on, under a
  // loss-based congestion control (reno here) they double the stream
  // (bench/results/tcp_placed.txt §6-7).
  if (read_first_line("/proc/sys/net/ipv4/tcp_congestion_control") != "bbr") place_to = std::uint64_t(64) << 20;
  if (const char* place = std::getenv("TENSORWIRE_PLACE")) {
    const std::string v(place);
    const std::size_t dash = v.find('-');
    auto bytes = [](const std::string& t, std::uint64_t* out) {
      char* end = nullptr;
      *out = std::strtoull(t.c_str(), &end, 10);
      return !t.empty() && std::isdigit(static_cast<unsigned char>(t[0])) && *end == '\0';
    };
    place_set = true;
    if (v == "off") {
      place_from = 1;
      place_to = 0;
    } else if (dash == std::string::npos || !bytes(v.substr(0, dash), &place_from) ||
               !bytes(v.substr(dash + 1), &place_to) || place_from > place_to) {
      throw InvalidArgument("TENSORWIRE_PLACE must be LO-HI (bytes, LO <= HI) or off, got '" + v + "'");
    }
  }
  id = random_id();
  self_proof_ = std::to_string(random_id()) + std::to_string(random_id());
  boot_id_ = read_first_line("/proc/sys/kernel/random/boot_id");
  start_time_ = process_start_time();
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  hostname_ = host;

  try {
    data_context = std::make_shared<ucx::Context>(data_overrides(config),
                                                  UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | UCP_FEATURE_RMA, "tensorwire");
  } catch (const Error& e) {
    if (e.ucx_status() != UCS_ERR_NO_DEVICE) throw;
    // Name what was asked: UCX says only "No such device".
    const char* env = std::getenv("UCX_NET_DEVICES");
    const std::string devices = config.net_devices != "auto" ? config.net_devices : env ? env : "any";
    throw InvalidArgument("no device UCX can use for transport '" + config.transport + "' among net devices '" +
                          devices + "' (" + e.what() + "); `tensorwire info` lists the devices UCX offers");
  }
  // tcp lanes are sockets: net_devices names the interface they bind to (SO_BINDTODEVICE).
  if (config.transport == "tcp" && config.net_devices != "auto" && !config.net_devices.empty()) {
    if (config.net_devices.find(',') != std::string::npos) {
      throw InvalidArgument("transport 'tcp' binds its lanes to one network interface, got net devices '" +
                            config.net_devices + "'");
    }
    if (if_nametoindex(config.net_devices.c_str()) == 0) {
      throw InvalidArgument("no network interface '" + config.net_devices + "' for transport 'tcp' (net devices; " +
                            "`ip link` lists this machine's)");
    }
    lane_interface = config.net_devices;
  }
  // Fail closed: what was asked for must be there (contracts §13).
  const std::vector<std::string> offered = resources();
  for (const std::string& family : required_families(config.transport, config.require)) {
    const std::string why = unusable_reason(offered, family);
    if (!why.empty()) throw InvalidArgument("transport '" + family + "' was asked for but is not usable here: " + why);
  }
  for (int i = 0; i < config.workers; ++i) {
    workers.push_back(std::make_shared<WorkerCtl>(std::make_shared<ucx::Worker>(data_context), config.progress,
                                                  config.spin_us, "tw-progress-" + std::to_string(i)));
  }
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
  pool_impl->set_revoker(grant_revoker());  // needs weak_from_this: not in the constructor
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

  listen();  // core/connect.cc: the listening socket and the control poller; sets `address`

  for (auto& w : workers) w->start();
  // The control thread always runs: control messages must be answered even
  // when the data path runs inline.
  control_thread_ = std::thread([this] { control_loop(); });
  pthread_setname_np(control_thread_.native_handle(), "tw-control");
  dispatcher_ = std::thread([this] { dispatcher_loop(); });
  liveness_ = std::thread([this] { liveness_loop(); });
}

void DeviceImpl::check_open() const {
  if (closed()) throw ConnectionError("device is closed");
}

RegionDescriptor DeviceImpl::export_for(RegionDescriptor d, Peer& to) {
  // What a message-form write or read from `to` may reach (messages.cc).
  if (d.device_id == id) {
    to.grant(d.address, d.length);
    if (!to.listed_as_grantee.exchange(true)) {
      std::lock_guard<std::mutex> lock(grantees_mu_);
      std::erase_if(grantees_, [](const auto& p) { return p.expired(); });
      grantees_.push_back(to.weak_from_this());
    }
  }
  if (!exact_export_ || d.device_id != id || d.length == 0) return d;
  // A same-host peer with shared memory gets the slab's key, whose mapping
  // is its direct path; it checks every use against our export (Peer::
  // remote_region, RemoteRegionImpl::access_for), and is on our host anyway.
  if (to.info.same_host && config.map_shared_memory && data_context->has_shared_memory()) return d;
  d.rkey = pool_holding(d).exact_rkey(reinterpret_cast<const void*>(d.address), d.length, d.memory_type);
  return d;
}

std::function<void(std::uintptr_t, std::uintptr_t)> DeviceImpl::grant_revoker() {
  return [weak = weak_from_this()](std::uintptr_t start, std::uintptr_t end) {
    if (auto dev = weak.lock()) dev->revoke_grants(start, end);
  };
}

void DeviceImpl::revoke_grants(std::uint64_t start, std::uint64_t end) {
  // Exclusive: a put or get that passed its grant check has done what it
  // does at once, and registered what goes on (hold_grants).
  std::unique_lock<std::shared_mutex> access(access_mu_);
  {
    std::lock_guard<std::mutex> lock(grantees_mu_);
    for (const auto& weak : grantees_) {
      if (auto peer = weak.lock()) peer->revoke(start, end);
    }
  }
  std::vector<std::shared_ptr<net::LandingGuard>> guards;
  std::vector<std::shared_ptr<net::Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(landings_mu_);
    for (const auto& [id, l] : landings_) {
      if ((l.start < end && start < l.end) || (l.flag_at >= start && l.flag_at < end)) guards.push_back(l.guard);
    }
    for (const auto& [id, q] : queued_replies_) {
      if (q.start < end && start < q.end) {
        auto c = q.conn.lock();
        if (c && std::find(conns.begin(), conns.end(), c) == conns.end()) conns.push_back(std::move(c));
      }
    }
  }
  // A copy into the range in progress finishes first (one recv); then the rest is discarded.
  for (auto& g : guards) {
    std::lock_guard<std::mutex> lock(g->mu);
    g->discard = true;
  }
  for (auto& c : conns) c->own_payloads(start, end);
}

MemoryPool& DeviceImpl::cuda_pool(int gpu) {
  check_open();
  if (!cuda::available()) throw InvalidArgument("GPU memory needs CUDA: " + cuda::unavailable_reason());
  if (gpu < 0 || gpu >= cuda::device_count()) {
    throw InvalidArgument("no GPU " + std::to_string(gpu) + ": this machine has " +
                          std::to_string(cuda::device_count()));
  }
  std::lock_guard<std::mutex> lock(cuda_pools_mu_);
  auto& entry = cuda_pools_[gpu];
  if (!entry.first) {
    entry.first = std::make_shared<PoolImpl>(data_context, id, config.slab_size, config.pool_limit,
                                             /*large_shared=*/false, gpu);
    entry.first->set_revoker(grant_revoker());
    entry.second = std::make_unique<MemoryPool>(entry.first);
  }
  return *entry.second;
}

PoolImpl& DeviceImpl::pool_holding(const RegionDescriptor& d) {
  if (d.memory_type == MemoryType::kCuda) {
    std::lock_guard<std::mutex> lock(cuda_pools_mu_);
    for (auto& [gpu, entry] : cuda_pools_) {
      if (entry.first->pin(d.address, d.length)) return *entry.first;
    }
  }
  return *pool_impl;  // host blocks, and every registration (the host pool keeps the registration cache)
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
  std::map<const net::Conn*, std::shared_ptr<net::Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers.swap(peers_);
    conns.swap(conns_);
    peers_by_conn_.clear();
    parked_lanes_.clear();  // in no poller: their sockets close with them
  }
  for (auto& [pid, p] : peers) p->fail(ErrorKind::kConnection, "device is closed");
  for (auto& [h, c] : conns) fail_pending_control(c.get(), ErrorKind::kConnection, "device is closed");
  drop_message_ops(nullptr, "device is closed");
  // Closing the sockets lets peers see the disconnect now.
  for (auto& [h, c] : conns) c->close("device is closed");
  stop_control_.store(true, std::memory_order_release);
  if (control_poller_) control_poller_->wake();
  if (control_thread_.joinable()) control_thread_.join();
  control_poller_.reset();  // the listener and what is left
  for (auto& w : workers) w->stop();
  drain_deferred_releases();
}

std::vector<std::string> DeviceImpl::resources() const {
  std::vector<std::string> out = data_context->resources();
  // tensorwire's own tcp lanes (net/socket.h): transport tcp, and auto for peers UCX cannot reach.
  if (config.transport == "tcp" || config.transport == "auto") out.insert(out.begin(), "tcp/socket");
  return out;
}

std::string DeviceImpl::describe() const {
  std::ostringstream os;
  os << "address: " << address << "\n";
  os << "device id: 0x" << std::hex << id << std::dec << "\n";
  os << "workers: " << workers.size() << ", progress: "
     << (config.progress == ProgressMode::kPolling    ? "polling"
         : config.progress == ProgressMode::kBlocking ? "blocking"
                                                      : "inline")
     << "\n";
  os << "data transports (UCX_TLS): " << data_context->transports() << "\n";
  os << "control: tensorwire's tcp sockets (net/socket.h)\n";
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
MemoryPool& Device::pool(MemoryType type, int gpu) {
  impl_->check_open();
  return type == MemoryType::kCuda ? impl_->cuda_pool(gpu) : *impl_->pool;
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
  impl_->on_call(name,
                 [h = std::move(handler)](const std::shared_ptr<detail::Peer>& caller, const std::string& payload) {
                   return h(caller->hello.device_id, payload);
                 });
}
Channel Device::connect(const std::string& address, int lane) {
  return Channel(impl_->connect(address)->channel(lane));
}
Channel Device::channel_to(std::uint64_t peer_device_id, int lane) {
  return Channel(impl_->peer_by_id(peer_device_id)->channel(lane));
}
std::vector<PeerInfo> Device::peers() const { return impl_->peers(); }
PeerInfo Device::wait_for_peer(double timeout_s) { return impl_->wait_for_peer(timeout_s); }
unsigned Device::progress() { return impl_->progress(); }
std::pair<std::uint64_t, std::uint64_t> detail::DeviceImpl::place_window() const {
  if (place_set || config.progress == ProgressMode::kInline) return {place_from, place_to};
  return {1, 0};
}

void Device::close() { impl_->close(); }
bool Device::closed() const { return impl_->closed(); }
std::string Device::describe() const { return impl_->describe(); }
std::vector<std::string> Device::resources() const { return impl_->resources(); }
std::uint64_t Device::refusals() const { return impl_->refusal_count(); }

std::string ucx_version() { return ucp_get_version_string(); }
std::string ucx_header_version() { return std::to_string(UCP_API_MAJOR) + "." + std::to_string(UCP_API_MINOR); }
std::vector<std::string> ucx_limits() {
  std::vector<std::string> out;
#if !TW_UCX_HAS_EP_TRANSPORTS
  out.push_back("this UCX (" + ucx_header_version() +
                ") cannot report an endpoint's transports: they count as unknown, and every channel to another "
                "process takes the message form as if its RMA were emulated (same-host peers get no shared-memory "
                "direct copy; TENSORWIRE_LANE_FORM=rma forces one-sided RMA)");
#endif
#if !TW_UCX_HAS_TL_CONFIG_MODIFY
  out.push_back("this UCX (" + ucx_header_version() +
                ") cannot take transport settings from a program: tensorwire's cma tuning is off "
                "(set UCX_CMA_BW=4000MBps in the environment for it)");
#endif
  return out;
}
std::string ucx_library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ucp_init_version), &info) && info.dli_fname) return info.dli_fname;
  return "unknown";
}
std::uint16_t protocol_version() { return control::kProtocolVersion; }

}  // namespace tensorwire
