// Copyright tensorwire authors.
#include "core/worker_ctl.h"
#include "cuda/driver.h"

#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

#include "common/log.h"

namespace tensorwire::detail {

namespace {

// How often a parked progress thread looks whether the callers left (a
// missed wake costs at most this), and how long after the last caller left
// it still stays out (see stay_out).
constexpr long kParkedLookNs = 1'000'000;
// A caller that holds the worker longer than a look (a large transfer, a long
// wait) backs the looks off to at most this; its leave() then wakes the
// parked thread (deep_park_), so the longer look delays nothing. Waking every
// 1 ms during a 12 ms tcp transfer preempted the waiting thread on two cores
// (509 involuntary switches of the receiving thread in 30 transfers of
// 64 MiB, against 36 inline; bench/results/net_blocking_split.txt).
constexpr long kDeepLookNs = 100'000'000;
constexpr std::int64_t kGraceNs = 200'000;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Returns true when the wait timed out (timeout_ns < 1 s).
bool futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long timeout_ns) {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "futex word");
  struct timespec ts{0, timeout_ns};
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0) !=
             0 &&
         errno == ETIMEDOUT;
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace

WorkerCtl::WorkerCtl(std::shared_ptr<ucx::Worker> worker, ProgressMode mode, unsigned spin_us, std::string name)
    : worker_(std::move(worker)),
      mode_(mode),
      spin_us_(spin_us),
      name_(std::move(name)),
      park_look_ns_(kParkedLookNs) {}

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
  wake_seq_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&wake_seq_);
  thread_.join();
  threaded_.store(false, std::memory_order_release);
}

void WorkerCtl::defer(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(deferred_mu_);
    deferred_.push_back(std::move(fn));
  }
  has_deferred_.store(true, std::memory_order_release);
  // A progress thread asleep on the event fd flushes it now; a parked one
  // within kParkedLookNs, unless a caller's next post or wait does first.
  if (sleeping_.load(std::memory_order_acquire)) ucp_worker_signal(worker_->get());
}

void WorkerCtl::run_deferred() {
  std::vector<std::function<void()>> fns;
  {
    std::lock_guard<std::mutex> lock(deferred_mu_);
    fns.swap(deferred_);
    has_deferred_.store(false, std::memory_order_release);
  }
  for (auto& fn : fns) {
    try {
      fn();
    } catch (const std::exception& e) {
      TW_LOG_DEBUG("%s: a deferred notification failed: %s", name_.c_str(), e.what());
    }
  }
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
  last_left_ns_.store(now_ns(), std::memory_order_relaxed);
  const bool left_work = left_work_;
  // seq_cst pairs with stay_out(): either it sees no caller, or we see it parked.
  if (callers_.fetch_sub(1, std::memory_order_seq_cst) == 1) {
    left_work_ = false;
    if (left_work) work_left_.store(true, std::memory_order_seq_cst);
    if (left_work || deep_park_.load(std::memory_order_seq_cst)) {
      if (parked_.load(std::memory_order_seq_cst)) {
        wake_seq_.fetch_add(1, std::memory_order_seq_cst);
        futex_wake_all(&wake_seq_);
      }
    }
  }
}

