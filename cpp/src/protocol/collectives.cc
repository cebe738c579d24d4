// Copyright tensorwire authors.
//
// The collectives on a Messenger (tensorwire/collectives.h): each call takes a
// fresh negative tag, posts its messages as requests and waits for them in
// steps, all within one deadline. docs/collectives.md ("The C++ collectives
// layer") gives the algorithms and why their thresholds are where they are.
#include "tensorwire/collectives.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <set>
#include <string>

#include "protocol/reduce.h"
#include "tensorwire/error.h"

namespace tensorwire {

namespace {

// all_reduce up to this many bytes takes recursive doubling: ceil(log2 p)
// rounds (2 more where p is not a power of two) of the whole vector, against
// the ring's 2(p-1) rounds of 1/p of it. At 64 KiB a round's latency (a few
// microseconds) still weighs about as much as the copy; above it the ring's
// 2n(p-1)/p bytes per rank beat doubling's n log2 p. It is also below the
// engine's eager limit (128 KiB), so every small round is one eager message.
constexpr std::size_t kSmallAllreduceBytes = std::size_t(64) << 10;
// broadcast from this size on (and 3 ranks or more) scatters the data from
// the root and all-gathers it on a ring: the root sends about n instead of
// n log2 p, and every link carries about 2n(p-1)/p.
constexpr std::size_t kLargeBroadcastBytes = std::size_t(512) << 10;
// How often a wait on one request looks at the others: a peer's failure on a
// later request surfaces within this, not at the deadline.
constexpr double kWaitSliceS = 0.05;

using Clock = std::chrono::steady_clock;

int mod(int a, int p) { return ((a % p) + p) % p; }

// [off, +n) of `b`, in the same allocation (base/base_bytes/keep as `b`'s).
Buffer sub(const Buffer& b, std::size_t off, std::size_t n) {
  Buffer r;
  r.data = static_cast<std::byte*>(b.data) + off;
  r.nbytes = n;
  r.base = b.base ? b.base : b.data;
  r.base_bytes = b.base ? b.base_bytes : b.nbytes;
  r.keep = b.keep;
  return r;
}

std::byte* at(const Buffer& b, std::size_t off) { return static_cast<std::byte*>(b.data) + off; }

std::size_t checked_bytes(std::size_t count, std::size_t itemsize, const char* op) {
  if (itemsize && count > std::numeric_limits<std::size_t>::max() / itemsize) {
    throw InvalidArgument(std::string(op) + ": " + std::to_string(count) + " elements overflow the byte count");
  }
  return count * itemsize;
}

void need(const Buffer& b, std::size_t bytes, const char* op, const char* what) {
  if (b.nbytes < bytes) {
    throw InvalidArgument(std::string(op) + ": " + what + " holds " + std::to_string(b.nbytes) + " bytes, " +
                          std::to_string(bytes) + " needed");
  }
  if (bytes && !b.data) throw InvalidArgument(std::string(op) + ": " + what + " has no memory (data is null)");
}

void check_root(int root, int size, const char* op) {
  if (root < 0 || root >= size) {
    throw InvalidArgument(std::string(op) + ": root " + std::to_string(root) + " is not a rank of a group of " +
                          std::to_string(size));
  }
}

bool overlap(const void* a, std::size_t an, const void* b, std::size_t bn) {
  auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

}  // namespace

// One call: its tag, its deadline and the requests it posted.
class Collectives::Call {
 public:
  Call(Collectives& owner, const char* op, double timeout_s) : owner_(owner), op_(op), tag_(owner.next_tag()) {
    timeout_s_ = timeout_s < 0 ? owner.m_.timeout() : timeout_s;
    if (!(timeout_s_ >= 0) || timeout_s_ > 3e9) {
      deadline_ = Clock::time_point::max();
    } else {
      deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
    }
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  ~Call() {
    // A failed call may leave requests in flight that still read or write the
    // scratch areas: the next call must not reuse them (the engine's requests
    // keep them alive through Buffer::keep).
    for (auto& p : posted_) {
      if (p.request.state() == 0) {
        owner_.drop_scratch();
        break;
      }
    }
  }

  void send(const Buffer& b, int peer) { posted_.push_back({owner_.m_.isend(b, peer, tag_), peer, false}); }
  void recv(const Buffer& b, int peer) { posted_.push_back({owner_.m_.irecv(b, peer, tag_), peer, true}); }

  // Waits for every posted request within the call's deadline. The first
  // request that failed is rethrown as it is (PeerFailed names the rank);
  // the deadline throws Timeout naming the op and the ranks still pending.
  void wait_all() {
    for (auto& p : posted_) {
      for (;;) {
        rethrow_failed();
        if (p.request.state() != 0) break;
        const auto now = Clock::now();
        if (now >= deadline_) throw_timeout();
        const double left = std::chrono::duration<double>(deadline_ - now).count();
        try {
          p.request.wait(std::min(left, kWaitSliceS));
          break;
        } catch (const Timeout&) {
          // It may have failed just as the slice ended: its own error, not the slice's.
          rethrow_failed();
          if (p.request.state() > 0) break;  // completed just as the slice ended
        }
      }
    }
    rethrow_failed();
    posted_.clear();
  }

 private:
  struct Posted {
    Request request;
    int peer;
    bool recv;
  };

  void rethrow_failed() {
    for (auto& p : posted_) {
      if (p.request.state() < 0) p.request.wait(0);  // throws its error, typed as it failed
    }
  }

  [[noreturn]] void throw_timeout() {
    std::string pending;
    std::set<int> ranks;
    for (auto& p : posted_) {
      if (p.request.state() != 0) continue;
      ranks.insert(p.peer);
      pending += (pending.empty() ? "" : ", ") + std::string(p.recv ? "a receive from rank " : "a send to rank ") +
                 std::to_string(p.peer);
    }
    std::string list;
    for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", timeout_s_);
    throw Timeout(std::string(op_) + " on rank " + std::to_string(owner_.rank()) + " timed out after " + secs +
                  " s waiting for rank(s) " + list + " (" + pending + "; tag " + std::to_string(tag_) +
                  "); the group's collectives are no longer aligned");
  }

  Collectives& owner_;
  const char* op_;
  std::int64_t tag_;
  double timeout_s_;
  Clock::time_point deadline_;
  std::vector<Posted> posted_;
};

std::size_t Collectives::small_allreduce_bytes() {
  if (const char* v = std::getenv("TENSORWIRE_COLL_SMALL_BYTES")) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (end && *end == '\0' && end != v) return static_cast<std::size_t>(n);
  }
  return kSmallAllreduceBytes;
}

std::int64_t Collectives::next_tag() {
  // Negative, fresh per call: the engine matches per (peer, tag) in order, so
  // a late message of one call can never be taken by the next.
  return -1 - static_cast<std::int64_t>(calls_++ % (std::uint64_t(1) << 48));
}

void Collectives::reserve(Area a, std::size_t bytes) {
  Scratch& s = scratch_[a];
  if (s.memory && s.bytes >= bytes) return;
  std::size_t n = 4096;
  while (n < bytes && n <= std::numeric_limits<std::size_t>::max() / 2) n *= 2;
  if (n < bytes) n = bytes;
  auto* p = static_cast<std::byte*>(::operator new(n, std::align_val_t(64)));
  s.memory = std::shared_ptr<std::byte>(p, [](std::byte* q) { ::operator delete(q, std::align_val_t(64)); });
  s.bytes = n;
}

Buffer Collectives::scratch(Area a, std::size_t offset, std::size_t nbytes) const {
  const Scratch& s = scratch_[a];
  Buffer b;
  b.data = s.memory.get() + offset;
  b.nbytes = nbytes;
  b.base = s.memory.get();
  b.base_bytes = s.bytes;
  b.keep = s.memory;
  return b;
}

void* Collectives::scratch_data(Area a, std::size_t offset) const { return scratch_[a].memory.get() + offset; }

void Collectives::drop_scratch() {
  for (auto& s : scratch_) s = Scratch{};
}

// ---- all_reduce ----

const char* allreduce_algorithm_name(AllreduceAlgorithm a) {
  switch (a) {
    case AllreduceAlgorithm::kAuto: return "auto";
    case AllreduceAlgorithm::kDoubling: return "doubling";
    case AllreduceAlgorithm::kRing: return "ring";
  }
  return "?";
}

AllreduceAlgorithm Collectives::allreduce_algorithm(std::size_t count, DType dtype) const {
  const std::size_t bytes = checked_bytes(count, dtype.itemsize(), "allreduce");
  return bytes <= small_bytes_ || count < static_cast<std::size_t>(size()) ? AllreduceAlgorithm::kDoubling
                                                                           : AllreduceAlgorithm::kRing;
}

void Collectives::allreduce(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, double factor,
                            double timeout_s, AllreduceAlgorithm algorithm) {
  detail::check_reduce(dtype, op);
  const std::size_t bytes = checked_bytes(count, dtype.itemsize(), "allreduce");
  need(data, bytes, "allreduce", "data");
  Call call(*this, "allreduce", timeout_s);
  if (count == 0) return;
  // The result replaces `data`, so its own scaled input may too.
  if (op == ReduceOp::kPremulSum) detail::scale_into(data.data, data.data, count, dtype, factor);
  const ReduceOp rop = (op == ReduceOp::kAvg || op == ReduceOp::kPremulSum) ? ReduceOp::kSum : op;
  if (algorithm == AllreduceAlgorithm::kAuto) algorithm = allreduce_algorithm(count, dtype);
  if (size() > 1) {
    if (algorithm == AllreduceAlgorithm::kDoubling) {
      allreduce_doubling(data, count, dtype, rop, call);
    } else {
      allreduce_ring(data, count, dtype, rop, call);
    }
  }
  if (op == ReduceOp::kAvg) detail::divide_in_place(data.data, count, dtype, size());
}

// Recursive doubling over the largest power of two p' <= p. The first
// 2(p - p') ranks pair up first: each even one hands its data to the odd one
// after it and gets the result back at the end. Every combination is
// op(lower ranks' partial, higher ranks' partial), on every rank alike, so all
// ranks end with the same bits (signed zeros and NaN payloads included).
void Collectives::allreduce_doubling(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, Call& call) {
  const int p = size(), r = rank();
  const std::size_t bytes = count * dtype.itemsize();
  reserve(kRecv, bytes);
  const Buffer in = scratch(kRecv, 0, bytes);
  // data = op(lower, higher) where the peer's partial is in `in`.
  auto combine = [&](bool peer_is_lower) {
    if (peer_is_lower) {
      reduce_into(in.data, data.data, count, dtype, op);
      std::memcpy(data.data, in.data, bytes);
    } else {
      reduce_into(data.data, in.data, count, dtype, op);
    }
  };
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  const int extra = p - pof2;
  int vr;
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      // Causality keeps this safe: the partner writes back only after it has all of `data`.
      call.send(data, r + 1);
      call.recv(data, r + 1);
      call.wait_all();
      return;
    }
    call.recv(in, r - 1);
    call.wait_all();
    combine(true);
    vr = r / 2;
  } else {
    vr = r - extra;
  }
  for (int mask = 1; mask < pof2; mask <<= 1) {
    const int vpeer = vr ^ mask;
    const int peer = vpeer < extra ? 2 * vpeer + 1 : vpeer + extra;
    call.recv(in, peer);
    call.send(data, peer);
    call.wait_all();
    combine(vpeer < vr);
  }
  if (r < 2 * extra) {
    call.send(data, r - 1);
    call.wait_all();
  }
}

