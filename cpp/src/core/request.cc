// Copyright tensorwire authors.
#include <chrono>
#include <cmath>
#include <thread>

#include "core/request_state.h"
#include "core/worker_ctl.h"
#include "tensorwire/request.h"

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

void RequestState::throw_error() const { tensorwire::throw_error(kind_, message_); }

void RequestState::wait(double timeout_s) {
  using clock = std::chrono::steady_clock;
  const bool forever = no_deadline(timeout_s);
  const auto start = clock::now();
  const auto deadline = forever ? clock::time_point::max()
                                : start + std::chrono::duration_cast<clock::duration>(
                                              std::chrono::duration<double>(timeout_s));
  // Spin first, progressing the worker from this thread: the common fast case
  // completes here without any sleep or cross-thread wake-up. Then nap on the
  // worker's event fd between bursts, still driving it (WorkerCtl: the
  // progress thread stays out meanwhile, so two threads never spin at once).
  if (auto worker = worker_.lock()) {
    WorkerCtl::Caller caller(worker.get());
    const auto spin = std::chrono::microseconds(worker->spin_us() ? worker->spin_us() : 20);
    auto spin_until = start + spin;
    // Completion comes with an event, except for a polled word written
    // one-sidedly (no event over shared memory): then nap briefly
    // (watch_nap_s: the nap's length is added latency).
    const bool watching = poller && !poller_evented;
    unsigned rounds = 0;
    bool napping = false;
    while (!finished()) {
      unsigned events = worker->drive();
      if (poller && poller()) break;
      if (events) {
        if (inbound) spin_until = clock::now() + spin;
        continue;  // drain before napping: arm() needs an idle worker
      }
      if (!napping && (++rounds & 63) != 0) continue;
      auto now = clock::now();
      if (now >= deadline) break;
      // Spin from the start of the wait, not from the last event: while our
      // own large send streams out, its events would keep this thread
      // spinning (CPU the receiver needs). Inbound requests, and wait_until,
      // whose events are the awaited data arriving, spin from the last event.
      if (!napping && now < spin_until) {
        if (now - start >= kYieldAfter) yield_cpu();  // the peer may be queued on this CPU
        continue;
      }
      napping = true;
      double left = std::chrono::duration<double>(deadline - now).count();
      const double nap = watching ? watch_nap_s(std::chrono::duration<double>(now - start).count()) : 0.01;
      worker->wait_event(left < nap ? left : nap);
    }
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

}  // namespace detail

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

std::string Request::error_message() const {
  if (!state_) return inline_error_;
  return state_->status() == detail::RequestState::kFailed ? state_->error_message() : std::string();
}

}  // namespace tensorwire
