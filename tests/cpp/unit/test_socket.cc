// Copyright tensorwire authors.
// net::Conn over a loopback tcp connection: how frames are handed to the
// kernel (the first write of a large frame, the send buffer of large frames),
// the delayed acks a reading connection asks for, riders, and what the owner of
// landed or sent memory can call off (a guarded landing, own_payloads).
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "net/socket.h"
#include "tensorwire/error.h"

namespace net = tensorwire::net;

namespace {

struct Frame {
  std::string header;
  std::vector<char> payload;
  bool landed = false;
};

// A connected pair: `tx` writes, `rx` is served by `poller` and collects frames.
struct Pair {
  int tx_fd = -1, rx_fd = -1;
  std::shared_ptr<net::Conn> tx, rx;
  net::Poller poller, tx_poller;
  std::vector<Frame> got;

  Pair() {
    int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listener, 1), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
    tx_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(::connect(tx_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    rx_fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(listener);
    net::tune(tx_fd, 0);
    net::tune(rx_fd, 0);
    tx = std::make_shared<net::Conn>(tx_fd, "tx");
    rx = std::make_shared<net::Conn>(rx_fd, "rx");
    tx_poller.add(
        tx, [](const std::shared_ptr<net::Conn>&, const char*, std::size_t, net::Payload&) {},
        [](const std::shared_ptr<net::Conn>&, const std::string&) {});
    poller.add(
        rx,
        [this](const std::shared_ptr<net::Conn>&, const char* header, std::size_t length, net::Payload& payload) {
          got.emplace_back();
          Frame& f = got.back();
          f.header.assign(header, length);
          f.payload.resize(payload.length());
          const std::size_t at = got.size() - 1;
          payload.land(f.payload.data(), [this, at](bool ok) { got[at].landed = ok; });
        },
        [](const std::shared_ptr<net::Conn>&, const std::string&) {});
  }

  // Sends one frame, driving both sides until it arrived whole (bounded).
  void send_and_receive(const std::string& header, const std::vector<char>& payload) {
    const std::size_t before = got.size();
    tx->send(header, payload.data(), payload.size());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!(got.size() > before && got.back().landed) && std::chrono::steady_clock::now() < deadline) {
      tx_poller.progress(0);
      poller.progress(1);
    }
    ASSERT_GT(got.size(), before) << "no frame within 20 s";
    ASSERT_TRUE(got.back().landed) << "the payload did not land within 20 s";
  }
};

std::vector<char> pattern(std::size_t n, unsigned seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  return v;
}

int sndbuf(int fd) {
  int v = 0;
  socklen_t len = sizeof(v);
  ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &len);
  return v;
}

}  // namespace

// Frames on both sides of the first write's cap (64 KiB first for frames over
// 128 KiB), with the header inside it and a header larger than it, arrive whole.
TEST(Socket, FramesAroundTheFirstWriteArriveWhole) {
  Pair p;
  struct Shape {
    std::size_t header, payload;
  };
  const Shape shapes[] = {{40, 100},     {40, 128 << 10},        {40, (128 << 10) + 1},      {40, 1 << 20},
                          {40, 3 << 20}, {100 << 10, 200 << 10}, {(64 << 10) - 16, 1 << 20}, {70 << 10, 0}};
  unsigned seed = 1;
  for (const Shape& s : shapes) {
    const std::vector<char> h = pattern(s.header, seed);
    const std::vector<char> body = pattern(s.payload, seed + 100);
    p.send_and_receive(std::string(h.begin(), h.end()), body);
    const Frame& f = p.got.back();
    EXPECT_EQ(f.header, std::string(h.begin(), h.end())) << "header " << s.header << ", payload " << s.payload;
    EXPECT_TRUE(f.payload == body) << "header " << s.header << ", payload " << s.payload;
    ++seed;
  }
}

