// Copyright tensorwire authors.
#include "tensorwire/bench.h"

#include "core/channel_impl.h"
#include "core/waiter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>

namespace tensorwire::bench {

namespace {
using clock = std::chrono::steady_clock;

double since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

std::uint8_t tag_of(int i) { return static_cast<std::uint8_t>(i % 251 + 1); }

// Waits for a byte written by the peer, progressing the channel's worker
// (tcp needs the target to progress for a put to land). Latency tests set a
// long spin_us (perftest busy-polls). Bounded by `deadline`.
void wait_byte(Channel& ch, const volatile std::uint8_t* p, std::uint8_t value, clock::time_point deadline) {
  detail::Drivers drivers;
  drivers.add(ch.impl()->worker.get());
  detail::WaitPolicy policy;
  policy.spin = std::chrono::microseconds(ch.impl()->worker->spin_us());
  policy.evented = ch.impl()->lane().waiter_drives();  // over shared memory the byte lands with no event
  auto failed = [&] { return ch.impl()->failed(); };
  switch (detail::wait_for(drivers, [&] { return *p == value; }, failed, deadline, policy)) {
    case detail::WaitEnd::kReady: return;
    case detail::WaitEnd::kFailed: ch.impl()->check_usable(); [[fallthrough]];
    case detail::WaitEnd::kTimeout: break;
  }
  throw Timeout("benchmark peer did not answer in time (waiting for tag " + std::to_string(value) + ")");
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
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
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

std::vector<double> read_latency(Channel& ch, const LocalRegion& local, const RemoteRegion& remote, std::size_t size,
                                 int iters, int warmup) {
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
                    const std::vector<RemoteRegion>& remotes, std::size_t size, int iters, int window, int warmup,
                    double timeout_s) {
  // One streaming loop for both entry points: this one drops the post times.
  TimedOps ops = stream_ops(channels, is_write, local, remotes, size, iters, window, warmup, timeout_s);
  StreamResult result;
  result.seconds = ops.seconds;
  result.completions = std::move(ops.completions);
  return result;
}

bool wait_flag(Channel& ch, const volatile std::uint64_t* flag, std::uint64_t expected, double timeout_s) {
  // Serve the peer's traffic while waiting (core/waiter.h: spin, then nap on
  // the worker's event fd; on 2 vCPUs a spinning target starves the kernel's
  // loopback TCP work).
  detail::Drivers drivers;
  drivers.add(ch.impl()->worker.get());
  detail::WaitPolicy policy;
  policy.spin = std::chrono::microseconds(ch.impl()->worker->spin_us());
  policy.evented = ch.impl()->lane().waiter_drives();
  auto failed = [&] { return ch.impl()->failed(); };
  return detail::wait_for(
             drivers, [&] { return *flag == expected; }, failed, detail::deadline_after(timeout_s), policy) ==
         detail::WaitEnd::kReady;
}

namespace {

// The workers behind `channels` (lanes may share one), announced for this
// thread (core/waiter.h).
void drive_all(detail::Drivers& drivers, std::vector<Channel>& channels) {
  for (auto& ch : channels) drivers.add(ch.impl()->worker.get());
}

clock::duration seconds_to(double s) {
  return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

TimedStream stream_for(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                       const std::vector<RemoteRegion>& remotes, std::size_t size, int window, double duration_s,
                       double margin_s, double bin_s, double timeout_s) {
  if (channels.empty() || channels.size() != remotes.size()) throw InvalidArgument("one remote region per channel");
  if (window < 1) throw InvalidArgument("window must be >= 1");
  if (!(duration_s > 0) || margin_s < 0 || 2 * margin_s >= duration_s) {
    throw InvalidArgument("duration must be > 0 and leave a window between the two margins");
  }
  if (size == 0 || size > local.length) throw InvalidArgument("size exceeds the local buffer");
  for (auto& r : remotes) {
    if (size > r.length()) throw InvalidArgument("size exceeds a remote buffer");
  }
  const std::size_t n = channels.size();
  detail::Drivers drivers;
  drive_all(drivers, channels);
  const unsigned spin_us = channels[0].impl()->worker->spin_us();
  TimedStream res;
  res.window_start = margin_s;
  res.window_end = duration_s - margin_s;
  res.bin_s = bin_s > 0 ? bin_s : duration_s;
  res.nbins = static_cast<std::size_t>(std::ceil(duration_s / res.bin_s)) + 1;
  res.in_window.assign(n, 0);
  res.total.assign(n, 0);
  res.bins.assign(n * res.nbins, 0);
  std::vector<std::deque<Request>> inflight(n);
  const auto t0 = clock::now();
  const auto end = t0 + seconds_to(duration_s);
  const auto ws = t0 + seconds_to(res.window_start), we = t0 + seconds_to(res.window_end);
  auto last_event = t0;
  auto complete = [&](std::size_t c, clock::time_point now) {
    Request& r = inflight[c].front();
    if (r.state() < 0) r.wait(0);  // throws the operation's error (e.g. the peer failed)
    inflight[c].pop_front();
    ++res.total[c];
    if (now >= ws && now <= we) ++res.in_window[c];
    auto bin = static_cast<std::size_t>(std::chrono::duration<double>(now - t0).count() / res.bin_s);
    ++res.bins[c * res.nbins + std::min(bin, res.nbins - 1)];
  };
  // Reaps what is done on every channel (observed at `now`); returns how many.
  auto reap = [&](clock::time_point now) {
    std::size_t done = 0;
    for (std::size_t c = 0; c < n; ++c) {
      while (!inflight[c].empty() && inflight[c].front().state() != 0) {
        complete(c, now);
        ++done;
      }
    }
    return done;
  };
  auto now = t0;
  while (now < end) {
    bool active = false;
    for (std::size_t c = 0; c < n; ++c) {
      while (static_cast<int>(inflight[c].size()) < window) {
        inflight[c].push_back(is_write ? channels[c].write(local, 0, remotes[c], 0, size)
                                       : channels[c].read(local, 0, remotes[c], 0, size));
        active = true;
      }
    }
    if (drivers.drive() > 0) active = true;
    now = clock::now();
    if (reap(now) > 0) active = true;
    if (active) {
      last_event = now;
    } else if (now - last_event > std::chrono::microseconds(spin_us)) {
      drivers.nap(std::min(0.001, std::chrono::duration<double>(end - now).count()));
      now = clock::now();
      last_event = now;
    } else if (now - last_event > seconds_to(timeout_s)) {
      throw Timeout("benchmark stream made no progress in time");
    }
  }
  // Cool-down is over: drain (completions after the window do not count).
  const auto deadline = clock::now() + seconds_to(timeout_s);
  for (std::size_t c = 0; c < n; ++c) {
    while (!inflight[c].empty()) {
      inflight[c].front().wait(timeout_s);
      complete(c, clock::now());
    }
  }
  for (auto& ch : channels) {
    ch.flush().wait(std::max(0.0, std::chrono::duration<double>(deadline - clock::now()).count()));
  }
  res.elapsed_s = since(t0);
  return res;
}

TimedOps stream_ops(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                    const std::vector<RemoteRegion>& remotes, std::size_t size, std::int64_t iters, int window,
                    int warmup, double timeout_s) {
  if (channels.empty() || channels.size() != remotes.size()) throw InvalidArgument("one remote region per lane");
  if (window < 1) throw InvalidArgument("window must be >= 1");
  if (iters < 1) throw InvalidArgument("iterations must be >= 1");
  if (size == 0 || size > local.length) throw InvalidArgument("size exceeds the local buffer");
  for (auto& r : remotes) {
    if (size > r.length()) throw InvalidArgument("size exceeds a remote buffer");
  }
  const std::size_t lanes = channels.size();
  for (int i = 0; i < warmup; ++i) {  // untimed: connections, rkeys and pages are ready before t0
    Channel& ch = channels[i % lanes];
    (is_write ? ch.write(local, 0, remotes[i % lanes], 0, size) : ch.read(local, 0, remotes[i % lanes], 0, size))
        .wait(timeout_s);
  }
  for (auto& ch : channels) ch.flush().wait(timeout_s);
  std::vector<std::deque<Request>> inflight(lanes);
  TimedOps res;
  res.posted.reserve(iters);
  res.completions.reserve(iters);
  const auto t0 = clock::now();
  auto retire = [&](std::deque<Request>& q) {
    q.front().wait(timeout_s);
    q.pop_front();
    res.completions.push_back(since(t0));
  };
  for (std::int64_t i = 0; i < iters; ++i) {
    const std::size_t lane = i % lanes;
    auto& q = inflight[lane];
    while (!q.empty() && q.front().test()) {
      if (q.front().state() < 0) q.front().wait(0);
      q.pop_front();
      res.completions.push_back(since(t0));
    }
    if (static_cast<int>(q.size()) >= window) retire(q);
    Channel& ch = channels[lane];
    res.posted.push_back(since(t0));
    q.push_back(is_write ? ch.write(local, 0, remotes[lane], 0, size) : ch.read(local, 0, remotes[lane], 0, size));
  }
  for (std::size_t lane = 0; lane < lanes; ++lane) {
    while (!inflight[lane].empty()) retire(inflight[lane]);
  }
  for (auto& ch : channels) ch.flush().wait(timeout_s);
  res.seconds = since(t0);
  return res;
}

bool wait_flags(std::vector<Channel>& channels, const volatile std::uint64_t* flags, std::size_t count,
                std::uint64_t expected, double timeout_s) {
  if (channels.empty()) throw InvalidArgument("wait_flags needs a channel");
  detail::Drivers drivers;
  drive_all(drivers, channels);
  auto all_set = [&] {
    for (std::size_t i = 0; i < count; ++i) {
      if (flags[i] < expected) return false;
    }
    return true;
  };
  // The flags are written one-sidedly: over shared memory with no event, so
  // the naps are short (watch naps).
  detail::WaitPolicy policy;
  policy.spin = std::chrono::microseconds(channels[0].impl()->worker->spin_us());
  return detail::wait_for(
             drivers, all_set, [] { return false; }, detail::deadline_after(timeout_s), policy) ==
         detail::WaitEnd::kReady;
}

}  // namespace tensorwire::bench
