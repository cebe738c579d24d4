// Copyright tensorwire authors.
//
// The collectives layer (protocol/collectives.cc) on an in-process Messenger:
// ranks are threads, messages go through one mailbox with MPI's matching
// (per destination, source and tag, in order; kAnySource), and pending
// requests are tensorwire Requests completed from another thread. Every op x
// world sizes 1-5 x every dtype x every reduce op it supports, against a
// reference computed here; timeouts and peer failures; the float16/bfloat16
// rounding of reduce_into.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <complex>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/request_state.h"
#include "protocol/reduce.h"
#include "tensorwire/collectives.h"
#include "tensorwire/error.h"

namespace tw = tensorwire;
using tw::DType;
using tw::ReduceOp;

namespace {

// ---------------------------------------------------------------- the test double

// One group's mailboxes. Sends of up to eager_bytes are copied at once and
// complete at once; larger ones complete only when a receive takes them (a
// rendezvous, as the engine's placed path), so an algorithm that waits for a
// send before posting its receive deadlocks here too.
class Fabric {
 public:
  explicit Fabric(int size, std::size_t eager_bytes = 256) : size_(size), eager_(eager_bytes), boxes_(size) {}
  ~Fabric() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& box : boxes_) {
      for (auto& s : box.sends) finish(s.state, false, tw::ErrorKind::kConnection, "closed", -1);
      for (auto& r : box.recvs) finish(r.state, false, tw::ErrorKind::kConnection, "closed", -1);
    }
  }
  int size() const { return size_; }

  tw::Request isend(int src, const tw::Buffer& b, int dst, std::int64_t tag) {
    if (dst < 0 || dst >= size_ || dst == src) throw tw::InvalidArgument("isend: bad peer " + std::to_string(dst));
    std::lock_guard<std::mutex> lock(mu_);
    sends_posted_++;
    if (tag < 0) collective_tags_.push_back(tag);
    if (int k = broken(src, dst); k >= 0) return failed(k);
    Box& box = boxes_[dst];
    for (auto it = box.recvs.begin(); it != box.recvs.end(); ++it) {
      if ((it->src == src || it->src == tw::kAnySource) && it->tag == tag) {
        Recv r = std::move(*it);
        box.recvs.erase(it);
        if (r.buf.nbytes != b.nbytes) {
          finish(r.state, false, tw::ErrorKind::kInvalidArgument, size_message(b.nbytes, r.buf.nbytes), -1);
          return failed_kind(tw::ErrorKind::kInvalidArgument, size_message(b.nbytes, r.buf.nbytes));
        }
        if (b.nbytes) std::memcpy(r.buf.data, b.data, b.nbytes);
        if (r.source) *r.source = src;
        finish(r.state, true, tw::ErrorKind::kGeneric, {}, -1);
        return tw::Request();
      }
    }
    Send s;
    s.src = src;
    s.tag = tag;
    if (b.nbytes <= eager_) {
      s.copy.assign(static_cast<const std::byte*>(b.data), static_cast<const std::byte*>(b.data) + b.nbytes);
      box.sends.push_back(std::move(s));
      return tw::Request();
    }
    s.buf = b;  // keeps the sender's memory alive (Buffer::keep) while queued
    s.state = new tw::detail::RequestState(nullptr, 2);
    tw::Request req(s.state);
    box.sends.push_back(std::move(s));
    return req;
  }

  tw::Request irecv(int dst, const tw::Buffer& b, int src, std::int64_t tag, int* source) {
    if (src != tw::kAnySource && (src < 0 || src >= size_ || src == dst)) {
      throw tw::InvalidArgument("irecv: bad peer " + std::to_string(src));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (int k = broken(dst, src); k >= 0) return failed(k);
    Box& box = boxes_[dst];
    for (auto it = box.sends.begin(); it != box.sends.end(); ++it) {
      if ((src == tw::kAnySource || it->src == src) && it->tag == tag) {
        Send s = std::move(*it);
        box.sends.erase(it);
        const std::size_t n = s.state ? s.buf.nbytes : s.copy.size();
        if (n != b.nbytes) {
          finish(s.state, false, tw::ErrorKind::kInvalidArgument, size_message(n, b.nbytes), -1);
          return failed_kind(tw::ErrorKind::kInvalidArgument, size_message(n, b.nbytes));
        }
        if (n) std::memcpy(b.data, s.state ? s.buf.data : s.copy.data(), n);
        if (source) *source = s.src;
        finish(s.state, true, tw::ErrorKind::kGeneric, {}, -1);
        return tw::Request();
      }
    }
    Recv r;
    r.src = src;
    r.tag = tag;
    r.buf = b;
    r.source = source;
    r.owner = dst;
    r.state = new tw::detail::RequestState(nullptr, 2);
    tw::Request req(r.state);
    box.recvs.push_back(std::move(r));
    return req;
  }

  // Rank k fails. group_wide: every pending request of the group fails with
  // PeerFailed naming k (an engine that breaks the whole group on a peer's
  // death), and so does every later post; otherwise only the requests that
  // involve k.
  void fail(int k, bool group_wide) {
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = k;
    group_wide_ = group_wide;
    const std::string why = "peer rank " + std::to_string(k) + " failed";
    for (int dst = 0; dst < size_; ++dst) {
      Box& box = boxes_[dst];
      for (auto it = box.sends.begin(); it != box.sends.end();) {
        if (it->state && (group_wide || dst == k || it->src == k)) {
          finish(it->state, false, tw::ErrorKind::kPeerFailed, why, k);
          it = box.sends.erase(it);
        } else {
          ++it;
        }
      }
      for (auto it = box.recvs.begin(); it != box.recvs.end();) {
        if (group_wide || dst == k || it->src == k) {
          finish(it->state, false, tw::ErrorKind::kPeerFailed, why, k);
          it = box.recvs.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  std::vector<std::int64_t> collective_tags() {
    std::lock_guard<std::mutex> lock(mu_);
    return collective_tags_;
  }
  std::size_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t n = 0;
    for (auto& b : boxes_) n += b.sends.size() + b.recvs.size();
    return n;
  }

 private:
  struct Send {
    int src = -1;
    std::int64_t tag = 0;
    std::vector<std::byte> copy;
    tw::Buffer buf;
    tw::detail::RequestState* state = nullptr;  // null: eager, already complete
  };
  struct Recv {
    int src = -1, owner = -1;
    std::int64_t tag = 0;
    tw::Buffer buf;
    int* source = nullptr;
    tw::detail::RequestState* state = nullptr;
  };
  struct Box {
    std::deque<Send> sends;  // arrived, not yet received (in arrival order)
    std::deque<Recv> recvs;  // posted, not yet matched (in posting order)
  };

  static std::string size_message(std::size_t sent, std::size_t want) {
    return "sizes differ: " + std::to_string(sent) + " bytes sent, " + std::to_string(want) + " expected";
  }
  // Completes and drops the fabric's reference.
  static void finish(tw::detail::RequestState*& s, bool ok, tw::ErrorKind kind, const std::string& why, int rank) {
    if (!s) return;
    if (ok) {
      s->complete_ok();
    } else {
      s->failed_rank = rank;
      s->complete_error(kind, why);
    }
    s->release();
    s = nullptr;
  }
  int broken(int a, int b) const {
    if (dead_ < 0) return -1;
    return group_wide_ || a == dead_ || b == dead_ ? dead_ : -1;
  }
  static tw::Request failed_kind(tw::ErrorKind kind, const std::string& why) {
    auto* s = new tw::detail::RequestState(nullptr, 1);
    s->complete_error(kind, why);
    return tw::Request(s);
  }
  tw::Request failed(int k) const {
    auto* s = new tw::detail::RequestState(nullptr, 1);
    s->failed_rank = k;
    s->complete_error(tw::ErrorKind::kPeerFailed, "peer rank " + std::to_string(k) + " failed");
    return tw::Request(s);
  }

  const int size_;
  const std::size_t eager_;
  std::mutex mu_;
  std::vector<Box> boxes_;
  int dead_ = -1;
  bool group_wide_ = false;
  std::size_t sends_posted_ = 0;
  std::vector<std::int64_t> collective_tags_;
};

class TestMessenger : public tw::Messenger {
 public:
  TestMessenger(Fabric& f, int rank, double timeout_s) : f_(f), rank_(rank), timeout_(timeout_s) {}
  int rank() const override { return rank_; }
  int size() const override { return f_.size(); }
  tw::Request isend(const tw::Buffer& b, int peer, std::int64_t tag) override { return f_.isend(rank_, b, peer, tag); }
  tw::Request irecv(const tw::Buffer& b, int peer, std::int64_t tag, int* source) override {
    return f_.irecv(rank_, b, peer, tag, source);
  }
  double timeout() const override { return timeout_; }
  tw::MessengerStats stats() const override { return {}; }
  bool shares_copies(int) const override { return false; }
  void close() override {}

 private:
  Fabric& f_;
  int rank_;
  double timeout_;
};

// Runs fn(collectives, rank) on `size` threads, one rank each; returns each
// rank's exception (nullptr where it returned). abort_on_error: a rank that
// throws fails the group (so that a broken algorithm fails the test at once
// rather than every other rank at its deadline).
std::vector<std::exception_ptr> run_group(Fabric& fabric, const std::function<void(tw::Collectives&, int)>& fn,
                                          double messenger_timeout_s = 20.0, bool abort_on_error = false) {
  const int p = fabric.size();
  std::vector<std::exception_ptr> errors(p);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      TestMessenger m(fabric, r, messenger_timeout_s);
      tw::Collectives c(m);
      try {
        fn(c, r);
      } catch (...) {
        errors[r] = std::current_exception();
        if (abort_on_error) fabric.fail(r, /*group_wide=*/true);
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void run_ok(int p, const std::function<void(tw::Collectives&, int)>& fn, std::size_t eager = 256) {
  Fabric fabric(p, eager);
  auto errors = run_group(fabric, fn, 10.0, /*abort_on_error=*/true);
  for (int r = 0; r < p; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " of " << p << " threw: " << e.what();
    }
  }
}

// A buffer of ours, as the engine sees it (its own allocation, kept alive).
struct Mem {
  std::shared_ptr<std::vector<std::byte>> bytes;
  explicit Mem(std::size_t n = 0) : bytes(std::make_shared<std::vector<std::byte>>(n)) {}
  std::byte* data() { return bytes->data(); }
  std::size_t size() const { return bytes->size(); }
  tw::Buffer buffer() {
    tw::Buffer b;
    b.data = bytes->empty() ? nullptr : bytes->data();
    b.nbytes = bytes->size();
    b.keep = bytes;
    return b;
  }
};

// ---------------------------------------------------------------- elements as (re, im) doubles

// float16/bfloat16 decoded and encoded here by their definitions (not the
// library's conversions), for the values the tests use (exactly representable).
double half_value(std::uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}
std::uint16_t half_exact(double v) {
  if (v == 0) return std::signbit(v) ? 0x8000 : 0;
  const std::uint16_t sign = v < 0 ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(v), &e);  // |v| = m 2^e, m in [0.5, 1)
  const int field = e - 1 + 15;
  if (field < 1 || field > 30) throw std::logic_error("half_exact: out of the normal range");
  const double mant = (m * 2 - 1) * 1024;
  if (mant != std::floor(mant)) throw std::logic_error("half_exact: not representable");
  return static_cast<std::uint16_t>(sign | (field << 10) | static_cast<int>(mant));
}
double bf16_value(std::uint16_t b) {
  const std::uint32_t bits = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
std::uint16_t bf16_exact(double v) {
  const float f = static_cast<float>(v);
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0xffff) != 0 || double(f) != v) throw std::logic_error("bf16_exact: not representable");
  return static_cast<std::uint16_t>(bits >> 16);
}

bool is_float(DType d) { return d.code == 2 || d.code == 4; }
bool is_complex(DType d) { return d.code == 5; }
bool is_signed_int(DType d) { return d.code == 0; }

template <typename T>
void store(void* p, std::size_t i, T v) {
  std::memcpy(static_cast<std::byte*>(p) + i * sizeof(T), &v, sizeof(T));
}
template <typename T>
T load(const void* p, std::size_t i) {
  T v;
  std::memcpy(&v, static_cast<const std::byte*>(p) + i * sizeof(T), sizeof(T));
  return v;
}

void put(DType d, void* p, std::size_t i, double re, double im = 0) {
  switch (d.code) {
    case 0:
      if (d.bits == 8) store<std::int8_t>(p, i, std::int8_t(re));
      if (d.bits == 16) store<std::int16_t>(p, i, std::int16_t(re));
      if (d.bits == 32) store<std::int32_t>(p, i, std::int32_t(re));
      if (d.bits == 64) store<std::int64_t>(p, i, std::int64_t(re));
      return;
    case 1:
      if (d.bits == 8) store<std::uint8_t>(p, i, std::uint8_t(re));
      if (d.bits == 16) store<std::uint16_t>(p, i, std::uint16_t(re));
      if (d.bits == 32) store<std::uint32_t>(p, i, std::uint32_t(re));
      if (d.bits == 64) store<std::uint64_t>(p, i, std::uint64_t(re));
      return;
    case 2:
      if (d.bits == 16) store<std::uint16_t>(p, i, half_exact(re));
      if (d.bits == 32) store<float>(p, i, float(re));
      if (d.bits == 64) store<double>(p, i, re);
      return;
    case 4: store<std::uint16_t>(p, i, bf16_exact(re)); return;
    case 5:
      if (d.bits == 64) {
        store<float>(p, 2 * i, float(re));
        store<float>(p, 2 * i + 1, float(im));
      } else {
        store<double>(p, 2 * i, re);
        store<double>(p, 2 * i + 1, im);
      }
      return;
    case 6: store<std::uint8_t>(p, i, re != 0 ? 1 : 0); return;
  }
  throw std::logic_error("put: dtype");
}

std::complex<double> get(DType d, const void* p, std::size_t i) {
  switch (d.code) {
    case 0:
      if (d.bits == 8) return double(load<std::int8_t>(p, i));
      if (d.bits == 16) return double(load<std::int16_t>(p, i));
      if (d.bits == 32) return double(load<std::int32_t>(p, i));
      return double(load<std::int64_t>(p, i));
    case 1:
      if (d.bits == 8) return double(load<std::uint8_t>(p, i));
      if (d.bits == 16) return double(load<std::uint16_t>(p, i));
      if (d.bits == 32) return double(load<std::uint32_t>(p, i));
      return double(load<std::uint64_t>(p, i));
    case 2:
      if (d.bits == 16) return half_value(load<std::uint16_t>(p, i));
      if (d.bits == 32) return double(load<float>(p, i));
      return load<double>(p, i);
    case 4: return bf16_value(load<std::uint16_t>(p, i));
    case 5:
      if (d.bits == 64) return {load<float>(p, 2 * i), load<float>(p, 2 * i + 1)};
      return {load<double>(p, 2 * i), load<double>(p, 2 * i + 1)};
    case 6: return load<std::uint8_t>(p, i) ? 1.0 : 0.0;
  }
  throw std::logic_error("get: dtype");
}

const std::vector<ReduceOp> kAllOps = {ReduceOp::kSum,  ReduceOp::kProduct, ReduceOp::kMin,
                                       ReduceOp::kMax,  ReduceOp::kBand,    ReduceOp::kBor,
                                       ReduceOp::kBxor, ReduceOp::kAvg,     ReduceOp::kPremulSum};

bool supported(DType d, ReduceOp op) {
  try {
    tw::detail::check_reduce(d, op);
    return true;
  } catch (const tw::InvalidArgument&) {
    return false;
  }
}

constexpr double kFactor = 0.5;  // premul_sum's: exact on the values below

// Rank r's element i for `op`: small integers, so that every sum and product
// of up to 5 of them is exact in every dtype and the order of the reduction
// cannot change a bit (avg alone divides, and is compared within rounding).
std::complex<double> value(DType d, ReduceOp op, int r, std::size_t i, unsigned seed) {
  const unsigned h = static_cast<unsigned>((i * 2654435761u) ^ (r * 40503u) ^ (seed * 977u));
  const unsigned h2 = (h >> 7) * 2246822519u;
  if (d.code == 6) return (h >> 3) & 1 ? 1.0 : 0.0;
  const bool uns = d.code == 1;
  if (op == ReduceOp::kProduct) {
    if (is_complex(d)) return {double(int(h % 3) - 1), double(int(h2 % 3) - 1)};
    return uns ? double(h % 3) : double(int(h % 5) - 2);
  }
  if (uns) return double(h % 16);
  if (is_complex(d)) return {double(int(h % 17) - 8), double(int(h2 % 17) - 8)};
  return double(int(h % 17) - 8);
}

// The reduction of rank 0..p-1's element i, by definition.
std::complex<double> reference(DType d, ReduceOp op, int p, std::size_t i, unsigned seed) {
  if (d.code == 6) {
    bool any = false, all = true, parity = false;
    for (int r = 0; r < p; ++r) {
      const bool v = value(d, op, r, i, seed).real() != 0;
      any |= v;
      all &= v;
      parity ^= v;
    }
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMax:
      case ReduceOp::kBor: return any ? 1.0 : 0.0;
      case ReduceOp::kBxor: return parity ? 1.0 : 0.0;
      default: return all ? 1.0 : 0.0;
    }
  }
  std::complex<double> acc = value(d, op, 0, i, seed);
  if (op == ReduceOp::kPremulSum) acc *= kFactor;
  for (int r = 1; r < p; ++r) {
    std::complex<double> v = value(d, op, r, i, seed);
    switch (op) {
      case ReduceOp::kProduct: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc.real(), v.real()); break;
      case ReduceOp::kMax: acc = std::max(acc.real(), v.real()); break;
      case ReduceOp::kBand: acc = double(std::int64_t(acc.real()) & std::int64_t(v.real())); break;
      case ReduceOp::kBor: acc = double(std::int64_t(acc.real()) | std::int64_t(v.real())); break;
      case ReduceOp::kBxor: acc = double(std::int64_t(acc.real()) ^ std::int64_t(v.real())); break;
      case ReduceOp::kPremulSum: acc += v * kFactor; break;
      default: acc += v; break;
    }
  }
  if (op == ReduceOp::kAvg) acc /= double(p);
  return acc;
}

