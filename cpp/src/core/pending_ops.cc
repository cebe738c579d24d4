// Copyright tensorwire authors.
//
// PendingOps (core/channel_impl.h): the part of a channel that UCX callbacks
// touch; and the releases of memory owners that UCX callbacks defer.
#include <atomic>
#include <mutex>
#include <vector>

#include "core/channel_impl.h"

namespace tensorwire::detail {

namespace {
std::mutex deferred_mu;
std::vector<std::shared_ptr<const void>> deferred;
std::atomic<bool> deferred_any{false};
}  // namespace

void defer_release(std::shared_ptr<const void> owner) {
  if (!owner) return;
  std::lock_guard<std::mutex> lock(deferred_mu);
  deferred.push_back(std::move(owner));
  deferred_any.store(true, std::memory_order_release);
}

void drain_deferred_releases() {
  if (!deferred_any.load(std::memory_order_acquire)) return;  // the common case: no lock
  std::vector<std::shared_ptr<const void>> owners;
  {
    std::lock_guard<std::mutex> lock(deferred_mu);
    owners.swap(deferred);
    deferred_any.store(false, std::memory_order_relaxed);
  }
  // Released here, outside the lock: a release may defer again.
}

// ---- PendingOps ----

void PendingOps::add(RequestState* state) {
  bool already_failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(state);
    already_failed = failed();
  }
  retain();  // for as long as UCX owns the operation
  if (already_failed) state->complete_error(fail_kind_, fail_message_);
}

void PendingOps::settle(RequestState* state, ucs_status_t status) {
  // UCX is done with the memory, but this may run inside its callback.
  defer_release(std::move(state->local_owner));
  defer_release(std::move(state->remote_owner));
  if (status == UCS_OK) {
    state->complete_ok();
  } else {
    state->complete_error(ucx::error_kind(status),
                          "operation to " + peer_name + " failed: " + ucs_status_string(status));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(state);
  }
  state->release();
  release();
}

void PendingOps::fail(ErrorKind kind, const std::string& why) {
  std::vector<RequestState*> to_fail;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed()) return;
    fail_kind_ = kind;
    fail_message_ = why;
    failed_.store(true, std::memory_order_release);
    to_fail.assign(pending_.begin(), pending_.end());
    for (auto* s : to_fail) s->retain();
    // Flush waiters hold their own list ref, which failing hands over.
    to_fail.insert(to_fail.end(), flush_waiters_.begin(), flush_waiters_.end());
    flush_waiters_.clear();
  }
  // Requests stay tracked (UCX still owns them); they just complete now.
  for (auto* s : to_fail) {
    s->complete_error(kind, why);
    s->release();
  }
}

void PendingOps::throw_failure() const { throw_error(fail_kind_, fail_message_); }

void PendingOps::add_message(RequestState* state, bool ordered) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++messages_;
    if (!ordered) unordered_.insert(state);
  }
  add(state);
}

void PendingOps::settle_message(RequestState* state, ucs_status_t status) {
  std::vector<RequestState*> flushed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (messages_ > 0 && --messages_ == 0) flushed.swap(flush_waiters_);
    unordered_.erase(state);
  }
  retain();  // settle() may drop the last reference to us
  settle(state, status);
  for (auto* w : flushed) {
    w->complete_ok();
    w->release();
  }
  release();
}

bool PendingOps::unordered_in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return !unordered_.empty();
}

Request PendingOps::flush_messages(const std::shared_ptr<WorkerCtl>& worker) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed()) return Request::failed(fail_kind_, fail_message_);
  if (messages_ == 0) return Request();
  auto* state = new RequestState(worker, 2);  // the Request and this list
  flush_waiters_.push_back(state);
  return Request(state);
}

}  // namespace tensorwire::detail
