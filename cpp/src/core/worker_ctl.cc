// Copyright tensorwire authors.
#include "core/worker_ctl.h"

#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chrono>

#include "core/log.h"

namespace tensorwire::detail {

namespace {

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long timeout_ns) {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "futex word");
  struct timespec ts{0, timeout_ns};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace

WorkerCtl::WorkerCtl(std::shared_ptr<ucx::Worker> worker, ProgressMode mode, unsigned spin_us, std::string name)
    : worker_(std::move(worker)), mode_(mode), spin_us_(spin_us), name_(std::move(name)) {}

WorkerCtl::~WorkerCtl() { stop(); }

void WorkerCtl::start() {
  if (mode_ == ProgressMode::kInline || thread_.joinable()) return;
  stop_.store(false);
  threaded_.store(true, std::memory_order_release);
  thread_ = std::thread([this] { run(); });
  pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
}

void WorkerCtl::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true, std::memory_order_seq_cst);
  ucp_worker_signal(worker_->get());
  if (parked_.load(std::memory_order_seq_cst)) futex_wake_all(&callers_);
  thread_.join();
  threaded_.store(false, std::memory_order_release);
}

void WorkerCtl::lock_worker() {
  // Most holds are short (a post, an idle progress): spin a little first.
  for (int i = 0; i < 256; ++i) {
    if (use_.try_lock()) return;
    cpu_relax();
  }
  use_.lock();
}

void WorkerCtl::leave() {
  // seq_cst pairs with stay_out(): either it sees no caller, or we see it parked.
  if (callers_.fetch_sub(1, std::memory_order_seq_cst) == 1 && parked_.load(std::memory_order_seq_cst)) {
    futex_wake_all(&callers_);
  }
}

void WorkerCtl::stay_out() {
  // Posts are short: poll for a while before paying a futex sleep and wake.
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
  for (unsigned i = 1;; ++i) {
    if (callers_.load(std::memory_order_acquire) == 0) return;
    cpu_relax();
    if ((i & 31) == 0 && std::chrono::steady_clock::now() > until) break;
  }
  // Not the event fd: it fires on every event the caller is handling.
  while (!stop_.load(std::memory_order_acquire)) {
    parked_.store(true, std::memory_order_seq_cst);
    std::uint32_t c = callers_.load(std::memory_order_seq_cst);
    if (c == 0) break;
    futex_wait(&callers_, c, 5'000'000);  // bounded: a missed wake costs at most this
  }
  parked_.store(false, std::memory_order_release);
}

void WorkerCtl::wait_event(double seconds) {
  ucs_status_t st = ucp_worker_arm(worker_->get());
  if (st != UCS_OK) return;  // BUSY: events pending, progress instead
  struct pollfd pfd{worker_->event_fd(), POLLIN, 0};
  if (seconds < 0) seconds = 0;
  struct timespec ts{static_cast<time_t>(seconds), static_cast<long>((seconds - static_cast<double>(
                                                                        static_cast<time_t>(seconds))) * 1e9)};
  ::ppoll(&pfd, 1, &ts, nullptr);
}

void WorkerCtl::run() {
  using clock = std::chrono::steady_clock;
  const auto spin = std::chrono::microseconds(spin_us_);
  auto last_event = clock::now();
  unsigned idle_rounds = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    if (callers_.load(std::memory_order_acquire) != 0) {
      // A caller drives the worker meanwhile (see WorkerCtl). Once it left,
      // no spin for it: what it left in flight raises events.
      stay_out();
      continue;
    }
    unsigned events;
    if (guarded_) {
      events = progress_now();  // takes the progress guard
    } else {
      std::lock_guard<std::recursive_mutex> use(use_);
      events = progress_now();
    }
    if (events > 0) {
      idle_rounds = 0;
      if (mode_ != ProgressMode::kPolling) last_event = clock::now();
      continue;
    }
    if (mode_ == ProgressMode::kPolling) continue;
    // Read the clock only every few idle rounds: it costs ~20 ns a call.
    if (++idle_rounds < 64) continue;
    idle_rounds = 0;
    if (clock::now() - last_event < spin) continue;
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
