// Copyright tensorwire authors.
//
// Request: the handle every data-path call returns.
//
// Completion contract: a Request is complete when the operation it stands for
// is complete *locally* (for write: the local buffer may be reused; for read:
// the local buffer holds the data; for flush: every earlier operation on the
// channel is complete at the remote side). An operation that UCX completes at
// once yields a Request that is already done and allocates nothing.
//
// Requests are move-only. Destroying an unfinished Request does not cancel the
// operation: UCX finishes it in the background, and any callback still fires.
// A pending Request keeps its local memory and remote region alive. Dropping
// Channel handles does not cancel either: a lane's endpoint lives until its
// peer fails or the device closes, and then what is still in flight on it
// fails (PeerFailed / ConnectionError).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "tensorwire/error.h"

namespace tensorwire {

namespace detail {
class RequestState;
class RequestRef;
}  // namespace detail
class Awaitable;

class Request {
 public:
  // A request that is already complete, successfully.
  Request() = default;
  explicit Request(detail::RequestState* state) noexcept : state_(state) {}
  static Request failed(ErrorKind kind, std::string what);
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();

  // True once the operation completed, successfully or not. Never blocks; it
  // may drive the worker's progress once so inline-mode devices advance.
  bool test();
  // Waits until completion or until `timeout_s` seconds pass (< 0: forever).
  // Throws the operation's error, or Timeout (the operation keeps running).
  void wait(double timeout_s = -1.0);
  // Runs `fn(ok, message)` once on completion: at once (on this thread) if the
  // request is already complete, otherwise on whichever thread completes it (a
  // progress thread, a thread spinning in wait(), the thread that fails the
  // peer or closes the device). `fn` must be short and must not block.
  void then(std::function<void(bool ok, const std::string& message)> fn);

  // Status without waiting: 0 pending, 1 done, -1 failed.
  int state() const;
  // The error message of a failed request ("" otherwise).
  std::string error_message() const;
  // The error kind of a failed request (kGeneric otherwise).
  ErrorKind error_kind() const;
  // The rank (in its group) of the peer whose failure failed this request,
  // where a group's engine knows it (tensorwire/messenger.h); -1 otherwise.
  int failed_rank() const;

 private:
  friend class Awaitable;
  friend class detail::RequestRef;
  detail::RequestState* state_ = nullptr;
  // An inline failure (no state allocated).
  ErrorKind inline_error_kind_ = ErrorKind::kGeneric;
  std::string inline_error_;
  bool inline_failed_ = false;
};

}  // namespace tensorwire