// The relative rounding of one division in `d` (avg), else 0: exact.
double tolerance(DType d, ReduceOp op) {
  if (op != ReduceOp::kAvg) return 0;
  if (d.code == 4) return 1.0 / 256;
  if (d.bits == 16) return 1.0 / 1024;
  if (d.bits == 32 || (d.code == 5 && d.bits == 64)) return 2e-7;
  return 1e-15;
}

void fill(DType d, ReduceOp op, int r, unsigned seed, void* p, std::size_t count, std::size_t first = 0) {
  for (std::size_t i = 0; i < count; ++i) {
    auto v = value(d, op, r, first + i, seed);
    put(d, p, i, v.real(), v.imag());
  }
}

// "" if `p` holds the reference of elements [first, first + count).
std::string check(DType d, ReduceOp op, int size, unsigned seed, const void* p, std::size_t count,
                  std::size_t first = 0) {
  const double tol = tolerance(d, op);
  for (std::size_t i = 0; i < count; ++i) {
    const auto want = reference(d, op, size, first + i, seed);
    const auto got = get(d, p, i);
    const double err = std::abs(got - want);
    if (!(err <= tol * std::max(1.0, std::abs(want)))) {
      return d.name() + " " + tw::reduce_op_name(op) + " element " + std::to_string(first + i) + ": got (" +
             std::to_string(got.real()) + ", " + std::to_string(got.imag()) + ") want (" + std::to_string(want.real()) +
             ", " + std::to_string(want.imag()) + ")";
    }
  }
  return {};
}