// Reduce-scatter on a ring (after it rank r holds block r reduced), then the
// blocks all-gathered on the ring. Each block is reduced once, by one chain
// of ranks, so every rank gets the same bits.
void Collectives::allreduce_ring(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, Call& call) {
  const int p = size(), r = rank();
  const std::size_t item = dtype.itemsize();
  std::vector<std::size_t> off(p), len(p);
  for (int i = 0; i < p; ++i) {
    len[i] = (count / p + (static_cast<std::size_t>(i) < count % p ? 1 : 0)) * item;
    off[i] = i ? off[i - 1] + len[i - 1] : 0;
  }
  reserve(kRecv, len[0]);  // block 0 is the largest
  const int right = mod(r + 1, p), left = mod(r - 1, p);
  for (int s = 0; s + 1 < p; ++s) {
    const int sb = mod(r - s - 1, p), rb = mod(r - s - 2, p);
    call.recv(scratch(kRecv, 0, len[rb]), left);
    call.send(sub(data, off[sb], len[sb]), right);
    call.wait_all();
    reduce_into(at(data, off[rb]), scratch_data(kRecv, 0), len[rb] / item, dtype, op);
  }
  ring_allgather(data, off, len, call);
}

void Collectives::ring_allgather(const Buffer& data, const std::vector<std::size_t>& off,
                                 const std::vector<std::size_t>& len, Call& call) {
  const int p = size(), r = rank();
  const int right = mod(r + 1, p), left = mod(r - 1, p);
  for (int s = 0; s + 1 < p; ++s) {
    const int sb = mod(r - s, p), rb = mod(r - s - 1, p);
    if (len[rb]) call.recv(sub(data, off[rb], len[rb]), left);
    if (len[sb]) call.send(sub(data, off[sb], len[sb]), right);
    call.wait_all();
  }
}

