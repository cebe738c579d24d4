// Copyright tensorwire authors.
//
// WorkerCtl: one UCP worker and the policy that drives its progress.
//
// Threads: workers are created in UCS_THREAD_MODE_MULTI. Any thread may post
// operations directly (the latency path must not pay a hand-off to another
// thread: on two vCPUs a wake-up costs ~25 us); UCX's worker lock serialises.
// The progress thread keeps the worker moving when nobody waits (tcp needs the
// target to progress for a put to land). A waiting caller progresses the
// worker itself while it spins, then sleeps until the progress thread (or, in
// inline mode, the worker's event fd) wakes it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tensorwire/device.h"
#include "ucx/ucx.h"

namespace tensorwire::detail {

class WorkerCtl {
 public:
  WorkerCtl(std::shared_ptr<ucx::Worker> worker, ProgressMode mode, unsigned spin_us, std::string name);
  ~WorkerCtl();
  WorkerCtl(const WorkerCtl&) = delete;
  WorkerCtl& operator=(const WorkerCtl&) = delete;

  void start();  // starts the progress thread (not in inline mode)
  void stop();   // joins it; idempotent
  unsigned progress() {
    if (!guarded_) return ucp_worker_progress(worker_->get());
    std::lock_guard<std::mutex> lock(guard_);
    return ucp_worker_progress(worker_->get());
  }
  // Progress guard (off unless enabled before start(); data workers never pay
  // for it). While a caller holds progress_guard(), this WorkerCtl does not
  // progress the worker, so UCX applies no endpoint failure in between two of
  // the caller's calls. Needed by DeviceImpl::connect: UCX (1.22) spins
  // forever, holding the worker lock, in ucp_am_send_nbx on a client-server
  // endpoint whose connection already failed before it was wired up (its
  // failed lanes answer pending_add with BUSY). Only ucp_worker_progress
  // applies such a failure; Endpoint::close's own progress loop is not guarded.
  void enable_progress_guard() { guarded_ = true; }
  std::mutex& progress_guard() { return guard_; }
  // Wakes the progress thread if it sleeps on the event fd.
  void wake() {
    if (sleeping_.load(std::memory_order_acquire)) ucp_worker_signal(worker_->get());
  }
  // Inline mode: sleeps on the event fd for at most `seconds`.
  void wait_event(double seconds);
  ProgressMode mode() const { return mode_; }
  unsigned spin_us() const { return spin_us_; }
  ucp_worker_h get() const { return worker_->get(); }
  const std::shared_ptr<ucx::Worker>& worker() const { return worker_; }

 private:
  void run();

  std::shared_ptr<ucx::Worker> worker_;
  ProgressMode mode_;
  unsigned spin_us_;
  std::string name_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  bool guarded_ = false;
  std::mutex guard_;
};

}  // namespace tensorwire::detail