// 0, 1, odd, and past the small-message limit (64 KiB) with an odd count.
std::vector<std::size_t> counts_for(DType d) { return {0, 1, 37, (std::size_t(64) << 10) / d.itemsize() + 7}; }

}  // namespace

// ---------------------------------------------------------------- reduce_into

TEST(ReduceInto, Float16RoundsToNearestEven) {
  auto sum = [](std::uint16_t a, std::uint16_t b) {
    tw::reduce_into(&a, &b, 1, DType{2, 16}, ReduceOp::kSum);
    return a;
  };
  auto mul = [](std::uint16_t a, std::uint16_t b) {
    tw::reduce_into(&a, &b, 1, DType{2, 16}, ReduceOp::kProduct);
    return a;
  };
  EXPECT_EQ(sum(0x3c00, 0x1000), 0x3c00);           // 1 + 2^-11: a tie, to even (1)
  EXPECT_EQ(sum(0x3c01, 0x1000), 0x3c02);           // (1 + 2^-10) + 2^-11: a tie, to even
  EXPECT_EQ(sum(0x3c00, 0x1001), 0x3c01);           // just past the tie: up
  EXPECT_EQ(sum(0x7bff, 0x4c00), 0x7c00);           // 65504 + 16 = 65520: the tie with 65536, to infinity
  EXPECT_EQ(sum(0x7bff, 0x4800), 0x7bff);           // 65504 + 8: back to 65504
  EXPECT_EQ(sum(0x0001, 0x0001), 0x0002);           // subnormals add exactly
  EXPECT_EQ(mul(0x0001, 0x3800), 0x0000);           // 2^-24 * 0.5: a tie, to even (0)
  EXPECT_EQ(mul(0x0003, 0x3800), 0x0002);           // 1.5 * 2^-24: a tie, to even (2)
  EXPECT_EQ(sum(0x03ff, 0x0001), 0x0400);           // the largest subnormal + 1 ulp: the smallest normal
  EXPECT_EQ(sum(0x7c00, 0xfc00) & 0x7c00, 0x7c00);  // inf + -inf: NaN
  EXPECT_NE(sum(0x7c00, 0xfc00) & 0x03ff, 0);
  EXPECT_NE(sum(0x7e00, 0x3c00) & 0x03ff, 0);  // NaN stays NaN
  EXPECT_EQ(sum(0x8000, 0x8000), 0x8000);      // -0 + -0 = -0
}

