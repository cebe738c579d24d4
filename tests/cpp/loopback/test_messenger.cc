// Copyright tensorwire authors.
//
// The tagged-message engine (tensorwire/messenger.h) between ranks that are
// threads of this process, each with its own Device, over tcp and shared
// memory: eager and placed messages, MPI matching (tags, order, any source),
// credits, sizes that differ, a failed peer named by rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "tensorwire/collectives.h"
#include "tensorwire/device.h"
#include "tensorwire/error.h"
#include "tensorwire/messenger.h"

namespace tw = tensorwire;

namespace {

// An in-memory key-value store the rank threads share (the c10d store's role).
class MemoryRendezvous : public tw::Rendezvous {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[key] = value;
    cv_.notify_all();
  }
  std::string get(const std::string& key, double timeout_s) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return kv_.count(key) > 0; })) {
      throw tw::Timeout("no key " + key);
    }
    return kv_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

tw::DeviceConfig config(const std::string& transport) {
  tw::DeviceConfig c;
  c.host = "127.0.0.1";
  c.net_devices = "lo";
  c.transport = transport;
  c.progress = tw::ProgressMode::kBlocking;
  c.slab_size = std::size_t(8) << 20;
  c.liveness_s = 2.0;
  return c;
}

tw::Buffer buf(std::vector<std::uint8_t>& v) { return tw::Buffer{v.data(), v.size()}; }

// Runs fn(rank, messenger) on `n` ranks, each a thread with its own Device.
void run_ranks(int n, const std::string& transport, const std::function<void(int, tw::Messenger&)>& fn,
               tw::MessengerConfig mc = {}) {
  MemoryRendezvous rv;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        tw::Device device(config(transport));
        auto m = tw::make_messenger(device, r, n, rv, mc);
        fn(r, *m);
        m->close();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

std::vector<std::uint8_t> pattern(std::size_t n, int seed) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 7 + seed);
  return v;
}

class Messages : public ::testing::TestWithParam<std::string> {};

TEST_P(Messages, EagerAndPlacedArriveWhole) {
  for (std::size_t n :
       {std::size_t(0), std::size_t(8), std::size_t(4096), std::size_t(128) << 10, (std::size_t(1) << 20) + 3}) {
    run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
      if (r == 0) {
        auto v = pattern(n, 3);
        m.isend(buf(v), 1, 5).wait(10);
      } else {
        std::vector<std::uint8_t> v(n, 0xEE);
        int src = -2;
        m.irecv(buf(v), 0, 5, &src).wait(10);
        EXPECT_EQ(v, pattern(n, 3)) << n << " B";
        EXPECT_EQ(src, 0);
      }
    });
  }
}

TEST_P(Messages, LargeMessagesShareTheirCopyWhereEachSideMovesItsOwn) {
  // Over shared memory the receiver reads its half of a large message out of
  // the sender's buffer while the sender writes the other half (a FIN frees
  // the sender's buffer); over tcp the sender writes it all. Receives posted
  // before and after the message arrives; sizes at the threshold and odd ones.
  // Shared memory whose RMA needs no target shares (the UCX version and the forced lane form decide).
  const char* form = std::getenv("TENSORWIRE_LANE_FORM");  // (ctest runs it in each forced form)
  const bool may_share = GetParam() == "shm" && !(form && std::string(form) == "messages");
  for (std::size_t n : {std::size_t(256) << 10, (std::size_t(1) << 20) + 3, (std::size_t(5) << 20) + 4097}) {
    for (bool late : {false, true}) {
      run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
        if (r == 0) {
          auto v = pattern(n, 11);
          m.isend(buf(v), 1, 9).wait(10);
          v.assign(n, 0);  // reused once the send completed: the receiver must have it all by then
          m.isend(buf(v), 1, 10).wait(10);
        } else {
          if (late) std::this_thread::sleep_for(std::chrono::milliseconds(50));
          std::vector<std::uint8_t> v(n, 0xEE), w(n, 0xEE);
          m.irecv(buf(v), 0, 9).wait(10);
          m.irecv(buf(w), 0, 10).wait(10);
          EXPECT_EQ(v, pattern(n, 11)) << n << " B, late " << late;
          EXPECT_EQ(w, std::vector<std::uint8_t>(n, 0)) << n << " B, late " << late;
          if (!may_share) EXPECT_FALSE(m.shares_copies(0));
          EXPECT_EQ(m.stats().shared_receives, m.shares_copies(0) ? 2u : 0u) << n << " B";
        }
      });
    }
  }
}

