// Copyright tensorwire authors.
//
// The one way to wait. Every wait in the core (a request, a word a peer
// writes, a slot's next tensor, any of several) is wait_for(): spin while
// driving the workers whose progress the awaited change needs, offer the CPU
// to other threads (sched_yield) past kYieldAfter, then nap on those workers'
// event fds, or sleep briefly when the change raises no event (a one-sided
// shared-memory write). It stops at the deadline and as soon as a watched
// peer failed. Only this file spins, yields and naps; the callers say what
// is ready, what failed, and which workers to drive.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/request_state.h"  // no_deadline
#include "core/worker_ctl.h"

namespace tensorwire::detail {

// The workers one wait progresses, each announced as a Caller (the progress
// thread stays out while this thread drives it; see WorkerCtl).
class Drivers {
 public:
  // More than a wait ever needs (a device has a few data workers); fixed, so
  // that a wait allocates nothing on the latency path.
  static constexpr std::size_t kMax = 16;
  Drivers() = default;
  Drivers(const Drivers&) = delete;
  Drivers& operator=(const Drivers&) = delete;
  // Ignores nullptr and repeats; InvalidArgument past kMax. `standby`: a
  // worker a message might come on, driven once every 64 rounds of a wait
  // (and napped on) so that its progress does not tax the spin on the
  // awaited word; added again without it, it is driven every round.
  void add(WorkerCtl* w, bool standby = false);
  bool empty() const { return every_round_ == 0; }  // no worker driven every round
  // Progresses each worker driven every round once; returns the events handled.
  unsigned drive() {
    unsigned events = 0;
    for (std::size_t i = 0; i < n_; ++i) {
      if (!standby_[i]) events += workers_[i]->drive();
    }
    return events;
  }
  // Progresses each standby worker once.
  unsigned drive_standby() {
    unsigned events = 0;
    if (every_round_ == n_) return events;  // none
    for (std::size_t i = 0; i < n_; ++i) {
      if (standby_[i]) events += workers_[i]->drive();
    }
    return events;
  }
  // Sleeps up to `seconds`: on the workers' event fds (an event ends the nap
  // early), or a plain sleep when there are none. `precise`: with the
  // thread's timer slack cut to 1 us for the nap (Linux adds 50 us by
  // default to every timed sleep: a 20 us watch nap would last 70).
  void nap(double seconds, bool precise = false);