TEST(ReduceInto, Float16ConversionsAgreeWithTheDefinition) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const double want = half_value(static_cast<std::uint16_t>(h));
    const float got = tw::detail::half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
      continue;
    }
    ASSERT_EQ(double(got), want) << h;
    ASSERT_EQ(std::signbit(got), std::signbit(want)) << h;
    ASSERT_EQ(tw::detail::float_to_half(got), h) << h;  // exact round trip
    // The midpoint to the next half (same sign, finite): a tie, to the even one.
    const std::uint32_t next = h + 1;
    if ((next & 0x7fff) >= 0x7c00 || (next & 0x7fff) == 0) continue;  // 65520 is Float16RoundsToNearestEven's
    const double up = half_value(static_cast<std::uint16_t>(next));
    const float mid = static_cast<float>((want + up) / 2);  // exact in float
    ASSERT_EQ(double(mid), (want + up) / 2);
    const std::uint16_t even = (h & 1) ? static_cast<std::uint16_t>(next) : static_cast<std::uint16_t>(h);
    ASSERT_EQ(tw::detail::float_to_half(mid), even) << h;
    ASSERT_EQ(tw::detail::float_to_half(std::nextafter(mid, float(up))), next) << h;
    ASSERT_EQ(tw::detail::float_to_half(std::nextafter(mid, float(want))), h) << h;
  }
}

TEST(ReduceInto, Float16BlockConversionsMatchThePortableOnes) {
  // reduce_into's float16 blocks (F16C where the CPU has it) against the
  // portable conversions: every float16, and every midpoint and its neighbours.
  std::vector<std::uint16_t> halves(0x10000);
  for (std::uint32_t h = 0; h < 0x10000; ++h) halves[h] = static_cast<std::uint16_t>(h);
  std::vector<float> wide(halves.size()), wide_ref(halves.size());
  tw::detail::widen_halves(halves.data(), wide.data(), halves.size());
  tw::detail::widen_halves_portable(halves.data(), wide_ref.data(), halves.size());
  for (std::size_t i = 0; i < halves.size(); ++i) {
    if (std::isnan(wide_ref[i])) {
      ASSERT_TRUE(std::isnan(wide[i])) << i;
    } else {
      ASSERT_EQ(std::memcmp(&wide[i], &wide_ref[i], 4), 0) << i;
    }
  }
  std::vector<float> probes;
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {  // positive finite halves; negatives by symmetry below
    const float a = tw::detail::half_to_float(static_cast<std::uint16_t>(h));
    const float b = tw::detail::half_to_float(static_cast<std::uint16_t>(h + 1));
    const float mid = (a + b) / 2;
    for (float f : {a, mid, std::nextafter(mid, a), std::nextafter(mid, b)}) {
      probes.push_back(f);
      probes.push_back(-f);
    }
  }
  for (float f : {65519.0f, 65520.0f, 1e6f, INFINITY, -INFINITY, NAN, 1e-30f, -1e-30f}) probes.push_back(f);
  std::vector<std::uint16_t> got(probes.size()), want(probes.size());
  tw::detail::narrow_halves(probes.data(), got.data(), probes.size());
  tw::detail::narrow_halves_portable(probes.data(), want.data(), probes.size());
  for (std::size_t i = 0; i < probes.size(); ++i) {
    if ((want[i] & 0x7fff) > 0x7c00) {
      ASSERT_GT(got[i] & 0x7fff, 0x7c00) << probes[i];  // NaN, payload aside
    } else {
      ASSERT_EQ(got[i], want[i]) << probes[i];
    }
  }
  std::printf("float16 blocks: %s\n", tw::detail::f16c_enabled() ? "F16C" : "portable");
}

TEST(ReduceInto, Bfloat16RoundsToNearestEven) {
  auto sum = [](std::uint16_t a, std::uint16_t b) {
    tw::reduce_into(&a, &b, 1, DType{4, 16}, ReduceOp::kSum);
    return a;
  };
  EXPECT_EQ(sum(0x3f80, 0x3b80), 0x3f80);      // 1 + 2^-8: a tie, to even
  EXPECT_EQ(sum(0x3f81, 0x3b80), 0x3f82);      // (1 + 2^-7) + 2^-8: a tie, to even
  EXPECT_EQ(sum(0x3f80, 0x3b81), 0x3f81);      // past the tie: up
  EXPECT_EQ(sum(0x7f7f, 0x7f7f), 0x7f80);      // overflow: infinity
  EXPECT_NE(sum(0x7fc0, 0x3f80) & 0x007f, 0);  // NaN stays NaN
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float f = tw::detail::bfloat16_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(tw::detail::bfloat16_to_float(tw::detail::float_to_bfloat16(f))));
      continue;
    }
    ASSERT_EQ(double(f), bf16_value(static_cast<std::uint16_t>(b)));
    ASSERT_EQ(tw::detail::float_to_bfloat16(f), b) << b;
  }
}