TEST_P(Messages, ARegistrationOfUnmappedMemoryIsNotReused) {
  // The engine caches the registration of a placed message's allocation. Once
  // the process unmaps that memory (UCX's memory hooks report it), a new
  // mapping at the same address is other memory: registered anew, and what
  // it holds arrives.
  const std::size_t n = std::size_t(4) << 20;
  run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
    for (int round = 0; round < 3; ++round) {
      if (r == 0) {
        void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ASSERT_NE(p, MAP_FAILED);
        std::memset(p, 0x30 + round, n);
        m.isend(tw::Buffer{p, n}, 1, 20 + round).wait(10);
        ::munmap(p, n);
      } else {
        std::vector<std::uint8_t> v(n, 0);
        m.irecv(buf(v), 0, 20 + round).wait(10);
        EXPECT_EQ(v, std::vector<std::uint8_t>(n, 0x30 + round)) << "round " << round;
      }
    }
    if (r == 0) EXPECT_GE(m.stats().stale_registrations, 2u);
  });
}

TEST_P(Messages, TagsMatchInPostingOrderAndAnySourceTakesEveryone) {
  run_ranks(3, GetParam(), [&](int r, tw::Messenger& m) {
    if (r > 0) {
      // tag 2 first, then tag 1: the receiver posts tag 1 first and must still get the right ones
      for (std::size_t n : {std::size_t(64), std::size_t(300) << 10}) {
        auto a = pattern(n, 10 * r + 2), b = pattern(n, 10 * r + 1);
        auto s1 = m.isend(buf(a), 0, 2);
        auto s2 = m.isend(buf(b), 0, 1);
        s1.wait(10);
        s2.wait(10);
      }
      return;
    }
    for (std::size_t n : {std::size_t(64), std::size_t(300) << 10}) {
      for (int peer = 1; peer <= 2; ++peer) {
        std::vector<std::uint8_t> one(n), two(n);
        auto r1 = m.irecv(buf(one), peer, 1);
        auto r2 = m.irecv(buf(two), peer, 2);
        r1.wait(10);
        r2.wait(10);
        EXPECT_EQ(one, pattern(n, 10 * peer + 1));
        EXPECT_EQ(two, pattern(n, 10 * peer + 2));
      }
    }
  });
  run_ranks(3, GetParam(), [&](int r, tw::Messenger& m) {
    if (r > 0) {
      auto v = pattern(1000, r);
      m.isend(buf(v), 0, 9).wait(10);
      return;
    }
    std::vector<int> seen;
    for (int i = 0; i < 2; ++i) {
      std::vector<std::uint8_t> v(1000);
      int src = -2;
      m.irecv(buf(v), tw::kAnySource, 9, &src).wait(10);
      ASSERT_TRUE(src == 1 || src == 2) << src;
      EXPECT_EQ(v, pattern(1000, src));
      seen.push_back(src);
    }
    EXPECT_NE(seen[0], seen[1]);
  });
}