// Frames over 2 MiB go through a 512 KiB send buffer (the kernel doubles it),
// smaller ones after them through 2 MiB (4 MiB); where wmem_max cannot give
// that back, the kernel keeps sizing it.
TEST(Socket, LargeFramesGetASmallSendBuffer) {
  Pair p;
  const int autotuned = sndbuf(p.tx_fd);
  p.send_and_receive("small", pattern(64 << 10, 1));
  const int after_small = sndbuf(p.tx_fd);  // the kernel's (a frame of 64 KiB sets nothing)
  p.send_and_receive("large", pattern(3 << 20, 2));
  if (!net::send_buffers_settable()) {
    EXPECT_GE(sndbuf(p.tx_fd), autotuned) << "the kernel's sizing was overridden although wmem_max is small";
    GTEST_SKIP() << "net.core.wmem_max is below 2 MiB here: send buffers are the kernel's";
  }
  EXPECT_EQ(sndbuf(p.tx_fd), 2 * (512 << 10)) << "before: " << after_small;
  p.send_and_receive("small again", pattern(64 << 10, 3));
  EXPECT_EQ(sndbuf(p.tx_fd), 2 * (2 << 20));
}

// A connection that read a frame asked the kernel for delayed acks
// (TCP_QUICKACK reads 0 while they are on).
TEST(Socket, AReadAsksForDelayedAcks) {
  Pair p;
  int quick = -1;
  socklen_t len = sizeof(quick);
  ::getsockopt(p.rx_fd, IPPROTO_TCP, TCP_QUICKACK, &quick, &len);
  EXPECT_EQ(quick, 1) << "a fresh connection acks at once";
  p.send_and_receive("hello", pattern(4096, 4));
  ::getsockopt(p.rx_fd, IPPROTO_TCP, TCP_QUICKACK, &quick, &len);
  EXPECT_EQ(quick, 0);
}

// A rider waits for the connection's next frame and arrives just ahead of it;
// a later rider with the same key replaces it; flush_riders() sends what still
// waits on its own; a closed connection refuses one.
TEST(Socket, RidersGoAheadOfTheNextFrame) {
  Pair p;
  const int a = 0, b = 0;
  EXPECT_TRUE(p.tx->ride(&a, "release 1"));   // none waited: the caller arranges a flush
  EXPECT_FALSE(p.tx->ride(&a, "release 2"));  // replaces "release 1"
  EXPECT_FALSE(p.tx->ride(&b, "other"));
  p.send_and_receive("reply", pattern(100, 5));
  ASSERT_EQ(p.got.size(), 3u);
  EXPECT_EQ(p.got[0].header, "release 2");
  EXPECT_TRUE(p.got[0].payload.empty());
  EXPECT_EQ(p.got[1].header, "other");
  EXPECT_EQ(p.got[2].header, "reply");
  EXPECT_TRUE(p.got[2].payload == pattern(100, 5));

  p.tx->flush_riders();  // nothing waits: nothing is sent
  EXPECT_TRUE(p.tx->ride(&a, "release 3"));
  p.tx->flush_riders();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (p.got.size() < 4 && std::chrono::steady_clock::now() < deadline) p.poller.progress(1);
  ASSERT_EQ(p.got.size(), 4u) << "the flushed rider did not arrive within 20 s";
  EXPECT_EQ(p.got[3].header, "release 3");
  p.send_and_receive("after", {});
  ASSERT_EQ(p.got.size(), 5u) << "a flushed rider went twice";

  p.tx->close("test");
  EXPECT_THROW(p.tx->ride(&a, "late"), tensorwire::ConnectionError);
}

// ---- what the owner of landed or sent memory can call off (issue 49 item 1) ----

namespace {

bool drive_until(net::Poller& a, net::Poller& b, const std::function<bool()>& ready) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    a.progress(0);
    b.progress(1);
  }
  return true;
}

}  // namespace