TEST(ReduceInto, IntegersWrapBoolsStayBools) {
  std::int8_t a[3] = {127, -128, 100}, b[3] = {1, -1, 100};
  tw::reduce_into(a, b, 3, DType{0, 8}, ReduceOp::kSum);
  EXPECT_EQ(a[0], -128);
  EXPECT_EQ(a[1], 127);
  EXPECT_EQ(a[2], -56);
  std::uint16_t u[2] = {65535, 300}, v[2] = {65535, 300};
  tw::reduce_into(u, v, 2, DType{1, 16}, ReduceOp::kProduct);  // no signed overflow on the way (int promotion)
  EXPECT_EQ(u[0], 1);
  EXPECT_EQ(u[1], static_cast<std::uint16_t>(90000));
  std::uint8_t x[4] = {2, 0, 2, 1}, y[4] = {1, 0, 0, 1};  // any nonzero byte is true
  tw::reduce_into(x, y, 4, DType{6, 8}, ReduceOp::kBand);
  EXPECT_EQ(std::vector<int>(x, x + 4), (std::vector<int>{1, 0, 0, 1}));
  std::uint8_t s[2] = {1, 0}, t[2] = {1, 0};
  tw::reduce_into(s, t, 2, DType{6, 8}, ReduceOp::kSum);  // a sum of bools: or
  EXPECT_EQ(std::vector<int>(s, s + 2), (std::vector<int>{1, 0}));
}

TEST(ReduceInto, ComplexAndNaN) {
  float c[2] = {1, 2}, d[2] = {3, -1};  // (1 + 2i)(3 - i) = 5 + 5i
  tw::reduce_into(c, d, 1, DType{5, 64}, ReduceOp::kProduct);
  EXPECT_EQ(c[0], 5);
  EXPECT_EQ(c[1], 5);
  double m[2] = {1, NAN}, n[2] = {NAN, 2};
  tw::reduce_into(m, n, 2, DType{2, 64}, ReduceOp::kMin);  // a NaN on either side wins (torch.minimum)
  EXPECT_TRUE(std::isnan(m[0]));
  EXPECT_TRUE(std::isnan(m[1]));
}

TEST(ReduceInto, RefusesUnsupportedCombinationsNamingThem) {
  float f = 0;
  std::int32_t i = 0;
  double c[2] = {};
  auto refused = [](const std::function<void()>& fn, const std::string& dtype, const std::string& op) {
    try {
      fn();
      ADD_FAILURE() << dtype << " " << op << " was accepted";
    } catch (const tw::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(dtype), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
    }
  };
  refused([&] { tw::reduce_into(&f, &f, 1, DType{2, 32}, ReduceOp::kBand); }, "float32", "band");
  refused([&] { tw::reduce_into(&i, &i, 1, DType{0, 32}, ReduceOp::kAvg); }, "int32", "avg");
  refused([&] { tw::reduce_into(&i, &i, 1, DType{6, 8}, ReduceOp::kPremulSum); }, "bool", "premul_sum");
  refused([&] { tw::reduce_into(c, c, 1, DType{5, 128}, ReduceOp::kMin); }, "complex128", "min");
  refused([&] { tw::reduce_into(c, c, 1, DType{5, 128}, ReduceOp::kBxor); }, "complex128", "bxor");
  EXPECT_THROW(tw::reduce_into(&f, &f, 1, DType{2, 8}, ReduceOp::kSum), tw::InvalidArgument);
  // What each dtype supports, in full.
  for (const auto& info : tw::dtypes()) {
    const DType d = info.dtype;
    for (ReduceOp op : kAllOps) {
      bool want;
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kProduct: want = true; break;
        case ReduceOp::kMin:
        case ReduceOp::kMax: want = !is_complex(d); break;
        case ReduceOp::kBand:
        case ReduceOp::kBor:
        case ReduceOp::kBxor: want = !is_float(d) && !is_complex(d); break;
        default: want = is_float(d) || is_complex(d); break;
      }
      EXPECT_EQ(supported(d, op), want) << d.name() << " " << tw::reduce_op_name(op);
    }
  }
}

// Not a test: the kernels' throughput (bytes of dst per second, 4 MiB, best
// of 7). ./tw_unit_tests --gtest_also_run_disabled_tests --gtest_filter='*Throughput'
TEST(ReduceInto, DISABLED_Throughput) {
  const std::size_t bytes = std::size_t(4) << 20;
  std::vector<std::uint16_t> a(bytes / 2), b(bytes / 2);
  for (std::size_t i = 0; i < a.size(); ++i) {  // as 16-bit floats: normal numbers in [1, 2)
    a[i] = static_cast<std::uint16_t>(0x3c00 | (i & 0x3ff));
    b[i] = static_cast<std::uint16_t>(0x3c00 | ((i * 7) & 0x3ff));
  }
  const std::vector<std::uint16_t> a0 = a;
  const std::pair<const char*, std::pair<DType, ReduceOp>> cases[] = {
      {"float32 sum", {DType{2, 32}, ReduceOp::kSum}},
      {"float32 max", {DType{2, 32}, ReduceOp::kMax}},
      {"float64 sum", {DType{2, 64}, ReduceOp::kSum}},
      {"float16 sum", {DType{2, 16}, ReduceOp::kSum}},
      {"bfloat16 sum", {DType{4, 16}, ReduceOp::kSum}},
      {"int32 sum", {DType{0, 32}, ReduceOp::kSum}},
      {"int64 sum", {DType{0, 64}, ReduceOp::kSum}},
      {"int8 min", {DType{0, 8}, ReduceOp::kMin}},
      {"bool max", {DType{6, 8}, ReduceOp::kMax}},
      {"complex64 sum", {DType{5, 64}, ReduceOp::kSum}},
      {"complex64 product", {DType{5, 64}, ReduceOp::kProduct}}};
  for (const auto& [name, c] : cases) {
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      a = a0;
      const auto t0 = std::chrono::steady_clock::now();
      tw::reduce_into(a.data(), b.data(), bytes / c.first.itemsize(), c.first, c.second);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("%-18s %6.2f GB/s\n", name, bytes / best / 1e9);
  }
  std::printf("(float16: %s)\n", tw::detail::f16c_enabled() ? "F16C" : "portable");
}

// ---------------------------------------------------------------- reductions, every dtype and op