// ---- reduce ----

// Up to kSmallAllreduceBytes (or fewer elements than ranks), a binomial tree
// towards the root: a rank adds its children's partials (in scratch) to its
// own (a copy in scratch, so that non-root data is left as it was; the root
// reduces into its data) and sends the sum to its parent. Larger: reduce_large.
void Collectives::reduce(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, int root, double factor,
                         double timeout_s) {
  detail::check_reduce(dtype, op);
  check_root(root, size(), "reduce");
  const std::size_t bytes = checked_bytes(count, dtype.itemsize(), "reduce");
  need(data, bytes, "reduce", "data");
  Call call(*this, "reduce", timeout_s);
  if (count == 0) return;
  const int p = size(), r = rank();
  const bool premul = op == ReduceOp::kPremulSum;
  const ReduceOp rop = (op == ReduceOp::kAvg || premul) ? ReduceOp::kSum : op;
  if (p > 1 && bytes > small_bytes_ && count >= static_cast<std::size_t>(p)) {
    reduce_large(data, count, dtype, rop, root, premul, factor, call);
    if (r == root && op == ReduceOp::kAvg) detail::divide_in_place(data.data, count, dtype, p);
    return;
  }
  const int vr = mod(r - root, p);
  const bool has_children = vr % 2 == 0 && vr + 1 < p;
  Buffer acc = data;  // a leaf sends its data as it is
  if (r == root) {
    if (premul) detail::scale_into(data.data, data.data, count, dtype, factor);
  } else if (has_children || premul) {
    reserve(kWork, bytes);
    acc = scratch(kWork, 0, bytes);
    if (premul) {
      detail::scale_into(acc.data, data.data, count, dtype, factor);
    } else {
      std::memcpy(acc.data, data.data, bytes);
    }
  }
  if (has_children) reserve(kRecv, bytes);
  for (int mask = 1; mask < p; mask <<= 1) {
    if (vr & mask) {
      call.send(acc, mod(vr - mask + root, p));
      call.wait_all();
      break;
    }
    if (vr + mask < p) {
      call.recv(scratch(kRecv, 0, bytes), mod(vr + mask + root, p));
      call.wait_all();
      reduce_into(acc.data, scratch_data(kRecv, 0), count, dtype, rop);
    }
  }
  if (r == root && op == ReduceOp::kAvg) detail::divide_in_place(data.data, count, dtype, p);
}

