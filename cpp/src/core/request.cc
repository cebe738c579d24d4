// Copyright tensorwire authors.
#include <chrono>
#include <cmath>
#include <thread>

#include "core/request_state.h"
#include "core/waiter.h"
#include "core/worker_ctl.h"
#include "tensorwire/request.h"
#include "tensorwire/wait.h"

namespace tensorwire {

void throw_error(ErrorKind kind, const std::string& what, int ucx_status) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: throw InvalidArgument(what, ucx_status);
    case ErrorKind::kTimeout: throw Timeout(what, ucx_status);
    case ErrorKind::kConnection: throw ConnectionError(what, ucx_status);
    case ErrorKind::kPeerFailed: throw PeerFailed(what, ucx_status);
    case ErrorKind::kPoolExhausted: throw PoolExhausted(what, ucx_status);
    case ErrorKind::kProtocolMismatch: throw ProtocolMismatch(what, ucx_status);
    case ErrorKind::kNotFound: throw NotFound(what, ucx_status);
    case ErrorKind::kGeneric: break;
  }
  throw Error(kind, what, ucx_status);
}

namespace detail {

bool RequestState::complete(bool ok, ErrorKind kind, std::string message) {
  int expected = kPending;
  if (!status_.compare_exchange_strong(expected, kCompleting, std::memory_order_acq_rel)) return false;
  kind_ = kind;
  message_ = std::move(message);
  status_.store(ok ? kDone : kFailed, std::memory_order_release);
  std::function<void(bool, const std::string&)> cb;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cb = std::move(callback_);
    cv_.notify_all();
  }
  if (cb) cb(ok, message_);
  return true;
}

void RequestState::then(std::function<void(bool, const std::string&)> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!finished()) {
      callback_ = std::move(fn);
      return;
    }
  }
  fn(status() == kDone, message_);
}

bool RequestState::test() {
  if (!finished()) {
    if (auto worker = worker_.lock()) worker->progress();
    if (poller) poller();
  }
  return finished();
}

bool RequestRef::wait(double timeout_s) {
  if (!state_) return true;
  try {
    state_->wait(timeout_s);
  } catch (const Timeout&) {
    return false;
  } catch (const Error&) {
  }
  return true;
}

void RequestState::throw_error() const { tensorwire::throw_error(kind_, message_); }

void RequestState::wait(double timeout_s) {
  const bool forever = no_deadline(timeout_s);
  const auto deadline = deadline_after(timeout_s);
  // Drive the worker from this thread (core/waiter.h): the common fast case
  // completes in the spin without any sleep or cross-thread wake-up.
  if (auto worker = worker_.lock()) {
    Drivers drivers;
    drivers.add(worker.get());
    WaitPolicy policy;
    policy.spin = std::chrono::microseconds(worker->spin_us() ? worker->spin_us() : 20);
    policy.spin_from_events = inbound;
    // Completion comes with an event, except for a polled word written
    // one-sidedly (no event over shared memory).
    policy.evented = !(poller && !poller_evented);
    policy.announce = announce;
    policy.announce_ctx = announce_ctx;
    wait_for(drivers, [&] { return finished() || (poller && poller()); }, [] { return false; }, deadline, policy);
  }
  if (!finished()) {
    std::unique_lock<std::mutex> lock(mu_);
    if (forever) {
      cv_.wait(lock, [&] { return finished(); });
    } else {
      cv_.wait_until(lock, deadline, [&] { return finished(); });
    }
  }
  if (!finished()) {
    throw Timeout("request did not complete within " + std::to_string(timeout_s) +
                  " s; it is still in flight and may complete (its local buffer stays in use until it does): "
                  "wait() again; it fails with PeerFailed once the peer is declared dead (liveness)");
  }
  if (status() == kFailed) throw_error();
}

namespace {

// A request for wait_any(): ready once complete (a failure is a completion:
// the caller's wait() raises it).
class RequestSource : public WaitSource {
 public:
  explicit RequestSource(RequestState* state) : state_(state) {
    if (state_) state_->retain();
  }
  ~RequestSource() override {
    if (state_) state_->release();
  }
  bool ready() override { return !state_ || state_->finished() || (state_->poller && state_->poller()); }
  bool failed() override { return false; }
  void throw_failure() override { throw ConnectionError("a request failed"); }  // not reached: failed() is false
  bool prepare(Drivers& drivers, WaitPolicy& policy) override {
    if (!state_) return true;
    worker_ = state_->worker();
    if (!worker_) return true;
    drivers.add(worker_.get());
    policy.spin = std::chrono::microseconds(worker_->spin_us() ? worker_->spin_us() : 20);
    policy.spin_from_events = state_->inbound;
    policy.evented = !(state_->poller && !state_->poller_evented);
    return true;
  }
  std::string describe() override { return "a request"; }
  void announce(bool napping, Drivers* drivers) override {
    if (announces()) state_->announce(state_->announce_ctx, napping, drivers);
  }
  bool announces() const override { return state_ && state_->announce; }

 private:
  RequestState* state_;
  std::shared_ptr<WorkerCtl> worker_;  // alive while the wait drives it
};

}  // namespace

}  // namespace detail

Awaitable::Awaitable(const Request& request) : source_(std::make_shared<detail::RequestSource>(request.state_)) {}

Request Request::failed(ErrorKind kind, std::string what) {
  Request r;
  r.inline_failed_ = true;
  r.inline_error_kind_ = kind;
  r.inline_error_ = std::move(what);
  return r;
}

Request::Request(Request&& other) noexcept
    : state_(other.state_),
      inline_error_kind_(other.inline_error_kind_),
      inline_error_(std::move(other.inline_error_)),
      inline_failed_(other.inline_failed_) {
  other.state_ = nullptr;
  other.inline_failed_ = false;
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    if (state_) state_->release();
    state_ = other.state_;
    inline_error_kind_ = other.inline_error_kind_;
    inline_error_ = std::move(other.inline_error_);
    inline_failed_ = other.inline_failed_;
    other.state_ = nullptr;
    other.inline_failed_ = false;
  }
  return *this;
}

Request::~Request() {
  if (state_) state_->release();
}

bool Request::test() {
  if (!state_) return true;
  return state_->test();
}

void Request::wait(double timeout_s) {
  if (inline_failed_) throw_error(inline_error_kind_, inline_error_);
  if (!state_) return;
  try {
    state_->wait(timeout_s);
  } catch (...) {
    detail::drain_deferred_releases();
    throw;
  }
  detail::drain_deferred_releases();
}

void Request::then(std::function<void(bool, const std::string&)> fn) {
  if (state_) {
    state_->then(std::move(fn));
  } else {
    fn(!inline_failed_, inline_error_);
  }
}

int Request::state() const {
  if (!state_) return inline_failed_ ? -1 : 1;
  int s = state_->status();
  return s == detail::RequestState::kDone ? 1 : s == detail::RequestState::kFailed ? -1 : 0;
}

ErrorKind Request::error_kind() const {
  if (!state_) return inline_failed_ ? inline_error_kind_ : ErrorKind::kGeneric;
  return state_->status() == detail::RequestState::kFailed ? state_->error_kind() : ErrorKind::kGeneric;
}

int Request::failed_rank() const {
  if (!state_ || state_->status() != detail::RequestState::kFailed) return -1;
  return state_->failed_rank;
}

std::string Request::error_message() const {
  if (!state_) return inline_error_;
  return state_->status() == detail::RequestState::kFailed ? state_->error_message() : std::string();
}

}  // namespace tensorwire