// allreduce, reduce (a root per op) and reduce_scatter of every supported op
// for one dtype and count, on p ranks, one call after another on the same
// Collectives (so successive calls' tags are exercised too).
void reductions(int p, DType d, std::size_t count) {
  run_ok(p, [&](tw::Collectives& c, int r) {
    const std::size_t item = d.itemsize(), bytes = count * item;
    unsigned seed = 1;
    for (ReduceOp op : kAllOps) {
      if (!supported(d, op)) continue;
      const auto where = [&](const char* what) {
        return std::string(what) + " p=" + std::to_string(p) + " rank " + std::to_string(r) + " count " +
               std::to_string(count) + ": ";
      };
      ++seed;
      {  // allreduce
        Mem m(bytes);
        fill(d, op, r, seed, m.data(), count);
        c.allreduce(m.buffer(), count, d, op, kFactor);
        std::string bad = check(d, op, p, seed, m.data(), count);
        EXPECT_EQ(bad, "") << where("allreduce") << bad;
      }
      {  // reduce: the root has the result, the others their data as it was
        const int root = static_cast<int>(seed % p);
        Mem m(bytes);
        fill(d, op, r, seed, m.data(), count);
        const std::vector<std::byte> before(m.data(), m.data() + bytes);
        c.reduce(m.buffer(), count, d, op, root, kFactor);
        if (r == root) {
          std::string bad = check(d, op, p, seed, m.data(), count);
          EXPECT_EQ(bad, "") << where("reduce") << bad;
        } else {
          EXPECT_TRUE(bytes == 0 || std::memcmp(before.data(), m.data(), bytes) == 0)
              << where("reduce") << "a non-root rank's data changed";
        }
      }
      {  // reduce_scatter: rank r gets elements [r * count, +count) of the reduction of p * count
        Mem in(p * bytes), out(bytes);
        fill(d, op, r, seed, in.data(), p * count);
        const std::vector<std::byte> before(in.data(), in.data() + p * bytes);
        c.reduce_scatter(in.buffer(), out.buffer(), count, d, op, kFactor);
        std::string bad = check(d, op, p, seed, out.data(), count, r * count);
        EXPECT_EQ(bad, "") << where("reduce_scatter") << bad;
        EXPECT_TRUE(bytes == 0 || std::memcmp(before.data(), in.data(), p * bytes) == 0)
            << where("reduce_scatter") << "its input changed";
      }
    }
  });
}

class Reductions : public ::testing::TestWithParam<int> {};

TEST_P(Reductions, EveryDtypeOpAndSize) {
  const int p = GetParam();
  for (const auto& info : tw::dtypes()) {
    for (std::size_t count : counts_for(info.dtype)) {
      SCOPED_TRACE(info.name + std::string(" count ") + std::to_string(count));
      reductions(p, info.dtype, count);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Reductions, ::testing::Values(1, 2, 3, 4, 5),
                         [](const auto& info) { return "p" + std::to_string(info.param); });

TEST(Collectives, AllreduceResultsAreTheSameBitsOnEveryRank) {
  // Signed zeros: min(-0, +0) depends on the order of its operands; every
  // rank must still end with the same bits (recursive doubling combines
  // lower ranks' partial first on both sides).
  for (int p = 2; p <= 5; ++p) {
    std::vector<std::vector<std::byte>> results(p);
    run_ok(p, [&](tw::Collectives& c, int r) {
      Mem m(8 * sizeof(float));
      for (int i = 0; i < 8; ++i) store<float>(m.data(), i, ((r + i) % 2) ? -0.0f : 0.0f);
      c.allreduce(m.buffer(), 8, DType{2, 32}, ReduceOp::kMin);
      results[r].assign(m.data(), m.data() + m.size());
    });
    for (int r = 1; r < p; ++r) EXPECT_EQ(results[r], results[0]) << "p=" << p << " rank " << r;
  }
}

TEST(Collectives, AllreduceTakesTheAlgorithmAskedFor) {
  // 4 ranks: recursive doubling sends 2 messages per rank, the ring 2(p-1) = 6;
  // forced either way at sizes where auto takes the other, the sum is the same.
  const int p = 4;
  const DType i32{0, 32};
  for (auto [count, algorithm, sends] :
       {std::tuple<std::size_t, tw::AllreduceAlgorithm, std::size_t>{40000, tw::AllreduceAlgorithm::kDoubling, 2 * p},
        {40000, tw::AllreduceAlgorithm::kAuto, 6 * p},
        {7, tw::AllreduceAlgorithm::kRing, 6 * p},
        {2, tw::AllreduceAlgorithm::kRing, 3 * p + 6},  // all-gather skips the 2 empty blocks
        {7, tw::AllreduceAlgorithm::kAuto, 2 * p}}) {
    Fabric fabric(p);
    auto errors = run_group(fabric, [&](tw::Collectives& c, int r) {
      EXPECT_EQ(c.allreduce_algorithm(7, i32), tw::AllreduceAlgorithm::kDoubling);
      EXPECT_EQ(c.allreduce_algorithm(3, i32), tw::AllreduceAlgorithm::kDoubling);  // fewer elements than ranks
      EXPECT_EQ(c.allreduce_algorithm((c.small_allreduce_limit() >> 2) + 1, i32), tw::AllreduceAlgorithm::kRing);
      Mem m(count * sizeof(std::int32_t));
      for (std::size_t k = 0; k < count; ++k) store<std::int32_t>(m.data(), k, static_cast<std::int32_t>(k) * (r + 1));
      c.allreduce(m.buffer(), count, i32, ReduceOp::kSum, 1.0, -1, algorithm);
      for (std::size_t k = 0; k < count; ++k) {
        ASSERT_EQ(load<std::int32_t>(m.data(), k), static_cast<std::int32_t>(k) * 10) << k;
      }
    });
    for (auto& e : errors) EXPECT_FALSE(e);
    EXPECT_EQ(fabric.collective_tags().size(), sends)
        << count << " elements, " << tw::allreduce_algorithm_name(algorithm);
  }
}

// ---------------------------------------------------------------- data movement

namespace {
std::byte pattern(int rank, std::size_t i, unsigned seed) {
  return static_cast<std::byte>((i * 131 + rank * 29 + seed * 7 + (i >> 8)) & 0xff);
}
// 0, 1, odd, past the eager limit of the double, and past the large-broadcast limit (512 KiB).
const std::vector<std::size_t> kByteSizes = {0, 1, 37, 4099, (std::size_t(512) << 10) + 13};
}  // namespace

class Movement : public ::testing::TestWithParam<int> {};

TEST_P(Movement, BroadcastEveryRootAndSize) {
  const int p = GetParam();
  for (std::size_t n : kByteSizes) {
    run_ok(p, [&](tw::Collectives& c, int r) {
      for (int root = 0; root < p; ++root) {
        Mem m(n);
        for (std::size_t i = 0; i < n; ++i) m.data()[i] = pattern(r, i, 1);
        c.broadcast(m.buffer(), root);
        for (std::size_t i = 0; i < n; ++i) {
          if (m.data()[i] != pattern(root, i, 1)) {
            ADD_FAILURE() << "broadcast p=" << p << " n=" << n << " root " << root << " rank " << r << " byte " << i;
            return;
          }
        }
      }
    });
  }
}

TEST_P(Movement, AllgatherGatherScatter) {
  const int p = GetParam();
  for (std::size_t n : kByteSizes) {
    if (n > (std::size_t(64) << 10)) n = 70001;  // p copies of it
    run_ok(p, [&](tw::Collectives& c, int r) {
      {  // allgather, from a separate input
        Mem in(n), out(p * n);
        for (std::size_t i = 0; i < n; ++i) in.data()[i] = pattern(r, i, 2);
        c.allgather(in.buffer(), out.buffer());
        for (int q = 0; q < p; ++q) {
          for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(out.data()[q * n + i], pattern(q, i, 2)) << "allgather p=" << p << " n=" << n << " from " << q;
          }
        }
      }
      {  // allgather in place: the input is the output's own block
        Mem out(p * n);
        for (std::size_t i = 0; i < n; ++i) out.data()[r * n + i] = pattern(r, i, 3);
        tw::Buffer in = out.buffer();
        in.data = n ? out.data() + r * n : nullptr;
        in.nbytes = n;
        c.allgather(in, out.buffer());
        for (int q = 0; q < p; ++q) {
          for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out.data()[q * n + i], pattern(q, i, 3));
        }
      }
      for (int root = 0; root < p; ++root) {  // gather
        Mem in(n), out(r == root ? p * n : 0);
        for (std::size_t i = 0; i < n; ++i) in.data()[i] = pattern(r, i, 4 + root);
        c.gather(in.buffer(), out.buffer(), root);
        if (r == root) {
          for (int q = 0; q < p; ++q) {
            for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out.data()[q * n + i], pattern(q, i, 4 + root));
          }
        }
      }
      for (int root = 0; root < p; ++root) {  // scatter
        Mem in(r == root ? p * n : 0), out(n);
        if (r == root) {
          for (std::size_t i = 0; i < p * n; ++i) in.data()[i] = pattern(root, i, 9);
        }
        c.scatter(in.buffer(), out.buffer(), root);
        for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out.data()[i], pattern(root, r * n + i, 9));
      }
    });
  }
}