// A large reduce: a ring reduce-scatter (each rank ends with one block of the
// result, having moved n(p-1)/p bytes), then every block straight to the
// root. The tree moves n per level instead, and the root reduces log2 p whole
// vectors. The root's data is only read until its ring is done; the blocks
// land in it after.
void Collectives::reduce_large(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, int root, bool premul,
                               double factor, Call& call) {
  const int p = size(), r = rank();
  const std::size_t item = dtype.itemsize(), bytes = count * item;
  std::vector<std::size_t> off(p), len(p);
  for (int i = 0; i < p; ++i) {
    len[i] = (count / p + (static_cast<std::size_t>(i) < count % p ? 1 : 0)) * item;
    off[i] = i ? off[i - 1] + len[i - 1] : 0;
  }
  Buffer src = data;
  if (premul) {
    reserve(kWork, bytes);
    src = scratch(kWork, 0, bytes);
    detail::scale_into(src.data, data.data, count, dtype, factor);
  }
  reserve(kRecv, 2 * len[0]);
  const std::size_t result = ring_reduce_scatter(src, off, len, dtype, op, call);
  if (r != root) {
    call.send(scratch(kRecv, result, len[r]), root);
    call.wait_all();
    return;
  }
  for (int i = 0; i < p; ++i) {
    if (i != root) call.recv(sub(data, off[i], len[i]), i);
  }
  std::memcpy(at(data, off[r]), scratch_data(kRecv, result), len[r]);
  call.wait_all();
}

