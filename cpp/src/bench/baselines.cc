// Copyright tensorwire authors.
#include "bench/baselines.h"

#include <poll.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/waiter.h"  // deadline_after: the core's one meaning of a timeout
#include "tensorwire/error.h"
#include "ucx/features.h"
#include "ucx/ucx.h"

namespace tensorwire::bench {

using detail::deadline_after;  // < 0 or NaN: no deadline; 0: now (contracts §2)
using ucx::check;              // UCX status -> Error: the one table, ucx/ucx.cc

namespace {

constexpr unsigned kAmRequest = 0x7462;  // "tb": tensor bench request
constexpr unsigned kAmReply = 0x7463;
#if TW_UCX_HAS_AM_COPY_HEADER
constexpr unsigned kCopyHeader = UCP_AM_SEND_FLAG_COPY_HEADER;
#else
constexpr unsigned kCopyHeader = 0;  // every send here is waited for: its header outlives it
#endif

bool is_set(const char* name) { return std::getenv(name) != nullptr; }

}  // namespace

UcxBaselineImpl::UcxBaselineImpl(const std::string& transport, unsigned spin_us, bool loopback) : spin_us_(spin_us) {
  auto o = ucx::transport_overrides(transport);
  // UCX's own transport settings (no cma tuning, unlike Device's data
  // context): this is what UCX users get.
  if (loopback && !is_set("UCX_NET_DEVICES")) o.emplace_back("NET_DEVICES", "lo");
  context_ =
      std::make_shared<ucx::Context>(o, UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP, "tensorwire-baseline");
  tls_ = context_->transports();
  ucs_status_t st;

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // mu_ serialises callers
  st = ucp_worker_create(context_->get(), &wp, &worker_);
  if (st != UCS_OK) {
    context_.reset();
    check(st, "ucp_worker_create");
  }
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;  // then spin only

  for (auto [id, cb] : {std::pair<unsigned, ucp_am_recv_callback_t>{kAmRequest, &UcxBaselineImpl::on_request},
                        std::pair<unsigned, ucp_am_recv_callback_t>{kAmReply, &UcxBaselineImpl::on_reply}}) {
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    am.id = id;
    am.cb = cb;
    am.arg = this;
    am.flags = UCP_AM_FLAG_WHOLE_MSG | (id == kAmRequest ? UCP_AM_FLAG_PERSISTENT_DATA : 0);
    st = ucp_worker_set_am_recv_handler(worker_, &am);
    if (st != UCS_OK) {
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
      context_.reset();
      check(st, "ucp_worker_set_am_recv_handler");
    }
  }
}

UcxBaselineImpl::~UcxBaselineImpl() {
  try {
    close();
  } catch (...) {
  }
}

void UcxBaselineImpl::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!worker_) return;
  for (auto& in : requests_) release(in);
  requests_.clear();
  if (ep_) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (UCS_PTR_IS_PTR(req)) {
      auto deadline = clock::now() + std::chrono::seconds(1);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && clock::now() < deadline) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(req);
    }
  }
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  context_.reset();
}

std::string UcxBaselineImpl::address() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!worker_) throw ConnectionError("baseline is closed");
  return ucx::worker_address(worker_);
}

void UcxBaselineImpl::connect(const std::string& peer_address) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!worker_) throw ConnectionError("baseline is closed");
  if (ep_) throw InvalidArgument("already connected");
  if (peer_address.empty()) throw InvalidArgument("empty peer address");
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  // Shared-memory transports refuse peer error handling (docs/architecture.md §8).
  ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  check(ucp_ep_create(worker_, &ep, &ep_), "ucp_ep_create");
}

void UcxBaselineImpl::require_ep() const {
  if (!worker_) throw ConnectionError("baseline is closed");
  if (!ep_) throw ConnectionError("baseline is not connected");
}

ucs_status_t UcxBaselineImpl::on_request(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBaselineImpl*>(arg);
  Incoming in;
  in.header.assign(static_cast<const char*>(header), header_length);
  in.length = length;
  in.rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (in.rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA)) {
    in.desc = data;  // kept until am_recv copies it out (or close releases it)
    self->requests_.push_back(std::move(in));
    return UCS_INPROGRESS;
  }
  // Not persistent (never with UCP_AM_FLAG_PERSISTENT_DATA, but allowed by
  // the API): keep a copy.
  in.copy.assign(static_cast<const char*>(data), length);
  self->requests_.push_back(std::move(in));
  return UCS_OK;
}