TEST_P(Movement, AlltoallWithEmptyAndUnevenBlocks) {
  const int p = GetParam();
  for (std::size_t scale : {std::size_t(1), std::size_t(1000)}) {
    // rank a sends rank b block(a, b) bytes: some zero, some past the eager limit.
    auto block = [&](int a, int b) { return std::size_t((a * 7 + b * 3) % 5) * 13 * scale; };
    run_ok(p, [&](tw::Collectives& c, int r) {
      std::vector<std::size_t> soff(p), sbytes(p), roff(p), rbytes(p);
      std::size_t sin = 3, sout = 5;  // gaps before and between blocks
      for (int q = 0; q < p; ++q) {
        sbytes[q] = block(r, q);
        soff[q] = sin;
        sin += sbytes[q] + 1;
        rbytes[q] = block(q, r);
        roff[q] = sout;
        sout += rbytes[q] + 2;
      }
      Mem in(sin), out(sout);
      for (int q = 0; q < p; ++q) {
        for (std::size_t i = 0; i < sbytes[q]; ++i) in.data()[soff[q] + i] = pattern(r, q * 1000 + i, 5);
      }
      c.alltoall(in.buffer(), soff, sbytes, out.buffer(), roff, rbytes);
      for (int q = 0; q < p; ++q) {
        for (std::size_t i = 0; i < rbytes[q]; ++i) {
          ASSERT_EQ(out.data()[roff[q] + i], pattern(q, r * 1000 + i, 5)) << "alltoall p=" << p << " from " << q;
        }
      }
    });
  }
}