// A guarded landing called off midway: what arrived before stays, nothing
// after lands, done(false), and the next frame is read whole.
TEST(Socket, AGuardedLandingCalledOffDiscardsTheRest) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  auto rx = std::make_shared<net::Conn>(fds[1], "rx");
  net::Poller poller, none;
  constexpr std::size_t kN = std::size_t(256) << 10, kFirst = std::size_t(64) << 10;
  std::vector<char> dst(kN, 0);
  auto guard = std::make_shared<net::LandingGuard>();
  int done = -1, frames = 0;
  poller.add(
      rx,
      [&](const std::shared_ptr<net::Conn>&, const char*, std::size_t, net::Payload& payload) {
        if (frames++ == 0) payload.land(dst.data(), [&](bool ok) { done = ok; }, guard);
      },
      [](const std::shared_ptr<net::Conn>&, const std::string&) {});
  const std::string head = net::encode_prefix(1, kN) + "h";
  const std::string first = head + std::string(kFirst, 'a');
  ASSERT_EQ(::write(fds[0], first.data(), first.size()), static_cast<ssize_t>(first.size()));
  ASSERT_TRUE(drive_until(poller, none, [&] { return dst[kFirst - 1] == 'a'; }));
  {
    std::lock_guard<std::mutex> lock(guard->mu);
    guard->discard = true;
  }
  const std::string rest = std::string(kN - kFirst, 'b') + net::encode_prefix(1, 0) + "n";
  std::size_t off = 0;
  while (off < rest.size()) {  // the socket pair's buffer is smaller than the rest: drive between writes
    const ssize_t w = ::send(fds[0], rest.data() + off, rest.size() - off, MSG_DONTWAIT);
    if (w > 0) off += static_cast<std::size_t>(w);
    poller.progress(0);
  }
  ASSERT_TRUE(drive_until(poller, none, [&] { return frames == 2; })) << "the frame after the discarded one";
  EXPECT_EQ(done, 0);
  EXPECT_EQ(std::count(dst.begin(), dst.end(), 'b'), 0) << "bytes landed after the landing was called off";
  EXPECT_EQ(std::count(dst.begin(), dst.begin() + kFirst, 'a'), static_cast<std::ptrdiff_t>(kFirst));
  ::close(fds[0]);
}

// A queued frame's payload copied by own_payloads: the peer reads the bytes
// as they were, whatever the memory holds afterwards.
TEST(Socket, OwnPayloadsCopiesWhatIsQueued) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  auto tx = std::make_shared<net::Conn>(fds[0], "tx");
  auto rx = std::make_shared<net::Conn>(fds[1], "rx");
  net::Poller tx_poller, rx_poller;
  tx_poller.add(
      tx, [](const std::shared_ptr<net::Conn>&, const char*, std::size_t, net::Payload&) {},
      [](const std::shared_ptr<net::Conn>&, const std::string&) {});
  constexpr std::size_t kN = std::size_t(4) << 20;  // more than the socket takes at once
  std::vector<char> memory(kN, 'o');
  std::vector<char> got(kN, 0);
  bool landed = false;
  ASSERT_FALSE(tx->send("h", memory.data(), kN)) << "the frame left at once: nothing to test";
  tx->own_payloads(reinterpret_cast<std::uintptr_t>(memory.data()),
                   reinterpret_cast<std::uintptr_t>(memory.data()) + kN);
  std::fill(memory.begin(), memory.end(), 'x');  // the memory's next owner
  rx_poller.add(
      rx,
      [&](const std::shared_ptr<net::Conn>&, const char*, std::size_t, net::Payload& payload) {
        payload.land(got.data(), [&](bool ok) { landed = ok; });
      },
      [](const std::shared_ptr<net::Conn>&, const std::string&) {});
  ASSERT_TRUE(drive_until(tx_poller, rx_poller, [&] { return landed; }));
  EXPECT_EQ(std::count(got.begin(), got.end(), 'x'), 0) << "the queued frame read the memory after it was owned";
}