ucs_status_t UcxBaselineImpl::on_reply(void* arg, const void*, size_t, void* data, size_t length,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBaselineImpl*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Replies are sent eager; a rendezvous one is not ours. Returning UCS_OK
    // releases the descriptor.
    self->replies_.emplace_back();
    return UCS_OK;
  }
  self->replies_.emplace_back(static_cast<const char*>(data), length);
  return UCS_OK;
}

void UcxBaselineImpl::release(Incoming& in) {
  if (in.desc && !in.rndv && worker_) ucp_am_data_release(worker_, in.desc);
  if (in.desc && in.rndv && worker_) {
    // An unreceived rendezvous message: receiving into nothing is not
    // possible, so release its descriptor (UCX drops the data).
    ucp_am_data_release(worker_, in.desc);
  }
  in.desc = nullptr;
}

void UcxBaselineImpl::drive(const std::function<bool()>& done, clock::time_point deadline, const char* what) {
  const auto spin = std::chrono::microseconds(spin_us_);
  auto last_event = clock::now();
  unsigned spins = 0;
  while (!done()) {
    if (ucp_worker_progress(worker_) > 0) {
      last_event = clock::now();
      continue;
    }
    if ((++spins & 63) != 0) continue;
    auto now = clock::now();
    if (now > deadline) throw Timeout(std::string("UCX baseline: timed out in ") + what);
    if (efd_ >= 0 && now - last_event > spin) {
      // Idle: sleep on the event fd (bounded; a missed wake-up costs <= 1 ms).
      ucs_status_t st = ucp_worker_arm(worker_);
      if (st == UCS_OK) {
        pollfd p{efd_, POLLIN, 0};
        ::poll(&p, 1, 1);
      } else if (st != UCS_ERR_BUSY) {
        check(st, "ucp_worker_arm");
      }
      last_event = clock::now();
    }
  }
}

ucs_status_t UcxBaselineImpl::wait_request(ucs_status_ptr_t req, clock::time_point deadline, const char* what,
                                           ucp_tag_recv_info_t* tag_info) {
  if (req == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  ucs_status_t st = UCS_INPROGRESS;
  auto finished = [&] {
    st = tag_info ? ucp_tag_recv_request_test(req, tag_info) : ucp_request_check_status(req);
    return st != UCS_INPROGRESS;
  };
  try {
    drive(finished, deadline, what);
  } catch (const Timeout&) {
    // The buffer must not be touched after we return: cancel, then let the
    // cancellation complete (bounded).
    ucp_request_cancel(worker_, req);
    auto until = clock::now() + std::chrono::seconds(1);
    while (ucp_request_check_status(req) == UCS_INPROGRESS && clock::now() < until) ucp_worker_progress(worker_);
    ucp_request_free(req);
    throw;
  }
  ucp_request_free(req);
  return st;
}

void UcxBaselineImpl::tag_send(const void* buffer, std::size_t nbytes, std::uint64_t tag, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  require_ep();
  ucp_request_param_t param{};
  ucs_status_ptr_t req = ucp_tag_send_nbx(ep_, buffer, nbytes, tag, &param);
  ucs_status_t st = wait_request(req, deadline_after(timeout_s), "tag_send");
  check(st, "ucp_tag_send_nbx");
}

std::size_t UcxBaselineImpl::tag_recv(void* buffer, std::size_t capacity, std::uint64_t tag, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!worker_) throw ConnectionError("baseline is closed");
  ucp_tag_recv_info_t info{};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
  param.recv_info.tag_info = &info;
  ucs_status_ptr_t req = ucp_tag_recv_nbx(worker_, buffer, capacity, tag, ~ucp_tag_t(0), &param);
  ucs_status_t st = wait_request(req, deadline_after(timeout_s), "tag_recv", req ? &info : nullptr);
  check(st, "ucp_tag_recv_nbx");
  return info.length;
}