// Far more messages than the ring holds, sent before any receive is posted:
// credits hold the sender back, the unexpected queue keeps order.
TEST_P(Messages, ManyOutstandingKeepTheirOrder) {
  constexpr int kCount = 300;
  run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
    if (r == 0) {
      std::vector<std::vector<std::uint8_t>> data;
      std::vector<tw::Request> reqs;
      for (int i = 0; i < kCount; ++i) data.push_back(pattern(i % 3 == 0 ? (200 << 10) : 100, i));
      for (int i = 0; i < kCount; ++i) reqs.push_back(m.isend(buf(data[i]), 1, 4));
      for (auto& q : reqs) q.wait(20);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      for (int i = 0; i < kCount; ++i) {
        std::vector<std::uint8_t> v(i % 3 == 0 ? (200 << 10) : 100);
        m.irecv(buf(v), 0, 4).wait(20);
        ASSERT_EQ(v, pattern(v.size(), i)) << "message " << i;
      }
    }
  });
}

TEST_P(Messages, SizesThatDifferFailBothSides) {
  run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
    std::vector<std::uint8_t> v(r == 0 ? (1 << 20) : (1 << 19));
    if (r == 0) {
      try {
        m.isend(buf(v), 1, 0).wait(10);
        ADD_FAILURE() << "a placed send into a smaller receive completed";
      } catch (const tw::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("524288"), std::string::npos) << e.what();
      }
    } else {
      try {
        m.irecv(buf(v), 0, 0).wait(10);
        ADD_FAILURE() << "a receive of the wrong size completed";
      } catch (const tw::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("1048576"), std::string::npos) << e.what();
      }
    }
  });
}

TEST_P(Messages, BadArgumentsAreRefusedAtOnce) {
  run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
    std::vector<std::uint8_t> v(8);
    EXPECT_THROW(m.isend(buf(v), r, 0), tw::InvalidArgument);
    EXPECT_THROW(m.isend(buf(v), 2, 0), tw::InvalidArgument);
    EXPECT_THROW(m.isend(buf(v), tw::kAnySource, 0), tw::InvalidArgument);
    EXPECT_THROW(m.irecv(tw::Buffer{nullptr, 8}, 1 - r, 0), tw::InvalidArgument);
  });
}

// A peer that goes away fails what waits for it, naming its rank, within the liveness bound.
TEST_P(Messages, AFailedPeerIsNamedByRank) {
  MemoryRendezvous rv;
  std::string error;
  int failed_rank = -2;
  std::thread quitter([&] {
    tw::Device device(config(GetParam()));
    auto m = tw::make_messenger(device, 1, 2, rv);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    device.close();  // without a word
  });
  {
    tw::Device device(config(GetParam()));
    auto m = tw::make_messenger(device, 0, 2, rv);
    std::vector<std::uint8_t> v(64);
    auto req = m->irecv(buf(v), 1, 0);
    try {
      req.wait(15);
    } catch (const tw::Error& e) {
      error = e.what();
    }
    failed_rank = req.failed_rank();
  }
  quitter.join();
  EXPECT_NE(error, "");
  EXPECT_EQ(failed_rank, 1) << error;
}

// A sender that sent and left: what arrived whole is still received (consuming the 32nd
// record hands credit back to a peer that is gone, which must not fail anything).
TEST_P(Messages, MessagesOfASenderThatLeftAreReceived) {
  MemoryRendezvous rv;
  std::mutex mu;
  std::condition_variable cv;
  bool left = false;
  std::thread sender([&] {
    tw::Device device(config(GetParam()));
    auto m = tw::make_messenger(device, 1, 2, rv);
    for (int k = 0; k < 60; ++k) {
      auto v = pattern(16, k);
      m->isend(buf(v), 0, 0).wait(10);
    }
    m->close();
    device.close();
    std::lock_guard<std::mutex> lock(mu);
    left = true;
    cv.notify_all();
  });
  tw::Device device(config(GetParam()));
  auto m = tw::make_messenger(device, 0, 2, rv);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return left; });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its failure is seen by now
  for (int k = 0; k < 60; ++k) {
    std::vector<std::uint8_t> v(16);
    ASSERT_NO_THROW(m->irecv(buf(v), 1, 0).wait(10)) << "message " << k;
    ASSERT_EQ(v, pattern(16, k)) << "message " << k;
  }
  std::vector<std::uint8_t> v(16);
  EXPECT_THROW(m->irecv(buf(v), 1, 0).wait(10), tw::Error);  // nothing more will come
  sender.join();
}