TEST_P(Movement, BarrierHoldsEveryRankUntilAllArrived) {
  const int p = GetParam();
  std::vector<std::atomic<int>> arrived(p);
  run_ok(p, [&](tw::Collectives& c, int r) {
    for (int round = 1; round <= 10; ++round) {
      if (r == round % p) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a late rank
      arrived[r].store(round);
      c.barrier();
      for (int q = 0; q < p; ++q) {
        EXPECT_GE(arrived[q].load(), round) << "rank " << r << " left barrier " << round << " before rank " << q;
      }
      c.barrier();  // nobody starts the next round while another still checks this one
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Movement, ::testing::Values(1, 2, 3, 4, 5),
                         [](const auto& info) { return "p" + std::to_string(info.param); });

// ---------------------------------------------------------------- tags

TEST(Collectives, EachCallTakesAFreshNegativeTagAndLeavesUserTagsAlone) {
  Fabric fabric(3);
  auto errors = run_group(fabric, [&](tw::Collectives& c, int r) {
    TestMessenger user(fabric, r, 5);  // the same rank's user traffic, tag 0
    Mem note(8);
    std::memset(note.data(), r + 1, 8);
    tw::Request sent;
    if (r == 0) sent = user.isend(note.buffer(), 1, 0);  // posted before the collectives, received after
    for (int i = 0; i < 4; ++i) {
      Mem m(4 * sizeof(std::int32_t));
      for (int k = 0; k < 4; ++k) store<std::int32_t>(m.data(), k, r + i);
      c.allreduce(m.buffer(), 4, DType{0, 32}, ReduceOp::kSum);
      EXPECT_EQ(load<std::int32_t>(m.data(), 0), 3 * i + 3);
      c.barrier();
    }
    EXPECT_EQ(c.calls(), 8u);
    if (r == 1) {
      Mem got(8);
      int source = -1;
      user.irecv(got.buffer(), tw::kAnySource, 0, &source).wait(5);
      EXPECT_EQ(source, 0);
      EXPECT_EQ(got.data()[0], std::byte{1});
    }
    sent.wait(5);
  });
  for (auto& e : errors) EXPECT_FALSE(e);
  for (std::int64_t tag : fabric.collective_tags()) EXPECT_TRUE(tag >= -8 && tag <= -1) << tag;
  EXPECT_EQ(fabric.pending(), 0u);
}

// ---------------------------------------------------------------- failures

namespace {
std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}
template <typename E>
bool is(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
}
}  // namespace

TEST(CollectivesFailure, APeerThatNeverAnswersTimesOutWithinTheBound) {
  using Clock = std::chrono::steady_clock;
  for (bool messenger_default : {false, true}) {
    Fabric fabric(3, 16);
    std::vector<double> took(3, 0);
    const auto errors = run_group(
        fabric,
        [&](tw::Collectives& c, int r) {
          if (r == 2) return;  // never calls
          Mem m(1000 * sizeof(float));
          const auto t0 = Clock::now();
          try {
            c.allreduce(m.buffer(), 1000, DType{2, 32}, ReduceOp::kSum, 1.0, messenger_default ? -1 : 0.3);
          } catch (...) {
            took[r] = std::chrono::duration<double>(Clock::now() - t0).count();
            throw;
          }
        },
        /*messenger_timeout_s=*/0.3);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(errors[r]) << "rank " << r << " did not fail";
      EXPECT_TRUE(is<tw::Timeout>(errors[r])) << message_of(errors[r]);
      EXPECT_GE(took[r], 0.29);
      EXPECT_LT(took[r], 2.0);
      EXPECT_NE(message_of(errors[r]).find("allreduce"), std::string::npos) << message_of(errors[r]);
    }
    // Rank 1 exchanges with rank 2 (recursive doubling over 3): it names it.
    EXPECT_NE(message_of(errors[1]).find("rank(s) 2"), std::string::npos) << message_of(errors[1]);
  }
}

TEST(CollectivesFailure, APeerFailureFailsEveryRankNamingIt) {
  using Clock = std::chrono::steady_clock;
  // A group-wide failure (every pending request fails, PeerFailed naming
  // rank 2): every op on every other rank raises it at once, whatever it
  // was waiting for; small and large (ring) all_reduce, and the others.
  const std::vector<std::pair<const char*, std::function<void(tw::Collectives&, int)>>> ops = {
      {"allreduce small",
       [](tw::Collectives& c, int) {
         Mem m(64);
         c.allreduce(m.buffer(), 16, DType{2, 32}, ReduceOp::kSum, 1, 30);
       }},
      {"allreduce ring",
       [](tw::Collectives& c, int) {
         Mem m(1 << 20);
         c.allreduce(m.buffer(), 1 << 18, DType{2, 32}, ReduceOp::kSum, 1, 30);
       }},
      {"reduce",
       [](tw::Collectives& c, int) {
         Mem m(4096);
         c.reduce(m.buffer(), 1024, DType{2, 32}, ReduceOp::kMax, 0, 1, 30);
       }},
      {"broadcast",
       [](tw::Collectives& c, int) {
         Mem m(1 << 20);
         c.broadcast(m.buffer(), 0, 30);
       }},
      {"allgather",
       [](tw::Collectives& c, int) {
         Mem in(4096), out(4 * 4096);
         c.allgather(in.buffer(), out.buffer(), 30);
       }},
      {"barrier", [](tw::Collectives& c, int) { c.barrier(30); }},
  };
  for (const auto& [name, op] : ops) {
    Fabric fabric(4, 16);
    std::vector<double> took(4, 0);
    std::thread killer([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      fabric.fail(2, /*group_wide=*/true);
    });
    const auto errors = run_group(fabric, [&](tw::Collectives& c, int r) {
      if (r == 2) return;  // the rank that dies
      const auto t0 = Clock::now();
      try {
        op(c, r);
      } catch (...) {
        took[r] = std::chrono::duration<double>(Clock::now() - t0).count();
        throw;
      }
    });
    killer.join();
    ASSERT_TRUE(errors[0]) << name << ": rank 0 did not fail";
    for (int r : {0, 1, 3}) {
      // Only a leaf of reduce's tree, whose parent is alive, may finish.
      if (!errors[r] && std::string(name) == "reduce" && r == 1) continue;
      ASSERT_TRUE(errors[r]) << name << ": rank " << r << " did not fail";
      EXPECT_TRUE(is<tw::PeerFailed>(errors[r])) << name << ": " << message_of(errors[r]);
      EXPECT_NE(message_of(errors[r]).find("rank 2"), std::string::npos) << message_of(errors[r]);
      EXPECT_LT(took[r], 2.0) << name;  // not the 30 s deadline
    }
  }
}

TEST(CollectivesFailure, AFailureOnALaterRequestIsNotHiddenByAnEarlierPendingOne) {
  // alltoall on 3 ranks: rank 0 posts a receive from rank 2 (which stays
  // silent) before the one from rank 1 (which fails). It must report rank 1's
  // failure soon, not time out waiting for rank 2.
  Fabric fabric(3, 16);
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    fabric.fail(1, /*group_wide=*/false);
  });
  using Clock = std::chrono::steady_clock;
  double took = 0;
  const auto errors = run_group(fabric, [&](tw::Collectives& c, int r) {
    if (r != 0) return;  // rank 2 silent, rank 1 dies
    std::vector<std::size_t> off = {0, 100, 200}, len = {100, 100, 100};
    Mem in(300), out(300);
    const auto t0 = Clock::now();
    try {
      c.alltoall(in.buffer(), off, len, out.buffer(), off, len, 30);
    } catch (...) {
      took = std::chrono::duration<double>(Clock::now() - t0).count();
      throw;
    }
  });
  killer.join();
  ASSERT_TRUE(errors[0]);
  EXPECT_TRUE(is<tw::PeerFailed>(errors[0])) << message_of(errors[0]);
  EXPECT_NE(message_of(errors[0]).find("rank 1"), std::string::npos) << message_of(errors[0]);
  EXPECT_LT(took, 2.0);
}

TEST(CollectivesFailure, BadArgumentsAreRefusedBeforeAnythingIsPosted) {
  Fabric fabric(2);
  const auto errors = run_group(fabric, [&](tw::Collectives& c, int r) {
    Mem m(16);
    EXPECT_THROW(c.allreduce(m.buffer(), 5, DType{2, 32}, ReduceOp::kSum), tw::InvalidArgument);  // 20 > 16 bytes
    EXPECT_THROW(c.allreduce(m.buffer(), 4, DType{2, 32}, ReduceOp::kBxor), tw::InvalidArgument);
    EXPECT_THROW(c.allreduce(m.buffer(), 4, DType{0, 32}, ReduceOp::kAvg), tw::InvalidArgument);
    EXPECT_THROW(c.reduce(m.buffer(), 4, DType{2, 32}, ReduceOp::kSum, 2), tw::InvalidArgument);
    EXPECT_THROW(c.broadcast(m.buffer(), -1), tw::InvalidArgument);
    Mem small(8);
    EXPECT_THROW(c.allgather(m.buffer(), small.buffer()), tw::InvalidArgument);
    EXPECT_THROW(c.reduce_scatter(m.buffer(), small.buffer(), 4, DType{2, 32}, ReduceOp::kSum), tw::InvalidArgument);
    std::vector<std::size_t> two = {0, 8}, one = {0};
    EXPECT_THROW(c.alltoall(m.buffer(), one, one, m.buffer(), one, one), tw::InvalidArgument);
    EXPECT_THROW(c.alltoall(m.buffer(), two, two, m.buffer(), two, two), tw::InvalidArgument);  // in == out
    EXPECT_EQ(c.calls(), 0u);
  });
  for (auto& e : errors) EXPECT_FALSE(e) << message_of(e);
  EXPECT_EQ(fabric.pending(), 0u);
}