std::string UcxBaselineImpl::am_request(const std::string& header, const void* payload, std::size_t nbytes,
                                        double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  require_ep();
  const auto deadline = deadline_after(timeout_s);
  // Serialization: the payload is copied into the request message, as an
  // RPC stack marshals its arguments.
  if (send_msg_.size() < nbytes) send_msg_.resize(nbytes);
  if (nbytes) std::memcpy(send_msg_.data(), payload, nbytes);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = kCopyHeader;
  ucs_status_ptr_t req =
      ucp_am_send_nbx(ep_, kAmRequest, header.data(), header.size(), send_msg_.data(), nbytes, &param);
  ucs_status_t st = wait_request(req, deadline, "am_request send");
  check(st, "ucp_am_send_nbx");
  drive([this] { return !replies_.empty(); }, deadline, "am_request reply");
  std::string reply = std::move(replies_.front());
  replies_.pop_front();
  return reply;
}

UcxBaselineImpl::AmMessage UcxBaselineImpl::am_recv(void* buffer, std::size_t capacity, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!worker_) throw ConnectionError("baseline is closed");
  const auto deadline = deadline_after(timeout_s);
  drive([this] { return !requests_.empty(); }, deadline, "am_recv");
  Incoming in = std::move(requests_.front());
  requests_.pop_front();
  AmMessage out{std::move(in.header), in.length};
  if (in.length > capacity) {
    release(in);
    throw InvalidArgument("am_recv: message of " + std::to_string(in.length) + " bytes exceeds the buffer (" +
                          std::to_string(capacity) + ")");
  }
  const char* src = nullptr;
  if (in.rndv) {
    // The request's data lands in the server's message buffer first.
    if (recv_msg_.size() < in.length) recv_msg_.resize(in.length);
    ucp_request_param_t param{};
    void* desc = in.desc;
    in.desc = nullptr;  // UCX owns it from here
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_, desc, recv_msg_.data(), in.length, &param);
    ucs_status_t st = wait_request(req, deadline, "am_recv data");
    check(st, "ucp_am_recv_data_nbx");
    src = recv_msg_.data();
  } else if (in.desc) {
    src = static_cast<const char*>(in.desc);
  } else {
    src = in.copy.data();
  }
  // Deserialization: copy out into the caller's array.
  if (in.length) std::memcpy(buffer, src, in.length);
  release(in);
  return out;
}

void UcxBaselineImpl::am_reply(const std::string& payload, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  require_ep();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER | kCopyHeader;
  ucs_status_ptr_t req = ucp_am_send_nbx(ep_, kAmReply, nullptr, 0, payload.data(), payload.size(), &param);
  ucs_status_t st = wait_request(req, deadline_after(timeout_s), "am_reply");
  check(st, "ucp_am_send_nbx (reply)");
}

// ---- UcxBaseline: the public face (tensorwire/bench.h) ----

UcxBaseline::UcxBaseline(const std::string& transport, unsigned spin_us, bool loopback)
    : impl_(std::make_unique<UcxBaselineImpl>(transport, spin_us, loopback)) {}
UcxBaseline::~UcxBaseline() = default;
std::string UcxBaseline::address() const { return impl_->address(); }
std::string UcxBaseline::transports() const { return impl_->transports(); }
void UcxBaseline::connect(const std::string& peer_address) { impl_->connect(peer_address); }
bool UcxBaseline::connected() const { return impl_->connected(); }
void UcxBaseline::close() { impl_->close(); }
void UcxBaseline::tag_send(const void* buffer, std::size_t nbytes, std::uint64_t tag, double timeout_s) {
  impl_->tag_send(buffer, nbytes, tag, timeout_s);
}
std::size_t UcxBaseline::tag_recv(void* buffer, std::size_t capacity, std::uint64_t tag, double timeout_s) {
  return impl_->tag_recv(buffer, capacity, tag, timeout_s);
}
std::string UcxBaseline::am_request(const std::string& header, const void* payload, std::size_t nbytes,
                                    double timeout_s) {
  return impl_->am_request(header, payload, nbytes, timeout_s);
}
UcxBaseline::AmMessage UcxBaseline::am_recv(void* buffer, std::size_t capacity, double timeout_s) {
  return impl_->am_recv(buffer, capacity, timeout_s);
}
void UcxBaseline::am_reply(const std::string& payload, double timeout_s) { impl_->am_reply(payload, timeout_s); }

}  // namespace tensorwire::bench
