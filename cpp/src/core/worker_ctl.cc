// Copyright tensorwire authors.
#include "core/worker_ctl.h"

#include <poll.h>
#include <pthread.h>

#include <chrono>

#include "core/log.h"

namespace tensorwire::detail {

WorkerCtl::WorkerCtl(std::shared_ptr<ucx::Worker> worker, ProgressMode mode, unsigned spin_us, std::string name)
    : worker_(std::move(worker)), mode_(mode), spin_us_(spin_us), name_(std::move(name)) {}

WorkerCtl::~WorkerCtl() { stop(); }

void WorkerCtl::start() {
  if (mode_ == ProgressMode::kInline || thread_.joinable()) return;
  stop_.store(false);
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
}

void WorkerCtl::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true, std::memory_order_release);
  ucp_worker_signal(worker_->get());
  thread_.join();
}

void WorkerCtl::wait_event(double seconds) {
  ucs_status_t st = ucp_worker_arm(worker_->get());
  if (st == UCS_ERR_BUSY) return;  // events pending: progress instead
  if (st != UCS_OK) return;
  struct pollfd pfd{worker_->event_fd(), POLLIN, 0};
  int ms = static_cast<int>(seconds * 1000.0);
  ::poll(&pfd, 1, ms < 1 ? 1 : ms);
}

void WorkerCtl::run() {
  using clock = std::chrono::steady_clock;
  const auto spin = std::chrono::microseconds(spin_us_);
  auto last_event = clock::now();
  unsigned idle_rounds = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    if (progress() > 0) {  // takes the progress guard when enabled
      idle_rounds = 0;
      if (mode_ != ProgressMode::kPolling) last_event = clock::now();
      continue;
    }
    if (mode_ == ProgressMode::kPolling) continue;
    // Read the clock only every few idle rounds: it costs ~20 ns a call.
    if (++idle_rounds < 64) continue;
    idle_rounds = 0;
    auto now = clock::now();
    if (now - last_event < spin) continue;
    // Raise the flag before arming: a post that lands between arm and poll
    // then signals the worker instead of waiting for the poll timeout.
    sleeping_.store(true, std::memory_order_seq_cst);
    ucs_status_t st = ucp_worker_arm(worker_->get());
    if (st != UCS_OK) {
      sleeping_.store(false, std::memory_order_release);
      if (st != UCS_ERR_BUSY) TW_LOG_ERROR("%s: ucp_worker_arm failed: %s", name_.c_str(), ucs_status_string(st));
      continue;
    }
    struct pollfd pfd{worker_->event_fd(), POLLIN, 0};
    // The timeout bounds how long a missed wake-up can stall (never forever).
    ::poll(&pfd, 1, 100);
    sleeping_.store(false, std::memory_order_release);
    last_event = clock::now();
  }
}

}  // namespace tensorwire::detail
