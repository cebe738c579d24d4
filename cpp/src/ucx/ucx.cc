// Copyright tensorwire authors.
#include "ucx/ucx.h"
#include "cuda/driver.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/log.h"

namespace tensorwire::ucx {

ErrorKind error_kind(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_MESSAGE_TRUNCATED:  // a receive buffer smaller than the message
      return ErrorKind::kInvalidArgument;
    case UCS_ERR_TIMED_OUT: return ErrorKind::kTimeout;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED: return ErrorKind::kPeerFailed;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR: return ErrorKind::kConnection;
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT: return ErrorKind::kPoolExhausted;
    case UCS_ERR_NO_ELEM: return ErrorKind::kNotFound;
    default: return ErrorKind::kGeneric;
  }
}

void check(ucs_status_t status, const std::string& what) {
  if (status == UCS_OK || status == UCS_INPROGRESS) return;
  throw_error(error_kind(status), what + ": " + ucs_status_string(status), status);
}

namespace {
void request_init(void* request) {
  auto* slot = static_cast<RequestSlot*>(request);
  new (&slot->state) std::atomic<std::uintptr_t>(0);
  slot->status = UCS_OK;
}
}  // namespace

std::vector<std::pair<std::string, std::string>> transport_overrides(const std::string& transport) {
  // With a GPU, each named transport keeps UCX's CUDA transports, which move
  // GPU memory: over tcp cuda_copy stages it through host memory; same-host
  // GPU to GPU goes over cuda_ipc; gdr_copy and verbs with peer memory are
  // GPUDirect RDMA.
  const bool gpu = transport != "auto" && cuda::available();
  if (transport == "tcp") return {{"TLS", gpu ? "tcp,cuda_copy" : "tcp"}};
  if (transport == "shm") return {{"TLS", gpu ? "sm,cuda_copy,cuda_ipc" : "sm"}};
  if (transport == "rdma") return {{"TLS", gpu ? "rc,ud,sm,cuda_copy,cuda_ipc,gdr_copy" : "rc,ud,sm"}};
  if (transport == "auto") return {};
  throw InvalidArgument("transport must be auto, tcp, shm or rdma, got '" + transport + "'");
}