void WorkerCtl::stay_out() {
  // Parks at once (a spinning progress thread took the CPU that the peer of a
  // latency loop needed), and stays out for kGraceNs after the last caller
  // left: a latency loop (send, wait, send...) leaves the worker for
  // microseconds, and a progress thread that took it then held the worker the
  // caller came back to (tcp ping-pong through slots, default settings: 22 us
  // average one way where the typical was 7.6). A caller that left work in
  // flight (a post that did not complete in place) ends the grace at once.
  // Sleeps on wake_seq_, which only leave() (work in flight) and stop()
  // change: the callers count changes all the time, and a futex on it
  // returned at once, a syscall spin.
  // Looks back off while callers hold the worker past them, and start where
  // the last park ended if its hold was long too (one large transfer after
  // another); a short hold resets them.
  long look = park_look_ns_;
  bool held_long = false;
  while (!stop_.load(std::memory_order_acquire)) {
    parked_.store(true, std::memory_order_seq_cst);
    const std::uint32_t seq = wake_seq_.load(std::memory_order_seq_cst);
    // Stored before callers_ is read (seq_cst, as parked_): a caller leaving
    // after that read sees it and wakes us.
    deep_park_.store(look > kParkedLookNs, std::memory_order_seq_cst);
    const std::uint64_t hold = holds_.load(std::memory_order_seq_cst);
    if (callers_.load(std::memory_order_seq_cst) != 0) {
      // Bounded: a caller that left quietly after a short hold waits at most
      // kParkedLookNs; after a long one, leave() wakes us. Only one hold that
      // outlasts the look backs off: callers coming and going all the time
      // (a latency loop) keep the short look and never pay a wake per leave.
      if (futex_wait(&wake_seq_, seq, look) && holds_.load(std::memory_order_seq_cst) == hold &&
          callers_.load(std::memory_order_seq_cst) != 0) {
        held_long = true;
        look = std::min(look * 2, kDeepLookNs);
      } else {
        held_long = false;
        look = kParkedLookNs;
      }
      continue;
    }
    if (work_left_.exchange(false, std::memory_order_seq_cst)) break;
    const std::int64_t since = now_ns() - last_left_ns_.load(std::memory_order_relaxed);
    if (since >= kGraceNs) break;
    futex_wait(&wake_seq_, seq, static_cast<long>(kGraceNs - since));
  }
  park_look_ns_ = held_long ? look : kParkedLookNs;
  deep_park_.store(false, std::memory_order_seq_cst);
  parked_.store(false, std::memory_order_release);
}

void WorkerCtl::wait_event(double seconds) {
  ucs_status_t st = ucp_worker_arm(worker_->get());
  if (st != UCS_OK) return;  // BUSY: events pending, progress instead
  poll_events(seconds);
}

void WorkerCtl::poll_events(double seconds) {
  struct pollfd pfd[2] = {{worker_->event_fd(), POLLIN, 0}, {sockets_.fd(), POLLIN, 0}};
  if (seconds < 0) seconds = 0;
  struct timespec ts{static_cast<time_t>(seconds),
                     static_cast<long>((seconds - static_cast<double>(static_cast<time_t>(seconds))) * 1e9)};
  // The sockets' epoll fd even while it has no connection: one that a peer
  // dials meanwhile is added with a wake() on it (a sleep on the worker's fd
  // alone missed it and lasted the whole timeout: a 16 MiB isend over tcp
  // whose sender then computed took 100-170 ms to arrive instead of ~10).
  ::ppoll(pfd, 2, &ts, nullptr);
}

void WorkerCtl::run() {
  unsigned idle_rounds = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    // UCX's CUDA transports act in the progressing thread's context.
    if (cuda::in_use()) cuda::bind_thread(cuda::first_ordinal());
    flush_deferred();
    if (callers_.load(std::memory_order_acquire) != 0) {
      // A caller drives the worker meanwhile (see WorkerCtl). Once it left,
      // no spin for it: what it left in flight raises events.
      stay_out();
      continue;
    }
    unsigned events;
    {
      std::lock_guard<std::recursive_mutex> use(use_);
      events = progress_now();
    }
    if (events > 0) {
      idle_rounds = 0;
      continue;
    }
    if (mode_ == ProgressMode::kPolling) continue;
    // Blocking: sleep once 64 rounds in a row found nothing (~20 us), with no
    // spin_us spin of its own. spin_us is the waiters' budget: a spinning
    // progress thread beside the spinning waiters of two processes
    // oversubscribes two cores, and the run falls into time slices (tcp
    // 64 KiB slot transfers, depth 1: in some runs 120-190 us median instead
    // of 45; bench/results/net_blocking_split.txt has three runs of each).
    if (++idle_rounds < 64) continue;
    idle_rounds = 0;
    // Raise the flag before arming: a post that lands between arm and poll
    // then signals the worker instead of waiting for the poll timeout.
    sleeping_.store(true, std::memory_order_seq_cst);
    ucs_status_t st = ucp_worker_arm(worker_->get());
    if (st != UCS_OK) {
      sleeping_.store(false, std::memory_order_release);
      if (st != UCS_ERR_BUSY) TW_LOG_ERROR("%s: ucp_worker_arm failed: %s", name_.c_str(), ucs_status_string(st));
      continue;
    }
    // The timeout bounds how long a missed wake-up can stall (never forever).
    poll_events(0.1);
    sleeping_.store(false, std::memory_order_release);
  }
}

}  // namespace tensorwire::detail
