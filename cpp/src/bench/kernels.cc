// Copyright tensorwire authors.
#include "bench/kernels.h"

#include "core/device_impl.h"

#include <chrono>
#include <deque>

namespace tensorwire::bench {

namespace {
using clock = std::chrono::steady_clock;

double since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

std::uint8_t tag_of(int i) { return static_cast<std::uint8_t>(i % 251 + 1); }

// Spins on a byte written by the peer, progressing the worker (tcp needs the
// target to progress for a put to land). Bounded by `timeout_s`.
void wait_byte(Channel& ch, const volatile std::uint8_t* p, std::uint8_t value, clock::time_point deadline) {
  unsigned spins = 0;
  while (*p != value) {
    ch.progress();
    if ((++spins & 1023) == 0 && clock::now() > deadline) {
      throw Timeout("benchmark peer did not answer in time (waiting for tag " + std::to_string(value) + ")");
    }
  }
}
}  // namespace

std::vector<double> write_pingpong(Channel& ch, const LocalRegion& send, const LocalRegion& recv,
                                   const RemoteRegion& remote_recv, std::size_t size, int iters, int warmup,
                                   bool initiator, double timeout_s) {
  if (size == 0 || size > send.length || size > recv.length || size > remote_recv.length()) {
    throw InvalidArgument("ping-pong size exceeds a buffer");
  }
  auto* out = static_cast<volatile std::uint8_t*>(send.address) + size - 1;
  auto* in = static_cast<const volatile std::uint8_t*>(recv.address) + size - 1;
  std::vector<double> samples;
  samples.reserve(iters);
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  for (int i = 0; i < warmup + iters; ++i) {
    const std::uint8_t tag = tag_of(i);
    auto t0 = clock::now();
    if (initiator) {
      *out = tag;
      ch.write(send, 0, remote_recv, 0, size).wait(timeout_s);
      wait_byte(ch, in, tag, deadline);
      if (i >= warmup) samples.push_back(since(t0));
    } else {
      wait_byte(ch, in, tag, deadline);
      *out = tag;
      ch.write(send, 0, remote_recv, 0, size).wait(timeout_s);
    }
  }
  return samples;
}

std::vector<double> read_latency(Channel& ch, const LocalRegion& local, const RemoteRegion& remote,
                                 std::size_t size, int iters, int warmup) {
  std::vector<double> samples;
  samples.reserve(iters);
  for (int i = 0; i < warmup + iters; ++i) {
    auto t0 = clock::now();
    ch.read(local, 0, remote, 0, size).wait(30.0);
    if (i >= warmup) samples.push_back(since(t0));
  }
  return samples;
}

StreamResult stream(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                    const std::vector<RemoteRegion>& remotes, std::size_t size, int iters, int window,
                    int warmup, double timeout_s) {
  if (channels.empty() || channels.size() != remotes.size()) throw InvalidArgument("one remote region per lane");
  if (window < 1) throw InvalidArgument("window must be >= 1");
  const std::size_t lanes = channels.size();
  // Untimed warm-up: connections, rkeys and pages are ready before t0.
  for (int i = 0; i < warmup; ++i) {
    Channel& ch = channels[i % lanes];
    const RemoteRegion& r = remotes[i % lanes];
    (is_write ? ch.write(local, 0, r, 0, size) : ch.read(local, 0, r, 0, size)).wait(timeout_s);
  }
  for (auto& ch : channels) ch.flush().wait(timeout_s);
  std::vector<std::deque<Request>> inflight(lanes);
  StreamResult result;
  result.completions.reserve(iters);
  const auto t0 = clock::now();
  auto retire = [&](std::deque<Request>& q) {
    q.front().wait(timeout_s);
    q.pop_front();
    result.completions.push_back(since(t0));
  };
  for (int i = 0; i < iters; ++i) {
    const std::size_t lane = i % lanes;
    auto& q = inflight[lane];
    // Reap what is already done without blocking, then block only when full.
    while (!q.empty() && q.front().test()) {
      q.pop_front();
      result.completions.push_back(since(t0));
    }
    if (static_cast<int>(q.size()) >= window) retire(q);
    Channel& ch = channels[lane];
    q.push_back(is_write ? ch.write(local, 0, remotes[lane], 0, size) : ch.read(local, 0, remotes[lane], 0, size));
  }
  for (std::size_t lane = 0; lane < lanes; ++lane) {
    while (!inflight[lane].empty()) retire(inflight[lane]);
  }
  for (auto& ch : channels) ch.flush().wait(timeout_s);
  result.seconds = since(t0);
  return result;
}

bool wait_flag(Channel& ch, const volatile std::uint64_t* flag, std::uint64_t expected, double timeout_s) {
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  // Serve the peer's traffic: progress while there is work, and sleep on the
  // worker's event fd once idle (on 2 vCPUs a spinning target starves the
  // kernel's loopback TCP work).
  auto& worker = *ch.impl()->worker;
  auto last_event = clock::now();
  const auto spin = std::chrono::microseconds(worker.spin_us());
  unsigned spins = 0;
  while (*flag != expected) {
    if (ch.progress() > 0) {
      last_event = clock::now();
      continue;
    }
    if ((++spins & 63) != 0) continue;
    auto now = clock::now();
    if (now > deadline) return false;
    if (now - last_event > spin) {
      worker.wait_event(0.001);
      last_event = clock::now();
    }
  }
  return true;
}

}  // namespace tensorwire::bench