Context::Context(const std::vector<std::pair<std::string, std::string>>& overrides, std::uint64_t features,
                 const char* name) {
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  for (const auto& [raw_key, value] : overrides) {
    // A leading '?' marks a tuning default: skipped when the user set it in
    // the environment, ignored when this UCX does not know it.
    const bool optional = !raw_key.empty() && raw_key[0] == '?';
    const std::string key = optional ? raw_key.substr(1) : raw_key;
    if (optional && std::getenv(("UCX_" + key).c_str())) continue;
    ucs_status_t st = ucp_config_modify(config, key.c_str(), value.c_str());
    if (st != UCS_OK && optional) continue;
    if (st != UCS_OK) {
      ucp_config_release(config);
      throw InvalidArgument("UCX rejected setting " + key + "=" + value + ": " + ucs_status_string(st));
    }
    if (key == "TLS") tls_ = value;
  }
  if (tls_.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls_ = env ? env : "all";
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_REQUEST_SIZE | UCP_PARAM_FIELD_REQUEST_INIT |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = features;
  params.request_size = sizeof(RequestSlot);
  params.request_init = request_init;
  params.mt_workers_shared = 1;
  params.name = name;
  ucs_status_t st = ucp_init(&params, config, &handle_);
  ucp_config_release(config);
  check(st, "ucp_init");
}

Context::~Context() {
  if (handle_) ucp_cleanup(handle_);
}

std::string Context::transports() const { return tls_; }

std::vector<std::string> Context::resources() const {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (!f) return {};
  ucp_context_print_info(handle_, f);
  std::fclose(f);
  const std::string info(buf, size);
  std::free(buf);
  // Resource lines read "resource N : md M dev K flags -- rc_mlx5/mlx5_0:1".
  std::vector<std::string> out;
  for (std::size_t at = info.find("-- "); at != std::string::npos; at = info.find("-- ", at + 3)) {
    const std::size_t end = info.find_first_of(" \n", at + 3);
    std::string name = info.substr(at + 3, end == std::string::npos ? std::string::npos : end - at - 3);
    if (name.find('/') != std::string::npos && std::find(out.begin(), out.end(), name) == out.end()) {
      out.push_back(std::move(name));
    }
  }
  return out;
}

bool Context::has_hardware_keys() const {
  for (const std::string& r : resources()) {
    for (const char* tl : {"rc_", "dc_", "ud_", "srd"}) {
      if (r.rfind(tl, 0) == 0) return true;
    }
  }
  return false;
}

bool Context::has_shared_memory() const {
  std::string tls = tls_;
  if (!tls.empty() && tls[0] == '^') return true;  // an exclusion list keeps the rest
  std::size_t start = 0;
  while (start <= tls.size()) {
    std::size_t end = tls.find(',', start);
    if (end == std::string::npos) end = tls.size();
    const std::string name = tls.substr(start, end - start);
    if (name == "all" || name == "sm" || name == "shm" || name == "posix" || name == "sysv" || name == "xpmem") {
      return true;
    }
    start = end + 1;
  }
  return false;
}

Worker::Worker(std::shared_ptr<Context> context) : context_(std::move(context)) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Any thread may post (the latency path posts from the caller's thread,
  // without a hand-off to the progress thread); UCX's worker lock serialises.
  params.thread_mode = UCS_THREAD_MODE_MULTI;
  check(ucp_worker_create(context_->get(), &params, &handle_), "ucp_worker_create");
  ucs_status_t st = ucp_worker_get_efd(handle_, &event_fd_);
  if (st != UCS_OK) {
    ucp_worker_destroy(handle_);
    handle_ = nullptr;
    check(st, "ucp_worker_get_efd");
  }
}

Worker::~Worker() {
  if (handle_) ucp_worker_destroy(handle_);
}

void Worker::keep_until_destroyed(std::shared_ptr<const void> arg) {
  std::lock_guard<std::mutex> lock(keep_mu_);
  keep_.push_back(std::move(arg));
}

std::string worker_address(ucp_worker_h worker) {
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  check(ucp_worker_get_address(worker, &addr, &len), "ucp_worker_get_address");
  std::string out(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(worker, addr);
  return out;
}

std::string Worker::address() const { return worker_address(handle_); }

MemHandle::MemHandle(std::shared_ptr<Context> context, void* address, std::size_t length, Backing backing, bool cuda,
                     std::function<void()> on_unmap)
    : context_(std::move(context)), cuda_(cuda), on_unmap_(std::move(on_unmap)), length_(length) {
  bool allocate = backing == Backing::kUcx;
  if (backing == Backing::kHugeAnon) {
    mapped_ = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped_ == MAP_FAILED) {
      mapped_ = nullptr;
      throw PoolExhausted("mmap of " + std::to_string(length) + " bytes failed");
    }
    ::madvise(mapped_, length, MADV_HUGEPAGE);  // a hint: fine if THP is off
    address = mapped_;
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = address;
  params.length = length;
  params.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  if (cuda) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucs_status_t mst = ucp_mem_map(context_->get(), &params, &handle_);
  if (mst != UCS_OK && mapped_) ::munmap(mapped_, length_);
  if (mst != UCS_OK && on_unmap_) on_unmap_();
  check(mst, "ucp_mem_map");
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  ucs_status_t st = ucp_mem_query(handle_, &attr);
  if (st != UCS_OK) {
    ucp_mem_unmap(context_->get(), handle_);
    if (on_unmap_) on_unmap_();
    check(st, "ucp_mem_query");
  }
  address_ = attr.address;
  void* buf = nullptr;
  size_t size = 0;
  st = ucp_rkey_pack(context_->get(), handle_, &buf, &size);
  if (st == UCS_OK) note_own_rkey(std::string(static_cast<const char*>(buf), size));
  if (st != UCS_OK) {
    ucp_mem_unmap(context_->get(), handle_);
    if (on_unmap_) on_unmap_();
    check(st, "ucp_rkey_pack");
  }
  rkey_.assign(static_cast<const char*>(buf), size);
  ucp_rkey_buffer_release(buf);
}

MemHandle::~MemHandle() {
  if (handle_) {
    ucs_status_t st = ucp_mem_unmap(context_->get(), handle_);
    if (st != UCS_OK) TW_LOG_WARN("ucp_mem_unmap failed: %s", ucs_status_string(st));
  }
  if (mapped_) ::munmap(mapped_, length_);
  if (on_unmap_) on_unmap_();
}

namespace {
std::atomic<int> rkey_format{-1};  // -1 no own key seen yet, 0 unknown layout, 1 checked
}  // namespace

void note_own_rkey(const std::string& packed) {
  if (!packed_rkey_well_formed(packed)) {
    if (rkey_format.exchange(0) != 0) TW_LOG_WARN("UCX packs remote keys in an unknown layout: peers' keys unchecked");
  } else {
    int unset = -1;
    rkey_format.compare_exchange_strong(unset, 1);
  }
}

bool rkey_format_known() { return rkey_format.load(std::memory_order_relaxed) == 1; }

bool packed_rkey_well_formed(const std::string& packed) {
  // UCP's packed key: u64 md map | u8 memory type | per md in the map: u8
  // size + that many bytes | optionally u8 system device + 3 bytes per
  // distance. ucp_ep_rkey_unpack takes no length and trusts all of it (a
  // forged map makes it read past the key and crash), so a peer's key is
  // walked here first. Calibrated on this UCX's own keys (rkey_format_known).
  if (packed.size() < 9) return false;
  std::uint64_t md_map;
  std::memcpy(&md_map, packed.data(), 8);
  if (static_cast<std::uint8_t>(packed[8]) >= UCS_MEMORY_TYPE_LAST) return false;
  std::size_t at = 9;
  for (; md_map; md_map &= md_map - 1) {
    if (at >= packed.size()) return false;
    at += 1 + static_cast<std::uint8_t>(packed[at]);
    if (at > packed.size()) return false;
  }
  // The tail: a system device byte and 3-byte distances; keys of GPU memory
  // (UCX 1.22) end with one more 0xff byte after them.
  const std::size_t rest = packed.size() - at;
  return rest == 0 || (rest - 1) % 3 == 0 || (rest >= 2 && (rest - 2) % 3 == 0 && packed.back() == '\xff');
}

Rkey::Rkey(std::shared_ptr<Endpoint> endpoint, const std::string& packed) : endpoint_(std::move(endpoint)) {
  if (endpoint_->get() == nullptr) throw ConnectionError("channel is closed");
  if (rkey_format_known() && !packed_rkey_well_formed(packed)) {
    throw InvalidArgument("the peer's remote key is malformed (" + std::to_string(packed.size()) + " bytes)");
  }
  ucs_status_t st = ucp_ep_rkey_unpack(endpoint_->get(), packed.data(), &handle_);
  if (st != UCS_OK) {
    handle_ = nullptr;
    throw InvalidArgument(std::string("the peer's remote key cannot be used: ") + ucs_status_string(st), st);
  }
}

Rkey::~Rkey() {
  if (handle_) ucp_rkey_destroy(handle_);
}

void Endpoint::close(bool force) {
  ucp_ep_h ep = handle_;
  if (!ep) return;
  handle_ = nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
  if (UCS_PTR_IS_PTR(req)) {
    // Bounded: a graceful close to a dead peer must not hang the caller.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(force ? 1000 : 2000);
    while (ucp_request_check_status(req) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_->get());
    }
    ucp_request_free(req);
  }
}

Endpoint::~Endpoint() { close(true); }

}  // namespace tensorwire::ucx