// A rank that closes says so (BYE) to every peer, also one it never sent to: the
// others' collective messages among themselves go on; a death would fail them.
TEST_P(Messages, ARankThatLeftIsNoDeath) {
  run_ranks(3, GetParam(), [&](int r, tw::Messenger& m) {
    if (r == 2) return;                                           // closes at once, having sent nothing
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its going is seen by now
    auto v = pattern(1000, r);
    std::vector<std::uint8_t> got(1000);
    auto s = m.isend(buf(v), 1 - r, -5);
    m.irecv(buf(got), 1 - r, -5).wait(10);
    s.wait(10);
    EXPECT_EQ(got, pattern(1000, 1 - r));
  });
}

TEST_P(Messages, CloseFailsWhatIsPending) {
  run_ranks(2, GetParam(), [&](int r, tw::Messenger& m) {
    std::vector<std::uint8_t> v(64);
    if (r != 0) {  // stays until rank 0 has gone: this receive fails then
      EXPECT_THROW(m.irecv(buf(v), 0, 78).wait(15), tw::Error);
      return;
    }
    auto req = m.irecv(buf(v), 1, 77);  // never sent
    m.close();
    EXPECT_THROW(req.wait(5), tw::ConnectionError);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Messages, ::testing::Values(std::string("tcp"), std::string("shm")),
                         [](const auto& info) { return info.param; });

}  // namespace

// ---- the collectives layer on the real engine ----

namespace {

class CollectivesOnTheEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(CollectivesOnTheEngine, EveryOpAgreesWithItsDefinition) {
  constexpr int kRanks = 3;
  const tw::DType f32{2, 32};
  for (std::size_t count : {std::size_t(5), std::size_t(300) << 10}) {  // recursive doubling, ring
    run_ranks(kRanks, GetParam(), [&](int r, tw::Messenger& m) {
      tw::Collectives c(m);
      std::vector<float> v(count);
      for (std::size_t i = 0; i < count; ++i) v[i] = float(r + 1) * float(i % 97);
      c.allreduce(tw::Buffer{v.data(), v.size() * 4}, count, f32, tw::ReduceOp::kSum);
      for (std::size_t i = 0; i < count; i += 997) ASSERT_EQ(v[i], 6.0f * float(i % 97)) << i;

      std::vector<std::uint8_t> mine(count, std::uint8_t(r + 1)), all(count * kRanks);
      c.allgather(tw::Buffer{mine.data(), mine.size()}, tw::Buffer{all.data(), all.size()});
      for (int p = 0; p < kRanks; ++p) ASSERT_EQ(all[p * count + count / 2], p + 1);

      std::vector<std::uint8_t> b(count, r == 1 ? 42 : 0);
      c.broadcast(tw::Buffer{b.data(), b.size()}, 1);
      ASSERT_EQ(b[count - 1], 42);

      std::vector<std::size_t> off(kRanks), len(kRanks, count);
      for (int p = 0; p < kRanks; ++p) off[p] = p * count;
      std::vector<std::uint8_t> in(count * kRanks), out(count * kRanks);
      for (int p = 0; p < kRanks; ++p) std::fill(in.begin() + p * count, in.begin() + (p + 1) * count, r * 10 + p);
      c.alltoall(tw::Buffer{in.data(), in.size()}, off, len, tw::Buffer{out.data(), out.size()}, off, len);
      for (int p = 0; p < kRanks; ++p) ASSERT_EQ(out[p * count], p * 10 + r);
      c.barrier();
    });
  }
}

// The rooted ops and the scaled reductions, small (tree, recursive doubling)
// and large (ring reduce-scatter: reduce, reduce_scatter, all_reduce), a
// broadcast by scatter + all-gather, three
// times on one Collectives (its scratch reused, registered once): non-root
// data of reduce and the input of reduce_scatter are left as they were.
TEST_P(CollectivesOnTheEngine, RootedAndScaledOpsLeaveInputsAlone) {
  constexpr int kRanks = 3;
  const tw::DType f32{2, 32};
  for (std::size_t count : {std::size_t(7), std::size_t(100) << 10}) {
    run_ranks(kRanks, GetParam(), [&](int r, tw::Messenger& m) {
      tw::Collectives c(m);
      auto x = [](std::size_t i) { return float(i % 89); };
      for (int round = 0; round < 3; ++round) {
        std::vector<float> v(count);
        for (std::size_t i = 0; i < count; ++i) v[i] = float(r + 1) * x(i);
        const std::vector<float> before = v;
        c.reduce(tw::Buffer{v.data(), count * 4}, count, f32, tw::ReduceOp::kSum, 2);
        if (r == 2) {
          for (std::size_t i = 0; i < count; i += 331) ASSERT_EQ(v[i], 6.0f * x(i)) << i;
        } else {
          ASSERT_EQ(v, before) << "reduce changed rank " << r << "'s data";
        }

        std::vector<float> in(kRanks * count), out(count);
        for (std::size_t i = 0; i < in.size(); ++i) in[i] = float(r + 1) * x(i);
        const std::vector<float> in_before = in;
        c.reduce_scatter(tw::Buffer{in.data(), in.size() * 4}, tw::Buffer{out.data(), count * 4}, count, f32,
                         tw::ReduceOp::kAvg);
        ASSERT_EQ(in, in_before);
        for (std::size_t i = 0; i < count; i += 331) ASSERT_EQ(out[i], 2.0f * x(r * count + i)) << i;

        for (std::size_t i = 0; i < count; ++i) v[i] = float(r + 1) * x(i);
        c.allreduce(tw::Buffer{v.data(), count * 4}, count, f32, tw::ReduceOp::kPremulSum, 0.5);
        for (std::size_t i = 0; i < count; i += 331) ASSERT_EQ(v[i], 3.0f * x(i)) << i;

        std::vector<std::uint8_t> mine(count, std::uint8_t(r + 7)), all(kRanks * count);
        c.gather(tw::Buffer{mine.data(), count}, tw::Buffer{all.data(), all.size()}, 0);
        if (r == 0) {
          for (int p = 0; p < kRanks; ++p) ASSERT_EQ(all[p * count + count - 1], p + 7);
        }
        std::vector<std::uint8_t> part(count);
        if (r == 1) {
          for (int p = 0; p < kRanks; ++p) std::fill(all.begin() + p * count, all.begin() + (p + 1) * count, 50 + p);
        }
        c.scatter(tw::Buffer{all.data(), all.size()}, tw::Buffer{part.data(), count}, 1);
        ASSERT_EQ(part[count / 2], 50 + r);

        // 1 MiB + 3: the root scatters, the ring all-gathers (uneven blocks).
        std::vector<std::uint8_t> big((std::size_t(1) << 20) + 3);
        for (std::size_t i = 0; i < big.size(); ++i) big[i] = r == 2 ? std::uint8_t(i * 13 + round) : 0;
        const std::vector<std::uint8_t> root_before = big;
        c.broadcast(tw::Buffer{big.data(), big.size()}, 2);
        for (std::size_t i = 0; i < big.size(); i += 4093) ASSERT_EQ(big[i], std::uint8_t(i * 13 + round)) << i;
        ASSERT_EQ(big.back(), std::uint8_t((big.size() - 1) * 13 + round));
        if (r == 2) ASSERT_EQ(big, root_before);
      }
    });
  }
}

// A rank whose device goes away mid-call: the ranks that exchange with it in
// a ring all_reduce (both, on 3 ranks) fail with PeerFailed naming it, within
// the liveness bound (2 s here), not at the call's 20 s deadline.
TEST_P(CollectivesOnTheEngine, ARankThatDiesFailsTheCallNamingIt) {
  using Clock = std::chrono::steady_clock;
  MemoryRendezvous rv;
  std::vector<std::string> error(3);
  std::vector<bool> peer_failed(3, false);
  std::vector<double> took(3, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      tw::Device device(config(GetParam()));
      auto m = tw::make_messenger(device, r, 3, rv);
      if (r == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        device.close();  // without a word, never joining the call
        return;
      }
      tw::Collectives c(*m);
      std::vector<float> v(std::size_t(256) << 10, 1.0f);
      const auto t0 = Clock::now();
      try {
        c.allreduce(tw::Buffer{v.data(), v.size() * 4}, v.size(), tw::DType{2, 32}, tw::ReduceOp::kSum, 1.0, 20);
      } catch (const tw::PeerFailed& e) {
        peer_failed[r] = true;
        error[r] = e.what();
      } catch (const std::exception& e) {
        error[r] = e.what();
      }
      took[r] = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(peer_failed[r]) << "rank " << r << ": " << error[r];
    EXPECT_NE(error[r].find("rank 2"), std::string::npos) << error[r];
    EXPECT_LT(took[r], 10.0) << error[r];
  }
}

// Not a test: all_reduce (float32 sum) per call, recursive doubling against
// the ring at each size, for choosing the threshold (docs/collectives.md).
// TENSORWIRE_COLL_TEST_RANKS=3 ./tw_loopback_tests --gtest_also_run_disabled_tests
// --gtest_filter='*AllreduceAlgorithmTimes*'
TEST_P(CollectivesOnTheEngine, DISABLED_AllreduceAlgorithmTimes) {
  const int ranks =
      std::getenv("TENSORWIRE_COLL_TEST_RANKS") ? std::atoi(std::getenv("TENSORWIRE_COLL_TEST_RANKS")) : 2;
  std::printf("# %s, %d ranks (threads of one process, a Device each), float32 sum, median of 30 calls (rank 0)\n",
              GetParam().c_str(), ranks);
  std::printf("%10s %12s %12s\n", "bytes", "doubling_us", "ring_us");
  for (std::size_t bytes :
       {std::size_t(1) << 10, std::size_t(16) << 10, std::size_t(64) << 10, std::size_t(128) << 10,
        std::size_t(256) << 10, std::size_t(512) << 10, std::size_t(1) << 20, std::size_t(4) << 20}) {
    double us[2] = {0, 0};
    for (int alg = 0; alg < 2; ++alg) {
      // The threshold is read when a Collectives is made: all of doubling or all of the ring.
      setenv("TENSORWIRE_COLL_SMALL_BYTES", alg == 0 ? "1000000000000" : "0", 1);
      run_ranks(ranks, GetParam(), [&](int r, tw::Messenger& m) {
        tw::Collectives c(m);
        std::vector<float> v(bytes / 4, 1.0f);
        std::vector<double> t;
        for (int i = 0; i < 35; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          c.allreduce(tw::Buffer{v.data(), bytes}, v.size(), tw::DType{2, 32}, tw::ReduceOp::kSum);
          if (i >= 5) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(t.begin(), t.end());
        if (r == 0) us[alg] = t[t.size() / 2] * 1e6;
      });
    }
    unsetenv("TENSORWIRE_COLL_SMALL_BYTES");
    std::printf("%10zu %12.1f %12.1f\n", bytes, us[0], us[1]);
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, CollectivesOnTheEngine, ::testing::Values(std::string("tcp"), std::string("shm")),
                         [](const auto& info) { return info.param; });

}  // namespace