// ---- broadcast ----

void Collectives::broadcast(const Buffer& data, int root, double timeout_s) {
  check_root(root, size(), "broadcast");
  need(data, data.nbytes, "broadcast", "data");
  Call call(*this, "broadcast", timeout_s);
  if (size() == 1 || data.nbytes == 0) return;
  if (data.nbytes >= kLargeBroadcastBytes && size() >= 3) {
    broadcast_scatter_allgather(data, root, call);
  } else {
    broadcast_tree(data, root, call);
  }
}

// Binomial tree: a rank receives from the parent that differs in its lowest
// set bit (relative to the root), then sends to its children, farthest first.
void Collectives::broadcast_tree(const Buffer& data, int root, Call& call) {
  const int p = size(), vr = mod(rank() - root, p);
  int mask = 1;
  while (mask < p) {
    if (vr & mask) {
      call.recv(data, mod(vr - mask + root, p));
      call.wait_all();
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < p) call.send(data, mod(vr + mask + root, p));
  }
  call.wait_all();
}

// The root sends block i to rank i, then the ring all-gathers the blocks. The
// root receives its ring block into scratch: its data stays untouched.
void Collectives::broadcast_scatter_allgather(const Buffer& data, int root, Call& call) {
  const int p = size(), r = rank();
  const std::size_t n = data.nbytes;
  std::vector<std::size_t> off(p), len(p);
  for (int i = 0; i < p; ++i) {
    len[i] = n / p + (static_cast<std::size_t>(i) < n % p ? 1 : 0);
    off[i] = i ? off[i - 1] + len[i - 1] : 0;
  }
  if (r == root) {
    for (int i = 0; i < p; ++i) {
      if (i != root && len[i]) call.send(sub(data, off[i], len[i]), i);
    }
  } else if (len[r]) {
    call.recv(sub(data, off[r], len[r]), root);
  }
  call.wait_all();
  if (r != root) {
    ring_allgather(data, off, len, call);
    return;
  }
  // The root's turn in the ring: it sends as every rank does, and what it is
  // sent (its own bytes back) lands in scratch.
  reserve(kRecv, len[0]);
  const int right = mod(r + 1, p), left = mod(r - 1, p);
  for (int s = 0; s + 1 < p; ++s) {
    const int sb = mod(r - s, p), rb = mod(r - s - 1, p);
    if (len[rb]) call.recv(scratch(kRecv, 0, len[rb]), left);
    if (len[sb]) call.send(sub(data, off[sb], len[sb]), right);
    call.wait_all();
  }
}

// ---- all_gather, reduce_scatter ----

void Collectives::allgather(const Buffer& in, const Buffer& out, double timeout_s) {
  const std::size_t nb = in.nbytes;
  const std::size_t p = static_cast<std::size_t>(size());
  if (nb && p > std::numeric_limits<std::size_t>::max() / nb) throw InvalidArgument("allgather: size overflows");
  need(in, nb, "allgather", "in");
  need(out, p * nb, "allgather", "out");
  Call call(*this, "allgather", timeout_s);
  if (nb == 0) return;
  // In place (in is out's own block) is common (FSDP): then nothing to copy.
  if (in.data != at(out, rank() * nb)) std::memmove(at(out, rank() * nb), in.data, nb);
  if (p == 1) return;
  std::vector<std::size_t> off(p), len(p, nb);
  for (std::size_t i = 0; i < p; ++i) off[i] = i * nb;
  ring_allgather(out, off, len, call);
}

