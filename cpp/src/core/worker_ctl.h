// Copyright tensorwire authors.
//
// WorkerCtl: one UCP worker, the sockets of its tcp lanes (net/socket.h),
// and the policy that drives their progress: whoever progresses the worker
// progresses both, and a nap wakes for either.
//
// Threads: workers are created in UCS_THREAD_MODE_MULTI. Any thread may post
// operations directly (the latency path must not pay a hand-off to another
// thread: on two vCPUs a wake-up costs ~25 us); UCX's worker lock serialises.
// The progress thread keeps the worker moving when nobody waits (tcp needs the
// target to progress for a put to land). A waiting caller drives the worker
// itself: it spins, then naps on the worker's event fd between bursts.
//
// Handoff: UCX serialises threads on a worker with a spinlock. When the caller
// and the progress thread both entered the worker, the loser spun for as long
// as the winner held it (a tcp sendmsg or recv of megabytes): a third of both
// vCPUs went to pthread_spin_lock in a 4-process training run. So a caller
// announces itself (Caller) and holds the worker (Use) for each call; the
// progress thread stays out while any caller is announced: it polls the
// announcement for 20 us, then parks on a futex that the last caller wakes
// (not on the event fd, which fires for every event the caller handles).
// So at most one thread per worker spins: two threads of a process spinning
// at once cost a scheduler time slice (4 ms) whenever the cores are
// oversubscribed.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/socket.h"
#include "tensorwire/device.h"
#include "ucx/ucx.h"

namespace tensorwire::detail {

// A spin-wait hint: lets the other hyperthread run and eases the exit from
// the spin when the watched line changes.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// A spinning waiter offers its CPU to any other runnable thread there (a
// sched_yield per clock check) once it has spun this long. The scheduler
// often puts two processes that ping-pong on one CPU, even with the other
// idle (their load adds up to less than one CPU): the peer this thread waits
// for is then queued behind its spin. Both processes of bench tensor on one
// CPU: a 4 KiB static-slot transfer took 190 us without yielding, 19 us with
// (bench/results/yield_when_spinning.txt). Shorter waits, the latency path,
// never pay the syscall.
inline constexpr std::chrono::microseconds kYieldAfter{5};

inline void yield_cpu() { sched_yield(); }

// How long a waiter naps between looks at a word a peer writes one-sidedly
// (a shared-memory write raises no event, so the nap is added latency): a
// sixteenth of the time already waited, between 20 us and 1 ms. Short waits
// (a transfer of a few hundred us) keep 20 us naps; a long one (a server
// waiting out a worker's compute) wakes ~1000 times a second instead of
// 50000, CPU that the computing processes need on a machine with few cores.
inline double watch_nap_s(double waited_s) {
  const double nap = waited_s / 16;
  return nap < 20e-6 ? 20e-6 : (nap > 1e-3 ? 1e-3 : nap);
}

class WorkerCtl {
 public:
  WorkerCtl(std::shared_ptr<ucx::Worker> worker, ProgressMode mode, unsigned spin_us, std::string name);
  ~WorkerCtl();
  WorkerCtl(const WorkerCtl&) = delete;
  WorkerCtl& operator=(const WorkerCtl&) = delete;

  void start();  // starts the progress thread (not in inline mode)
  void stop();   // joins it; idempotent
  // Announces a thread other than the progress thread that is about to use
  // the worker (post, progress, wait): the progress thread stays out of the
  // worker until the last caller has left. A no-op without a progress thread.
  class Caller {
   public:
    explicit Caller(WorkerCtl* w) : w_(w && w->handoff() ? w : nullptr) {
      if (w_ && w_->callers_.fetch_add(1, std::memory_order_seq_cst) == 0) {
        w_->holds_.fetch_add(1, std::memory_order_relaxed);  // a new hold begins
      }
    }
    ~Caller() {
      if (w_) w_->leave();
    }
    Caller(const Caller&) = delete;
    Caller& operator=(const Caller&) = delete;

