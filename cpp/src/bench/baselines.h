// Copyright tensorwire authors.
//
// How tensorwire/bench.h's UcxBaseline works (UcxBaselineImpl, its state):
// raw UCX baselines for `tensorwire bench tensor`: what a program that uses
// UCX directly (MPI, UCXX, an RPC framework on UCX) does to move a tensor,
// on a ucp context and worker of its own, independent of tensorwire's Device.
//
//  * tagged send/recv (ucp_tag_send_nbx / ucp_tag_recv_nbx): UCX picks eager
//    or rendezvous by size, as MPI and UCXX get it;
//  * an RPC over active messages: the request is serialized (copied) into a
//    message buffer, sent with ucp_am_send_nbx, received into the server's
//    message buffer and copied out into the caller's array; the server then
//    answers with a small reply AM.
//
// Addresses are exchanged by the caller (address() bytes -> connect()).
// Every call is blocking, bounded by a timeout (the core's meaning: < 0 or NaN
// waits forever, 0 does not wait; UCX failures raise the core's Error kinds,
// ucx::check), and drives the worker itself:
// it spins for `spin_us` without events, then sleeps on the worker's event fd
// (at most 1 ms at a time), as tensorwire's inline progress does.
#pragma once

#include "tensorwire/bench.h"
#include "ucx/ucx.h"

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace tensorwire::bench {

class UcxBaselineImpl {
 public:
  // transport: "auto" (UCX_TLS and the rest from the environment), "tcp",
  // "shm" (sm) or "rdma" (rc,ud,sm), applied like Device's data context:
  // the TLS override replaces UCX_TLS; NET_DEVICES=lo when `loopback` and
  // UCX_NET_DEVICES is unset.
  UcxBaselineImpl(const std::string& transport, unsigned spin_us, bool loopback);
  ~UcxBaselineImpl();
  UcxBaselineImpl(const UcxBaselineImpl&) = delete;
  UcxBaselineImpl& operator=(const UcxBaselineImpl&) = delete;

  std::string address() const;  // packed worker address
  std::string transports() const { return tls_; }
  void connect(const std::string& peer_address);
  bool connected() const { return ep_ != nullptr; }
  void close();  // idempotent; also run by the destructor

  // Tagged messaging (full tag mask). tag_recv returns the received length.
  void tag_send(const void* buffer, std::size_t nbytes, std::uint64_t tag, double timeout_s);
  std::size_t tag_recv(void* buffer, std::size_t capacity, std::uint64_t tag, double timeout_s);

  // Client side of the AM RPC: serializes `header` + the payload into a
  // request, sends it and waits for the reply, which it returns.
  std::string am_request(const std::string& header, const void* payload, std::size_t nbytes, double timeout_s);

  // Server side: waits for one request, copies its payload into `buffer`
  // (InvalidArgument if larger than `capacity`); returns header and length.
  using AmMessage = UcxBaseline::AmMessage;
  AmMessage am_recv(void* buffer, std::size_t capacity, double timeout_s);
  // Answers the last request (a small eager AM).
  void am_reply(const std::string& payload, double timeout_s);

 private:
  struct Incoming {
    std::string header;
    void* desc = nullptr;  // persistent eager data or rendezvous descriptor
    std::size_t length = 0;
    bool rndv = false;
    std::string copy;  // the data, when UCX did not let us keep it
  };
  using clock = std::chrono::steady_clock;

  static ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param);
  static ucs_status_t on_reply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  void require_ep() const;
  // Drives the worker until done() or the deadline (Timeout).
  void drive(const std::function<bool()>& done, clock::time_point deadline, const char* what);
  // Waits for a UCX request (nullptr: completed in place); cancels it on timeout.
  ucs_status_t wait_request(ucs_status_ptr_t req, clock::time_point deadline, const char* what,
                            ucp_tag_recv_info_t* tag_info = nullptr);
  void release(Incoming& in);

  mutable std::mutex mu_;  // one caller at a time (worker is single-threaded)
  std::shared_ptr<ucx::Context> context_;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  int efd_ = -1;
  unsigned spin_us_ = 100;
  std::string tls_;
  std::deque<Incoming> requests_;
  std::deque<std::string> replies_;
  std::vector<char> send_msg_;  // serialized request (reused: page faults are not the point)
  std::vector<char> recv_msg_;  // rendezvous request lands here before it is copied out
};

}  // namespace tensorwire::bench