// A ring reduce-scatter of `src` (blocks [off[i], +len[i]) bytes, block 0 the
// largest): at step s a rank sends the partial of block r-s-1 and receives
// that of block r-s-2, adding its own contribution to it, so that block r is
// its result after p-1 steps. Step 0 sends straight from `src`, which is only
// read; the partials alternate between two halves of kRecv (reserved by the
// caller: 2 * len[0]). Returns the offset in kRecv of block r's result.
std::size_t Collectives::ring_reduce_scatter(const Buffer& src, const std::vector<std::size_t>& off,
                                             const std::vector<std::size_t>& len, DType dtype, ReduceOp op,
                                             Call& call) {
  const int p = size(), r = rank();
  const std::size_t half = len[0], item = dtype.itemsize();
  const int right = mod(r + 1, p), left = mod(r - 1, p);
  for (int s = 0; s + 1 < p; ++s) {
    const int sb = mod(r - s - 1, p), rb = mod(r - s - 2, p);
    const std::size_t mine = static_cast<std::size_t>(s % 2) * half, prev = half - mine;
    if (len[rb]) call.recv(scratch(kRecv, mine, len[rb]), left);
    if (len[sb]) call.send(s == 0 ? sub(src, off[sb], len[sb]) : scratch(kRecv, prev, len[sb]), right);
    call.wait_all();
    reduce_into(scratch_data(kRecv, mine), at(src, off[rb]), len[rb] / item, dtype, op);
  }
  return static_cast<std::size_t>((p - 2) % 2) * half;
}

// reduce_scatter: ring_reduce_scatter on blocks of `count` elements.
void Collectives::reduce_scatter(const Buffer& in, const Buffer& out, std::size_t count, DType dtype, ReduceOp op,
                                 double factor, double timeout_s) {
  detail::check_reduce(dtype, op);
  const int p = size();
  const std::size_t bytes = checked_bytes(count, dtype.itemsize(), "reduce_scatter");
  const std::size_t total = checked_bytes(bytes, static_cast<std::size_t>(p), "reduce_scatter");
  need(in, total, "reduce_scatter", "in");
  need(out, bytes, "reduce_scatter", "out");
  Call call(*this, "reduce_scatter", timeout_s);
  if (count == 0) return;
  const bool premul = op == ReduceOp::kPremulSum;
  const ReduceOp rop = (op == ReduceOp::kAvg || premul) ? ReduceOp::kSum : op;
  Buffer src = in;
  if (premul) {
    reserve(kWork, total);
    src = scratch(kWork, 0, total);
    detail::scale_into(src.data, in.data, count * p, dtype, factor);
  }
  if (p == 1) {
    std::memmove(out.data, src.data, bytes);
  } else {
    std::vector<std::size_t> off(p), len(p, bytes);
    for (int i = 0; i < p; ++i) off[i] = i * bytes;
    reserve(kRecv, 2 * bytes);
    const std::size_t result = ring_reduce_scatter(src, off, len, dtype, rop, call);
    // (out may be in's own block r: only now is it written.)
    std::memcpy(out.data, scratch_data(kRecv, result), bytes);
  }
  if (op == ReduceOp::kAvg) detail::divide_in_place(out.data, count, dtype, p);
}

// ---- gather, scatter, all_to_all ----

void Collectives::gather(const Buffer& in, const Buffer& out, int root, double timeout_s) {
  check_root(root, size(), "gather");
  const std::size_t nb = in.nbytes, p = static_cast<std::size_t>(size());
  need(in, nb, "gather", "in");
  if (rank() == root) {
    if (nb && p > std::numeric_limits<std::size_t>::max() / nb) throw InvalidArgument("gather: size overflows");
    need(out, p * nb, "gather", "out");
  }
  Call call(*this, "gather", timeout_s);
  if (nb == 0) return;
  if (rank() != root) {
    call.send(in, root);
    call.wait_all();
    return;
  }
  for (std::size_t i = 0; i < p; ++i) {
    if (static_cast<int>(i) != root) call.recv(sub(out, i * nb, nb), static_cast<int>(i));
  }
  if (in.data != at(out, root * nb)) std::memmove(at(out, root * nb), in.data, nb);
  call.wait_all();
}