 private:
  std::size_t n_ = 0, every_round_ = 0;
  WorkerCtl* workers_[kMax] = {};
  bool standby_[kMax] = {};
  std::optional<WorkerCtl::Caller> callers_[kMax];  // optional: a Caller does not move
};

struct WaitPolicy {
  // Spin this long before napping (WorkerCtl::spin_us of the driven worker).
  std::chrono::microseconds spin{50};
  // Restart the spin after each event: the events are the awaited bytes
  // arriving (a read, a slot's tensor). A send's events are its own bytes
  // leaving: spinning on them only takes the CPU that the receiver needs, so
  // those spin from the start of the wait.
  bool spin_from_events = true;
  // The awaited change raises an event on a driven worker (completion
  // callbacks, tcp data): naps may be long. Otherwise a peer writes a word
  // one-sidedly with no event, and each nap is added latency: watch_nap_s.
  bool evented = false;
  // Called with true before the first nap of kRingFromNap or more (then ready() is checked once
  // more; it may add the workers to nap on) and with false when a wait that
  // napped ends: a static slot tells its sender to ring after setting the
  // word (a doorbell message, which ends the nap on that worker's event fd).
  void (*announce)(void* ctx, bool napping, Drivers* drivers) = nullptr;
  void* announce_ctx = nullptr;
};

enum class WaitEnd { kReady, kFailed, kTimeout };

// The shortest watch nap for which a wait asks its peer to ring
// (WaitPolicy::announce): from about 800 us of waiting on.
constexpr double kRingFromNap = 50e-6;

inline std::chrono::steady_clock::time_point deadline_after(double timeout_s) {
  using clock = std::chrono::steady_clock;
  if (no_deadline(timeout_s)) return clock::time_point::max();
  return clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
}

// Waits until ready() (kReady), failed() (kFailed; checked every 64 rounds,
// so a dead peer ends the wait within a nap) or the deadline (kTimeout).
template <typename Ready, typename Failed>
WaitEnd wait_for(Drivers& drivers, Ready&& ready, Failed&& failed, std::chrono::steady_clock::time_point deadline,
                 const WaitPolicy& policy) {
  using clock = std::chrono::steady_clock;
  if (ready()) return WaitEnd::kReady;
  const auto start = clock::now();
  auto spin_since = start;
  unsigned rounds = 0;
  bool napping = false;
  struct Announced {
    const WaitPolicy& policy;
    bool on = false;
    ~Announced() {
      if (on) policy.announce(policy.announce_ctx, false, nullptr);
    }
  } announced{policy};
  for (;;) {
    if (!drivers.empty()) {
      const unsigned events = drivers.drive();
      if (ready()) return WaitEnd::kReady;
      if (events) {
        if (policy.spin_from_events) spin_since = clock::now();
        continue;  // drain before napping: arming needs an idle worker
      }
    } else {
      cpu_relax();  // a polite spin on a line the peer is about to write
      if (ready()) return WaitEnd::kReady;
    }
    if (!napping && (++rounds & 63) != 0) continue;
    if (drivers.drive_standby()) {
      if (ready()) return WaitEnd::kReady;
      if (policy.spin_from_events) spin_since = clock::now();
      continue;
    }
    if (failed()) return ready() ? WaitEnd::kReady : WaitEnd::kFailed;
    const auto now = clock::now();
    if (now >= deadline) return ready() ? WaitEnd::kReady : WaitEnd::kTimeout;
    if (!napping && now - spin_since < policy.spin) {
      if (now - start >= kYieldAfter) yield_cpu();  // the peer may be queued on this CPU
      continue;
    }
    napping = true;
    double nap = policy.evented ? 0.01 : watch_nap_s(std::chrono::duration<double>(now - start).count());
    // Ask to be rung once naps outgrow a wake-up: shorter ones end about as
    // soon as a wake message would (bench/results/idle_receiver.txt).
    if (policy.announce && !announced.on && nap >= kRingFromNap) {
      policy.announce(policy.announce_ctx, true, &drivers);
      announced.on = true;
      if (ready()) return WaitEnd::kReady;  // set before the peer could see the announcement
    }
    const double left = std::chrono::duration<double>(deadline - now).count();
    drivers.nap(left < nap ? left : nap, !policy.evented);
  }
}

// Something wait_any() watches: a slot's next tensor, a request's completion.
class WaitSource {
 public:
  virtual ~WaitSource() = default;
  // Whether the awaited thing is there (does not consume it).
  virtual bool ready() = 0;
  // Whether it can no longer become ready (its peer failed, its channel closed).
  virtual bool failed() = 0;
  // Throws why it failed (PeerFailed naming the peer, ConnectionError).
  [[noreturn]] virtual void throw_failure() = 0;
  // Adds the workers whose progress it needs, and says how it arrives.
  // Returns false when it has no say in the policy (a liveness watch).
  virtual bool prepare(Drivers& drivers, WaitPolicy& policy) = 0;
  // For the Timeout message: what was awaited ("static slot 'x': tensor 3").
  virtual std::string describe() = 0;
  // Its WaitPolicy::announce, if its wait alone would ask its peer to ring (a
  // slot's doorbell, a request's); a no-op for one that does not announce().
  // wait_any calls it for every source once any announces().
  virtual void announce(bool /*napping*/, Drivers* /*drivers*/) {}
  virtual bool announces() const { return false; }
};

// Returns the index of the first ready source (lowest index first when
// several are). Throws the failure of a failed source, or Timeout.
std::size_t wait_any(const std::vector<std::shared_ptr<WaitSource>>& sources, double timeout_s);

}  // namespace tensorwire::detail
