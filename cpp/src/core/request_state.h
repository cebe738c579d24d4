// Copyright tensorwire authors.
//
// RequestState: the shared completion record behind a pending Request.
// Reference counted by hand (one ref for the Request handle, one for UCX's
// callback, one for each list that tracks it) because UCX's callback holds a
// raw pointer. complete() is first-wins: a peer failure and a late UCX
// callback may both try to complete the same request.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "tensorwire/error.h"
#include "tensorwire/request.h"

namespace tensorwire::detail {

class WorkerCtl;
class Drivers;

// Owners of memory and rkeys must not be released inside a UCX callback (a
// slab's ucp_mem_unmap, an rkey's ucp_rkey_destroy would re-enter UCX). Such
// releases are parked and done later by a thread outside UCX: after a post,
// after a wait, when a channel or device closes.
void defer_release(std::shared_ptr<const void> owner);

// Whether a timeout means "no deadline": negative, NaN, or beyond a century
// (a huge finite value would overflow the clock's arithmetic).
inline bool no_deadline(double timeout_s) { return !(timeout_s >= 0) || timeout_s > 3e9; }
void drain_deferred_releases();

class RequestState {
 public:
  enum : int { kPending = 0, kCompleting = 1, kDone = 2, kFailed = 3 };

  explicit RequestState(std::shared_ptr<WorkerCtl> worker, int refs = 1) : refs_(refs), worker_(std::move(worker)) {}

  void retain() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void release() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Returns true if this call completed the request (false: already complete).
  bool complete_ok() { return complete(true, ErrorKind::kGeneric, {}); }
  bool complete_error(ErrorKind kind, std::string message) { return complete(false, kind, std::move(message)); }

  int status() const { return status_.load(std::memory_order_acquire); }
  bool finished() const { return status() >= kDone; }
  void wait(double timeout_s);  // throws on failure or Timeout
  bool test();                  // progresses the worker once if still pending
  void then(std::function<void(bool, const std::string&)> fn);
  ErrorKind error_kind() const { return kind_; }
  std::shared_ptr<WorkerCtl> worker() const { return worker_.lock(); }
  const std::string& error_message() const { return message_; }
  [[noreturn]] void throw_error() const;

  // The group rank of the peer whose failure failed the request (Messenger);
  // set before complete_error, -1: not a group's request or not a peer's fault.
  int failed_rank = -1;
  // Reply payload of a control-plane call (set before completion).
  std::string payload;
  // For requests that complete when a word in local memory changes (a slot's
  // ack): called by wait()/test(); returns true once the request completed
  // itself. Set before the Request is handed out; never cleared.
  std::function<bool()> poller;
  // Whether the poller's answer changes only through this worker's events
  // (completion callbacks, tcp data): then a waiter may sleep on the event
  // fd. Otherwise it watches a word a peer writes one-sidedly (shared
  // memory raises no event) and naps briefly instead.
  bool poller_evented = false;
  // For a polled word: WaitPolicy::announce of wait() (core/waiter.h), so
  // that the peer rings when it writes the word (a dynamic send's ack).
  void (*announce)(void* ctx, bool napping, Drivers* drivers) = nullptr;
  void* announce_ctx = nullptr;
  // Whether the bytes come *to* this side (a read): then the waiter's events
  // are the data arriving, and it spins for spin_us after each one rather
  // than from the start of the wait. A waiter that naps between the arrivals
  // of one read pays a wake-up per socket read (tcp reads of 1 MiB: 0.7x the
  // writes). A send's events are its own bytes leaving: spinning on them
  // only takes the CPU that the receiver needs.
  bool inbound = false;
  // What UCX may still touch while the operation runs: the local memory's
  // owner and the remote region (its rkey). Set only for pending requests.
  std::shared_ptr<const void> local_owner;
  std::shared_ptr<const void> remote_owner;

 private:
  bool complete(bool ok, ErrorKind kind, std::string message);

  std::atomic<int> refs_;
  std::atomic<int> status_{kPending};
  ErrorKind kind_ = ErrorKind::kGeneric;
  std::string message_;
  // Weak: an operation UCX never completes must not keep its worker alive
  // (destroying the worker is what finally cancels it).
  std::weak_ptr<WorkerCtl> worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void(bool, const std::string&)> callback_;
};

// A second handle to a request's state, for the core's own bookkeeping (a
// sender that must know when a send it handed out stops reading memory). It
// neither waits for nor cancels anything when dropped; users get only the
// move-only Request.
class RequestRef {
 public:
  RequestRef() = default;
  explicit RequestRef(const Request& r) : state_(r.state_) {
    if (state_) state_->retain();
  }
  RequestRef(RequestRef&& o) noexcept : state_(o.state_) { o.state_ = nullptr; }
  RequestRef& operator=(RequestRef&& o) noexcept {
    if (this != &o) {
      if (state_) state_->release();
      state_ = o.state_;
      o.state_ = nullptr;
    }
    return *this;
  }
  RequestRef(const RequestRef&) = delete;
  RequestRef& operator=(const RequestRef&) = delete;
  ~RequestRef() {
    if (state_) state_->release();
  }
  // Whether it completed (successfully or not); progresses once if not.
  bool test() { return !state_ || state_->test(); }
  // Waits for completion within timeout_s (< 0: forever): false at the
  // deadline. The operation's own error is not this caller's: ignored.
  bool wait(double timeout_s);

 private:
  RequestState* state_ = nullptr;
};

}  // namespace tensorwire::detail