void Collectives::scatter(const Buffer& in, const Buffer& out, int root, double timeout_s) {
  check_root(root, size(), "scatter");
  const std::size_t nb = out.nbytes, p = static_cast<std::size_t>(size());
  need(out, nb, "scatter", "out");
  if (rank() == root) {
    if (nb && p > std::numeric_limits<std::size_t>::max() / nb) throw InvalidArgument("scatter: size overflows");
    need(in, p * nb, "scatter", "in");
  }
  Call call(*this, "scatter", timeout_s);
  if (nb == 0) return;
  if (rank() != root) {
    call.recv(out, root);
    call.wait_all();
    return;
  }
  for (std::size_t i = 0; i < p; ++i) {
    if (static_cast<int>(i) != root) call.send(sub(in, i * nb, nb), static_cast<int>(i));
  }
  if (out.data != at(in, root * nb)) std::memmove(out.data, at(in, root * nb), nb);
  call.wait_all();
}

void Collectives::alltoall(const Buffer& in, const std::vector<std::size_t>& send_offsets,
                           const std::vector<std::size_t>& send_bytes, const Buffer& out,
                           const std::vector<std::size_t>& recv_offsets, const std::vector<std::size_t>& recv_bytes,
                           double timeout_s) {
  const int p = size(), r = rank();
  const std::size_t n = static_cast<std::size_t>(p);
  if (send_offsets.size() != n || send_bytes.size() != n || recv_offsets.size() != n || recv_bytes.size() != n) {
    throw InvalidArgument("alltoall: offsets and sizes need one entry per rank (" + std::to_string(p) + ")");
  }
  auto within = [](const Buffer& b, std::size_t off, std::size_t len, const char* what, int peer) {
    if (len && (off > b.nbytes || b.nbytes - off < len || !b.data)) {
      throw InvalidArgument(std::string("alltoall: the ") + what + " block of rank " + std::to_string(peer) + " [" +
                            std::to_string(off) + ", +" + std::to_string(len) + ") is outside its buffer of " +
                            std::to_string(b.nbytes) + " bytes");
    }
  };
  for (int i = 0; i < p; ++i) {
    within(in, send_offsets[i], send_bytes[i], "send", i);
    within(out, recv_offsets[i], recv_bytes[i], "receive", i);
  }
  if (send_bytes[r] != recv_bytes[r]) {
    throw InvalidArgument("alltoall: rank " + std::to_string(r) + " sends itself " + std::to_string(send_bytes[r]) +
                          " bytes but expects " + std::to_string(recv_bytes[r]));
  }
  // A block received while another is still being sent from the same bytes
  // would change what is sent.
  if (overlap(in.data, in.nbytes, out.data, out.nbytes) && p > 1) {
    throw InvalidArgument("alltoall: in and out overlap (use a separate output)");
  }
  Call call(*this, "alltoall", timeout_s);
  if (send_bytes[r]) std::memmove(at(out, recv_offsets[r]), at(in, send_offsets[r]), send_bytes[r]);
  // Every receive first (the engine then places large blocks), then the sends
  // in the order r+1, r+2, ... so that no rank is everyone's first target.
  for (int i = 1; i < p; ++i) {
    const int peer = mod(r - i, p);
    if (recv_bytes[peer]) call.recv(sub(out, recv_offsets[peer], recv_bytes[peer]), peer);
  }
  for (int i = 1; i < p; ++i) {
    const int peer = mod(r + i, p);
    if (send_bytes[peer]) call.send(sub(in, send_offsets[peer], send_bytes[peer]), peer);
  }
  call.wait_all();
}

// ---- barrier ----

// Dissemination: in round k a rank signals rank r + 2^k and waits for rank
// r - 2^k; after ceil(log2 p) rounds every rank has (transitively) heard from
// every other. One byte each way (a zero-byte message is a corner some
// transports treat specially).
void Collectives::barrier(double timeout_s) {
  Call call(*this, "barrier", timeout_s);
  const int p = size(), r = rank();
  if (p == 1) return;
  reserve(kRecv, 2);
  const Buffer token = scratch(kRecv, 0, 1), sink = scratch(kRecv, 1, 1);
  *static_cast<std::byte*>(token.data) = std::byte{1};
  for (int k = 1; k < p; k <<= 1) {
    call.recv(sink, mod(r - k, p));
    call.send(token, mod(r + k, p));
    call.wait_all();
  }
}

}  // namespace tensorwire