   private:
    WorkerCtl* w_;
  };
  // Holds the worker for one UCX call from a caller's thread: the progress
  // thread's call in flight ends first (this thread sleeps rather than spin
  // on UCX's lock for the length of a tcp recv). Recursive: a completion
  // callback may post.
  class Use {
   public:
    explicit Use(WorkerCtl* w) : w_(w && w->handoff() ? w : nullptr) {
      if (w_) w_->lock_worker();
    }
    ~Use() {
      if (w_) w_->use_.unlock();
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    WorkerCtl* w_;
  };

  // Progress from a caller's thread.
  unsigned progress() {
    Caller c(this);
    return drive();
  }
  // Progress from a thread that already holds a Caller for this worker.
  // Deferred notifications go first: a waiter that drives this worker keeps
  // the progress thread out, so it must flush them itself.
  unsigned drive() {
    flush_deferred();
    Use u(this);
    return progress_now();
  }
  // Deferred notifications (a static slot's release in the message form):
  // posted at the next flush point on this worker instead of now, so they
  // never delay the caller's next send (a Python recv/release/send loop sent
  // the release first: 11.5 us one way over tcp instead of 6). Flush points:
  // every drive() (so every wait that drives and progress()), every post,
  // and the progress thread's loop. Only for workers with a progress thread:
  // in inline mode nothing would flush while the caller does other things.
  void defer(std::function<void()> fn);
  void flush_deferred() {
    if (has_deferred_.load(std::memory_order_acquire)) run_deferred();
  }
  // Wakes the progress thread if it sleeps on the event fd. Called after a
  // post that did not complete in place: it also makes this thread's Caller,
  // when it leaves, wake a parked progress thread (see leave()).
  void wake() {
    left_work_ = true;
    if (sleeping_.load(std::memory_order_acquire)) ucp_worker_signal(worker_->get());
  }
  // A waiter's nap: sleeps on the worker's event fd for at most `seconds`
  // (an event, such as tcp data, ends it early). Call after progress
  // returned 0, holding a Caller when a progress thread exists.
  void wait_event(double seconds);
  ProgressMode mode() const { return mode_; }
  unsigned spin_us() const { return spin_us_; }
  ucp_worker_h get() const { return worker_->get(); }
  const std::shared_ptr<ucx::Worker>& worker() const { return worker_; }
  // The tcp lanes of this worker: their frames are handled by whoever progresses it.
  net::Poller& sockets() { return sockets_; }

 private:
  void run();
  void run_deferred();
  unsigned progress_now() {
    unsigned n = ucp_worker_progress(worker_->get());
    if (!sockets_.empty()) n += sockets_.progress(0);
    return n;
  }
  // Sleeps until the worker or a socket has an event, at most `seconds` (after ucp_worker_arm).
  void poll_events(double seconds);
  void leave();
  bool handoff() const { return threaded_.load(std::memory_order_relaxed); }
  void stay_out();
  void lock_worker();

  std::shared_ptr<ucx::Worker> worker_;
  ProgressMode mode_;
  unsigned spin_us_;
  std::string name_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<std::uint32_t> callers_{0};  // see Caller; a futex word
  std::atomic<bool> parked_{false};
  std::atomic<bool> deep_park_{false};   // parked with backed-off looks: the last caller out wakes it
  long park_look_ns_;                    // the progress thread's first look when it parks (see stay_out)
  std::atomic<std::uint64_t> holds_{0};  // times callers_ went from 0 to 1
  std::atomic<bool> threaded_{false};
  std::recursive_mutex use_;  // see Use
  net::Poller sockets_;
  // Whether this thread posted work that is still in flight since its Caller
  // arrived (per thread: callers of different workers do not mix it up much,
  // and a spurious wake is only a cost).
  static inline thread_local bool left_work_ = false;
  std::atomic<bool> work_left_{false};         // the last caller left work in flight
  std::atomic<std::uint32_t> wake_seq_{0};     // a parked progress thread's futex word
  std::atomic<std::int64_t> last_left_ns_{0};  // when a caller last left
  std::atomic<bool> has_deferred_{false};
  std::mutex deferred_mu_;
  std::vector<std::function<void()>> deferred_;
};

}  // namespace tensorwire::detail
