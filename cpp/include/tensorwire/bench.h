// Copyright tensorwire authors.
//
// The benchmarks' C++ side (the lab's, beside the product's API): timed loops
// of the perftest-style benchmarks, in C++ so the numbers measure the
// transport and not the interpreter (the Python CLI sets them up and turns the
// samples into perftest/OSU-style tables), and raw UCX baselines for
// `tensorwire bench tensor`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire/channel.h"
#include "tensorwire/memory.h"

namespace tensorwire::bench {

// Ping-pong over one-sided writes (ib_write_lat / ucp_put_lat): each side
// writes `size` bytes into the other's receive buffer; the last byte carries
// the iteration tag and the receiver polls it while driving progress.
// The initiator returns one round-trip time (seconds) per timed iteration.
std::vector<double> write_pingpong(Channel& channel, const LocalRegion& send, const LocalRegion& recv,
                                   const RemoteRegion& remote_recv, std::size_t size, int iters, int warmup,
                                   bool initiator, double timeout_s);

// Read latency: one get of `size` bytes at a time; each sample is a full
// round trip (seconds).
std::vector<double> read_latency(Channel& channel, const LocalRegion& local, const RemoteRegion& remote,
                                 std::size_t size, int iters, int warmup);

struct StreamResult {
  double seconds = 0;               // first post to last completion (incl. final flush)
  std::vector<double> completions;  // time of each observed completion, from the first post
};

// Streams `iters` writes (or reads) of `size` bytes from `local` to `remote`,
// lanes taken round-robin from `channels`, at most `window` in flight per
// lane, then flushes every lane. `warmup` operations run first, untimed.
StreamResult stream(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                    const std::vector<RemoteRegion>& remotes, std::size_t size, int iters, int window, int warmup,
                    double timeout_s);

// Drives progress on `channel`'s worker until the 64-bit word at `flag`
// equals `expected`; false on timeout or once the channel failed.
bool wait_flag(Channel& channel, const volatile std::uint64_t* flag, std::uint64_t expected, double timeout_s);

// Duration mode (perftest -D): streams writes (or reads) of `size` bytes on
// every channel (a "flow" per channel: one lane to one peer) for
// `duration_s`, at most `window` in flight per channel. Only completions
// observed inside [margin_s, duration_s - margin_s] count as the sample;
// the rest is warm-up and cool-down. Then drains and flushes every channel.
// While idle (every window full, nothing completed for the worker's spin
// time) it sleeps on the worker's event fd, like the waiters of inline mode.
struct TimedStream {
  double window_start = 0, window_end = 0;  // the sampled window, seconds from the first post
  double elapsed_s = 0;                     // first post to end of the final flush
  double bin_s = 0;                         // width of a bin of `bins`
  std::size_t nbins = 0;
  std::vector<std::uint64_t> in_window;  // per channel: completions inside the window
  std::vector<std::uint64_t> total;      // per channel: completions
  std::vector<std::uint32_t> bins;       // channel-major [channel * nbins + bin]: completions per bin
};

TimedStream stream_for(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                       const std::vector<RemoteRegion>& remotes, std::size_t size, int window, double duration_s,
                       double margin_s, double bin_s, double timeout_s);

// Iteration mode with post times (perftest's tposted/tcompleted): like
// stream() but also records when each operation was posted, in post order.
struct TimedOps {
  double seconds = 0;               // first post to last completion, incl. the final flush
  std::vector<double> posted;       // post time of every operation (post order)
  std::vector<double> completions;  // time each completion was observed (observation order)
};
TimedOps stream_ops(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                    const std::vector<RemoteRegion>& remotes, std::size_t size, std::int64_t iters, int window,
                    int warmup, double timeout_s);

// Drives progress on every distinct worker of `channels` until each of the
// `count` 64-bit words at `flags` is >= `expected` (peers raise theirs with a
// one-sided write when they are done); false on timeout.
bool wait_flags(std::vector<Channel>& channels, const volatile std::uint64_t* flags, std::size_t count,
                std::uint64_t expected, double timeout_s);

// What a program that uses UCX directly (MPI, UCXX, an RPC framework on UCX)
// does to move a tensor, on a ucp context and worker of its own, independent
// of tensorwire's Device (bench/baselines.h has how):
//  * tagged send/recv (ucp_tag_send_nbx / ucp_tag_recv_nbx): UCX picks eager
//    or rendezvous by size, as MPI and UCXX get it;
//  * an RPC over active messages: the request is serialized (copied) into a
//    message buffer, sent, received into the server's message buffer and
//    copied out into the caller's array; the server answers with a small reply.
// Addresses are exchanged by the caller (address() bytes -> connect()). Every
// call blocks, bounded by a timeout (the core's meaning: < 0 or NaN waits
// forever, 0 does not wait; UCX failures raise the core's Error kinds).
class UcxBaselineImpl;
class UcxBaseline {
 public:
  // transport: "auto" (UCX_TLS and the rest from the environment), "tcp",
  // "shm" (sm) or "rdma" (rc,ud,sm), applied like Device's data context;
  // NET_DEVICES=lo when `loopback` and UCX_NET_DEVICES is unset. The caller
  // spins `spin_us` before it sleeps on the worker's event fd.
  UcxBaseline(const std::string& transport, unsigned spin_us, bool loopback);
  ~UcxBaseline();
  UcxBaseline(const UcxBaseline&) = delete;
  UcxBaseline& operator=(const UcxBaseline&) = delete;

  std::string address() const;  // packed worker address
  std::string transports() const;
  void connect(const std::string& peer_address);
  bool connected() const;
  void close();  // idempotent; also run by the destructor

  // Tagged messaging (full tag mask). tag_recv returns the received length.
  void tag_send(const void* buffer, std::size_t nbytes, std::uint64_t tag, double timeout_s);
  std::size_t tag_recv(void* buffer, std::size_t capacity, std::uint64_t tag, double timeout_s);

  // Client side of the AM RPC: serializes `header` + the payload into a
  // request, sends it and waits for the reply, which it returns.
  std::string am_request(const std::string& header, const void* payload, std::size_t nbytes, double timeout_s);

  // Server side: waits for one request, copies its payload into `buffer`
  // (InvalidArgument if larger than `capacity`); returns header and length.
  struct AmMessage {
    std::string header;
    std::size_t nbytes = 0;
  };
  AmMessage am_recv(void* buffer, std::size_t capacity, double timeout_s);
  // Answers the last request (a small eager AM).
  void am_reply(const std::string& payload, double timeout_s);

 private:
  std::unique_ptr<UcxBaselineImpl> impl_;
};

}  // namespace tensorwire::bench
