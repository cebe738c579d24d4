// Copyright tensorwire authors.
//
// Timed loops of the benchmarks, in C++ so the numbers measure the transport
// and not the interpreter. The Python CLI sets them up (buffers, lookups,
// peers) and turns the samples into perftest/OSU-style tables.
#pragma once

#include <cstddef>
#include <cstdint>
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
  double seconds = 0;                 // first post to last completion (incl. final flush)
  std::vector<double> completions;    // time of each observed completion, from the first post
};

// Streams `iters` writes (or reads) of `size` bytes from `local` to `remote`,
// lanes taken round-robin from `channels`, at most `window` in flight per
// lane, then flushes every lane. `warmup` operations run first, untimed.
StreamResult stream(std::vector<Channel>& channels, bool is_write, const LocalRegion& local,
                    const std::vector<RemoteRegion>& remotes, std::size_t size, int iters, int window,
                    int warmup, double timeout_s);

// Drives progress on `channel`'s worker until the 64-bit word at `flag`
// equals `expected`; false on timeout.
bool wait_flag(Channel& channel, const volatile std::uint64_t* flag, std::uint64_t expected, double timeout_s);

}  // namespace tensorwire::bench
