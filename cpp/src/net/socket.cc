// Copyright tensorwire authors.
#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "tensorwire/error.h"

namespace tensorwire::net {

namespace {

constexpr std::size_t kRxChunk = std::size_t(256) << 10;  // the most one read asks for
// What a read asks for before it knows the frame: 16 KiB and room for a frame's prefix and
// header, so that a 16 KiB tensor's frame comes in one read, not two (bench tensor over tcp,
// bench/results/net_one_socket_riders.txt, last section).
constexpr std::size_t kFirstLook = (std::size_t(16) << 10) + 512;
constexpr unsigned kFramesPerTurn = 256;  // then other connections get their turn
constexpr int kAcceptPauseMs = 50;        // a listener out of descriptors waits this long before it accepts again
// A frame larger than twice this goes out in two writes at least: this much
// first, then the rest. One sendmsg of a whole megabyte left the receiver
// idle while the sender copied it in (loopback, sender and receiver on two
// CPUs): a 1 MiB read one at a time took 290 us, 110 us with the small write
// first (read_bw 1 MiB 2.3x, write_bw 1 MiB 1.4x, 16 MiB unchanged;
// bench/results/net_first_write.txt). Every write capped so was slower at
// 16 MiB (0.6x): only the first one is.
constexpr std::size_t kFirstWrite = std::size_t(64) << 10;
// Frames larger than kStreamFrom go out through a send buffer of
// kStreamSndbuf (the kernel doubles it): the kernel's own sizing (4 MiB here)
// queued megabytes that the receiver then copied out of cold cache, 16 MiB
// streams 1.3x slower; smaller frames keep a large buffer, since 1 MiB through
// the small one waited for room mid-frame (0.85x). bench/results/net_sndbuf.txt.
constexpr std::uint64_t kStreamFrom = std::uint64_t(2) << 20;
constexpr int kStreamSndbuf = 512 << 10;
constexpr int kFrameSndbuf = 2 << 20;  // doubled: the 4 MiB the kernel grows to anyway (wmem_max here)
constexpr auto kDelayedAcksEvery = std::chrono::milliseconds(5);  // under the kernel's 40 ms ack timer

void put32(char* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
void put64(char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}
std::uint32_t get32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}
std::uint64_t get64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Markers in epoll's data for the two fds that are not connections.
char wake_marker, listen_marker;

}  // namespace

void append_prefix(std::string* out, std::size_t header_length, std::uint64_t payload_length) {
  char p[kPrefixSize];
  put32(&p[0], kFrameMagic);
  put32(&p[4], static_cast<std::uint32_t>(header_length));
  put64(&p[8], payload_length);
  out->append(p, kPrefixSize);
}

std::string encode_prefix(std::size_t header_length, std::uint64_t payload_length) {
  std::string p;
  append_prefix(&p, header_length, payload_length);
  return p;
}

std::string decode_prefix(const char* p, Prefix* out) {
  if (get32(p) != kFrameMagic) return "bad frame magic";
  out->header_length = get32(p + 4);
  out->payload_length = get64(p + 8);
  if (out->header_length > kMaxHeader) return "frame header of " + std::to_string(out->header_length) + " bytes";
  if (out->payload_length > kMaxPayload) return "frame payload of " + std::to_string(out->payload_length) + " bytes";
  return "";
}

sockaddr_storage resolve(const std::string& host, std::uint16_t port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || !res) throw InvalidArgument("cannot resolve host '" + host + "': " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

std::pair<std::string, std::uint16_t> split_address(const std::string& address) {
  auto pos = address.rfind(':');
  if (pos == std::string::npos || pos == 0 || pos + 1 == address.size()) {
    throw InvalidArgument("address must be host:port, got '" + address + "'");
  }
  char* end = nullptr;
  unsigned long port = std::strtoul(address.c_str() + pos + 1, &end, 10);
  if (*end != '\0' || port == 0 || port > 65535) throw InvalidArgument("bad port in address '" + address + "'");
  return {address.substr(0, pos), static_cast<std::uint16_t>(port)};
}

void tune(int fd, double keepalive_s) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (keepalive_s > 0) {
    int secs = std::max(1, static_cast<int>(std::ceil(keepalive_s)));
    int probes = 3;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &secs, sizeof(secs));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &secs, sizeof(secs));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  }
}

// ---- Payload ----

void Payload::land(void* dst, std::function<void(bool)> done, std::shared_ptr<LandingGuard> guard) {
  if (taken_) throw InvalidArgument("a frame's payload was landed twice");
  taken_ = true;
  if (eager_ || length_ == 0) {
    bool ok = true;
    if (guard) {
      std::lock_guard<std::mutex> lock(guard->mu);
      ok = !guard->discard;
      if (ok && length_) std::memcpy(dst, eager_, length_);
    } else if (length_) {
      std::memcpy(dst, eager_, length_);
    }
    if (done) done(ok);
    return;
  }
  conn_->land_at_ = static_cast<char*>(dst);
  conn_->land_done_ = std::move(done);
  conn_->land_guard_ = std::move(guard);
}

// ---- Conn ----

std::shared_ptr<Conn> Conn::dial(const sockaddr_storage& addr, socklen_t len, const std::string& name, double timeout_s,
                                 double keepalive_s, const std::string& interface) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw ConnectionError("cannot connect to " + name + ": socket: " + std::strerror(errno));
  if (!interface.empty() &&
      setsockopt(fd, SOL_SOCKET, SO_BINDTODEVICE, interface.data(), static_cast<socklen_t>(interface.size())) != 0) {
    const int err = errno;
    ::close(fd);
    throw ConnectionError("cannot bind a connection to " + name + " to interface '" + interface +
                          "': " + std::strerror(err));
  }
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len);
  if (rc != 0 && errno == EINPROGRESS) {
    struct pollfd pfd{fd, POLLOUT, 0};
    int ms = timeout_s < 0 ? -1 : static_cast<int>(std::min(timeout_s * 1e3, 2e9));
    int n;
    do {
      n = ::poll(&pfd, 1, ms);
    } while (n < 0 && errno == EINTR);
    if (n == 0) {
      ::close(fd);
      throw ConnectionError("cannot connect to " + name + ": no answer within " + std::to_string(timeout_s) + " s");
    }
    int err = 0;
    socklen_t elen = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
    rc = err ? -1 : 0;
    errno = err;
  }
  if (rc != 0) {
    const int err = errno;
    ::close(fd);
    throw ConnectionError("cannot connect to " + name + ": " + std::strerror(err));
  }
  tune(fd, keepalive_s);
  return std::make_shared<Conn>(fd, name);
}

Conn::Conn(int fd, std::string name) : fd_(fd), name_(std::move(name)) {
  int flags = fcntl(fd_, F_GETFL, 0);
  if (flags >= 0 && !(flags & O_NONBLOCK)) fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
}

Conn::~Conn() { ::close(fd_); }

std::size_t Conn::queued() const {
  std::lock_guard<std::mutex> lock(tx_mu_);
  return tx_bytes_;
}

void Conn::own_payloads(std::uintptr_t start, std::uintptr_t end) {
  std::lock_guard<std::mutex> lock(tx_mu_);
  for (TxOp& op : txq_) {
    const auto at = reinterpret_cast<std::uintptr_t>(op.payload);
    if (!op.length || !op.owned.empty() || at >= end || at + op.length <= start) continue;
    op.owned.assign(op.payload, op.length);  // the whole payload: write_some indexes it by op.sent
    op.payload = op.owned.data();
  }
}

// A send buffer set once stays set (the kernel stops sizing it) and is capped
// at net.core.wmem_max: where that is below kFrameSndbuf (212992 by default;
// 4 MiB on the machine measured), setting one would leave every later frame
// a buffer smaller than the kernel's own, so the kernel keeps sizing it.
bool send_buffers_settable() {
  static const bool ok = [] {
    long wmem_max = 0;
    if (std::FILE* f = std::fopen("/proc/sys/net/core/wmem_max", "r")) {
      if (std::fscanf(f, "%ld", &wmem_max) != 1) wmem_max = 0;
      std::fclose(f);
    }
    return wmem_max >= kFrameSndbuf;
  }();
  return ok;
}

void Conn::size_send_buffer(std::uint64_t frame) {
  if (!send_buffers_settable()) return;
  const bool small = frame > kStreamFrom;
  if (small == small_sndbuf_) return;
  small_sndbuf_ = small;
  const int bytes = small ? kStreamSndbuf : kFrameSndbuf;
  setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
}

bool Conn::write_some(TxOp& op) {
  const std::uint64_t total = op.head.size() + op.length;
  if (op.sent == 0) size_send_buffer(total);
  while (op.sent < total) {
    iovec iov[2];
    int n = 0;
    if (op.sent < op.head.size()) {
      iov[n++] = {const_cast<char*>(op.head.data()) + op.sent, op.head.size() - op.sent};
      if (op.length) iov[n++] = {const_cast<char*>(op.payload), op.length};
    } else {
      const std::uint64_t at = op.sent - op.head.size();
      iov[n++] = {const_cast<char*>(op.payload) + at, op.length - at};
    }
    if (op.sent == 0 && total > 2 * kFirstWrite) {
      if (iov[0].iov_len >= kFirstWrite) {
        iov[0].iov_len = kFirstWrite;
        n = 1;
      } else {
        iov[1].iov_len = kFirstWrite - iov[0].iov_len;
      }
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t w = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      op.sent += static_cast<std::uint64_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    errno_ = w < 0 ? errno : EPIPE;
    return false;
  }
  return true;
}

bool Conn::send(std::string_view header, const void* payload, std::uint64_t length,
                const std::function<SendDone()>& when_queued, bool reply) {
  if (header.size() > kMaxHeader) {
    throw InvalidArgument("a frame header of " + std::to_string(header.size()) + " bytes exceeds the limit");
  }
  if (length > kMaxPayload)
    throw InvalidArgument("a payload of " + std::to_string(length) + " bytes exceeds the limit");
  TxOp op;
  op.head.reserve(kPrefixSize + header.size());  // one allocation for prefix and header
  append_prefix(&op.head, header.size(), length);
  op.head.append(header);
  op.payload = static_cast<const char*>(payload);
  op.length = length;
  std::unique_lock<std::mutex> lock(tx_mu_);
  Writing writing(*this);
  if (closing_.load(std::memory_order_acquire)) {
    throw ConnectionError("connection to " + name_ + " is closed" + (close_why_.empty() ? "" : ": " + close_why_));
  }
  take_riders(op);
  if (txq_.empty()) {
    if (!write_some(op)) {
      const std::string why = std::string("send failed: ") + std::strerror(errno_);
      lock.unlock();
      close(why);
      throw ConnectionError("connection to " + name_ + ": " + why);
    }
    if (op.sent == op.head.size() + op.length) return true;
  }
  tx_bytes_ += op.head.size() + op.length - op.sent;
  if (when_queued) op.done = when_queued();
  if (reply) {
    op.charge = op.head.size() + op.length - op.sent + kReplyOverhead;
    reply_backlog_ += op.charge;
  }
  txq_.push_back(std::move(op));
  if (reply_backlog_ > kPauseReadingAt && !read_paused_.load(std::memory_order_relaxed)) {
    read_paused_.store(true, std::memory_order_release);
    want_out_ = true;
    queued_out_.store(true, std::memory_order_release);
    sync_events();
    return false;
  }
  want_writable(true);  // an epoll_ctl only when that changes
  return false;
}

void Conn::sync_events() {
  if (poller_) poller_->update(this, want_out_, !read_paused_.load(std::memory_order_relaxed));
}

bool Conn::take_riders(TxOp& op) {
  if (riders_.empty()) return false;
  std::string head;
  for (const auto& r : riders_) head += r.second;
  head += op.head;
  op.head.swap(head);
  riders_.clear();
  return true;
}

bool Conn::ride(const void* key, std::string_view header) {
  if (header.size() > kMaxHeader) {
    throw InvalidArgument("a frame header of " + std::to_string(header.size()) + " bytes exceeds the limit");
  }
  std::string frame;
  frame.reserve(kPrefixSize + header.size());
  append_prefix(&frame, header.size(), 0);
  frame.append(header);
  std::lock_guard<std::mutex> lock(tx_mu_);
  if (closing_.load(std::memory_order_acquire)) {
    throw ConnectionError("connection to " + name_ + " is closed" + (close_why_.empty() ? "" : ": " + close_why_));
  }
  for (auto& r : riders_) {
    if (r.first == key) {
      r.second.swap(frame);
      return false;
    }
  }
  riders_.emplace_back(key, std::move(frame));
  return riders_.size() == 1;
}

void Conn::flush_riders() {
  std::unique_lock<std::mutex> lock(tx_mu_);
  Writing writing(*this);
  TxOp op;
  if (closing_.load(std::memory_order_acquire) || !take_riders(op)) return;
  if (txq_.empty()) {
    if (!write_some(op)) {
      const std::string why = std::string("send failed: ") + std::strerror(errno_);
      lock.unlock();
      close(why);
      return;
    }
    if (op.sent == op.head.size()) return;
  }
  tx_bytes_ += op.head.size() - op.sent;
  txq_.push_back(std::move(op));
  want_writable(true);
}

void Conn::want_writable(bool on) {
  if (on == want_out_) return;
  want_out_ = on;
  queued_out_.store(on, std::memory_order_release);
  sync_events();
}

void Conn::close(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(tx_mu_);
    if (close_why_.empty()) close_why_ = why;
    closing_.store(true, std::memory_order_release);
  }
  // The poller sees the end (EOF) and finishes the connection in its thread.
  ::shutdown(fd_, SHUT_RDWR);
}

unsigned Conn::on_writable() {
  std::vector<SendDone> dones;
  bool failed = false;
  bool resumed = false;
  {
    std::lock_guard<std::mutex> lock(tx_mu_);
    Writing writing(*this);
    while (!txq_.empty()) {
      TxOp& op = txq_.front();
      const std::uint64_t before = op.sent;
      if (!write_some(op)) {
        failed = true;
        break;
      }
      tx_bytes_ -= op.sent - before;
      if (op.sent < op.head.size() + op.length) break;
      reply_backlog_ -= op.charge;
      dones.push_back(std::move(op.done));
      txq_.pop_front();
    }
    if (read_paused_.load(std::memory_order_relaxed) && reply_backlog_ <= kResumeReadingAt) {
      read_paused_.store(false, std::memory_order_release);
      resumed = true;
    }
    if (resumed) {
      want_out_ = !txq_.empty();
      queued_out_.store(want_out_, std::memory_order_release);
      sync_events();
    } else if (txq_.empty()) {
      want_writable(false);  // an epoll_ctl only when that changes
    }
  }
  // Frames already buffered raise no event: dispatched at the next progress.
  if (resumed && poller_) poller_->schedule(this);
  for (auto& d : dones) {
    if (d) d(true);
  }
  if (failed) close(std::string("send failed: ") + std::strerror(errno_));
  return static_cast<unsigned>(dones.size());
}

void Conn::ask_delayed_acks() {
  // A lane carries one side's messages and the replies to them, so a small
  // message often has nothing to ride back on: the kernel acknowledged each
  // one with a segment of its own, sent from inside the receiver's recv (twice
  // the segments of UCX's tcp, which shares one connection both ways: a 4 KiB
  // slot round trip 14.4 us against 12.1 with delayed acks). Bulk data is
  // still acknowledged every second full segment. The kernel leaves the
  // delayed mode when its ack timer fires (an idle spell), so it is asked
  // again after kDelayedAcksEvery, not on every read (a syscall: write_lat
  // 8 B lost 0.4 us to it). bench/results/net_delayed_acks.txt.
  const auto now = std::chrono::steady_clock::now();
  if (now - delayed_acks_at_ < kDelayedAcksEvery) return;
  delayed_acks_at_ = now;
  int zero = 0;
  setsockopt(fd_, IPPROTO_TCP, TCP_QUICKACK, &zero, sizeof(zero));
}

Conn::Read Conn::read_more() {
  // How much to ask for. A streamed payload must go from the socket straight
  // to its destination, so a read never runs past the header of a frame
  // whose payload is streamed, and a read that does not know the next frame
  // yet asks for kFirstLook: a small frame and the ones after it come in one
  // read, and at most that much of a large payload is copied twice (a 256 KiB
  // look copied a quarter of every 1 MiB read again: read_bw 1 MiB 0.55x
  // the UCX lanes it replaced).
  const std::size_t have = rx_end_ - rx_begin_;
  std::size_t ask = kFirstLook;
  if (have >= kPrefixSize) {
    Prefix p;
    if (decode_prefix(rx_.data() + rx_begin_, &p).empty()) {
      const bool eager = p.payload_length <= kEagerMax;
      const std::size_t frame = kPrefixSize + p.header_length + (eager ? p.payload_length : 0);
      // Grown as bytes arrive, never on a length's word alone: a 16-byte prefix
      // claiming a 1 MiB header costs nothing until the header comes (fuzz_frame).
      if (frame > have) ask = eager ? std::max(frame - have, kFirstLook) : frame - have;
      ask = std::min(ask, kRxChunk);
    }
  }
  if (rx_begin_ > 0 && (have == 0 || rx_.size() - rx_end_ < ask)) {
    std::memmove(rx_.data(), rx_.data() + rx_begin_, have);
    rx_begin_ = 0;
    rx_end_ = have;
  }
  if (rx_.size() - rx_end_ < ask) rx_.resize(rx_end_ + ask);
  for (;;) {
    ssize_t r = ::recv(fd_, rx_.data() + rx_end_, ask, MSG_DONTWAIT);
    if (r > 0) {
      ask_delayed_acks();
      rx_end_ += static_cast<std::size_t>(r);
      return static_cast<std::size_t>(r) < ask ? kDrained : kMore;
    }
    if (r == 0) {
      finish(closed() ? close_why_ : "closed by the peer");
      return kNothing;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return kNothing;
    finish(closed() ? close_why_ : std::string("receive failed: ") + std::strerror(errno));
    return kNothing;
  }
}

bool Conn::dispatch_buffered(unsigned* frames) {
  while (!finished_ && !moving_ && !read_paused_.load(std::memory_order_acquire)) {
    const std::size_t have = rx_end_ - rx_begin_;
    if (have < kPrefixSize) return true;
    Prefix p;
    const std::string bad = decode_prefix(rx_.data() + rx_begin_, &p);
    if (!bad.empty()) {
      TW_LOG_WARN("closing the connection to %s: %s", name_.c_str(), bad.c_str());
      finish("protocol error: " + bad);
      return false;
    }
    const bool eager = p.payload_length <= kEagerMax;
    const std::size_t need = kPrefixSize + p.header_length + (eager ? p.payload_length : 0);
    if (have < need) return true;
    const char* header = rx_.data() + rx_begin_ + kPrefixSize;
    Payload payload(this, eager ? header + p.header_length : nullptr, p.payload_length);
    rx_begin_ += need;  // the handler's pointers stay valid: nothing reads into the buffer meanwhile
    ++*frames;
    try {
      on_frame_(shared_from_this(), header, p.header_length, payload);
    } catch (const std::exception& e) {
      TW_LOG_WARN("dropping a frame from %s: %s", name_.c_str(), e.what());
    }
    if (!eager) {
      land_left_ = p.payload_length;
      discarding_ = !payload.taken_;
      if (discarding_) land_at_ = nullptr;
      return true;
    }
    // Every complete frame in the buffer goes now: buffered bytes raise no
    // event, so one left behind would wait for the peer's next bytes.
  }
  return !finished_;
}

bool Conn::on_readable(unsigned* frames) {
  const unsigned start = *frames;
  // A read that did not fill the room it had drained the socket (as good as
  // certain): what it brought is handled, then the poller waits for the next
  // event instead of paying a recv that says EAGAIN (a syscall per message).
  bool drained = false;
  while (!finished_ && !moving_) {
    if (land_left_ > 0) {
      // A streamed payload: first what the buffer holds, then straight from the socket.
      // A guarded landing holds its guard's lock around every copy into the
      // destination, and turns into a discard once its owner called it off.
      std::unique_lock<std::mutex> guarded;
      auto hold = [&] {
        if (!land_guard_ || discarding_) return;
        guarded = std::unique_lock<std::mutex>(land_guard_->mu);
        if (land_guard_->discard) {
          guarded.unlock();
          discarding_ = true;
          land_failed_ = true;
          land_at_ = nullptr;
        }
      };
      const std::size_t have = rx_end_ - rx_begin_;
      if (have) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(have, land_left_));
        hold();
        if (!discarding_) {
          std::memcpy(land_at_, rx_.data() + rx_begin_, n);
          land_at_ += n;
        }
        if (guarded.owns_lock()) guarded.unlock();
        rx_begin_ += n;
        land_left_ -= n;
      }
      while (land_left_ > 0) {
        if (rx_begin_ == rx_end_) rx_begin_ = rx_end_ = 0;
        hold();
        if (discarding_ && rx_.size() < kRxChunk) rx_.resize(kRxChunk);  // before taking its address
        char* into = discarding_ ? rx_.data() : land_at_;
        const std::size_t room = discarding_ ? rx_.size() : std::size_t(1) << 30;
        const std::size_t ask = static_cast<std::size_t>(std::min<std::uint64_t>(land_left_, room));
        ssize_t r = ::recv(fd_, into, ask, MSG_DONTWAIT);
        if (guarded.owns_lock()) guarded.unlock();
        if (r > 0) {
          if (!discarding_) land_at_ += r;
          land_left_ -= static_cast<std::uint64_t>(r);
          // Not "drained" here: a large payload keeps streaming in, and the
          // next recv usually finds more (returning to the poller per read
          // cost 16 MiB transfers ~20%).
          continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
        finish(r == 0 ? (closed() ? close_why_ : "closed by the peer")
                      : std::string("receive failed: ") + std::strerror(errno));
        return false;
      }
      land_at_ = nullptr;
      discarding_ = false;
      land_guard_.reset();
      const bool ok = !land_failed_;
      land_failed_ = false;
      auto done = std::move(land_done_);
      land_done_ = nullptr;
      if (done) done(ok);
      continue;
    }
    // Paused (the peer leaves our replies unread): its frames wait, in the
    // buffer and in the socket, until on_writable resumes reading.
    if (read_paused_.load(std::memory_order_acquire)) return true;
    if (!dispatch_buffered(frames)) return false;
    if (land_left_ > 0 || moving_) continue;
    if (drained) return true;
    if (*frames - start >= kFramesPerTurn) {
      if (poller_) poller_->schedule(this);  // what is buffered raises no event
      return true;
    }
    const Read got = read_more();
    if (got == kNothing) return !finished_;
    drained = got == kDrained;
  }
  return !finished_;
}

void Conn::finish(const std::string& why) {
  if (finished_) return;
  finished_ = true;
  std::deque<TxOp> pending;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(tx_mu_);
    if (close_why_.empty()) close_why_ = why;
    reason = close_why_;
    closing_.store(true, std::memory_order_release);
    pending.swap(txq_);
    tx_bytes_ = 0;
    reply_backlog_ = 0;
  }
  ::shutdown(fd_, SHUT_RDWR);
  for (auto& op : pending) {
    if (op.done) op.done(false);
  }
  if (land_done_) {
    auto done = std::move(land_done_);
    land_done_ = nullptr;
    done(false);
  }
  land_guard_.reset();
  land_left_ = 0;
  std::vector<char>().swap(rx_);  // a closed connection a peer object still holds keeps no buffer
  rx_begin_ = rx_end_ = 0;
  if (on_close_) {
    auto self = shared_from_this();
    try {
      on_close_(self, reason);
    } catch (const std::exception& e) {
      TW_LOG_WARN("close handler of %s: %s", name_.c_str(), e.what());
    }
  }
}

// ---- Poller ----

Poller::Poller() {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wake_fd_ < 0)
    throw ConnectionError(std::string("cannot create a socket poller: ") + std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &wake_marker;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
}

Poller::~Poller() {
  std::vector<std::shared_ptr<Conn>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [p, c] : conns_) left.push_back(c);
    conns_.clear();
    ready_.clear();
  }
  for (auto& c : left) {
    {
      std::lock_guard<std::mutex> lock(c->tx_mu_);
      c->poller_ = nullptr;
    }
    c->finish("closed");
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  ::close(wake_fd_);
  ::close(epfd_);
}

void Poller::add(const std::shared_ptr<Conn>& conn, FrameHandler on_frame, CloseHandler on_close) {
  conn->on_frame_ = std::move(on_frame);
  conn->on_close_ = std::move(on_close);
  conn->moving_ = false;
  bool out, in;
  {
    std::lock_guard<std::mutex> lock(conn->tx_mu_);
    conn->poller_ = this;
    out = conn->want_out_;
    in = !conn->read_paused_.load(std::memory_order_relaxed);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns_[conn.get()] = conn;
    count_.store(conns_.size(), std::memory_order_relaxed);
  }
  epoll_event ev{};
  ev.events = (in ? std::uint32_t(EPOLLIN | EPOLLRDHUP) : 0u) | (out ? std::uint32_t(EPOLLOUT) : 0u);
  ev.data.ptr = conn.get();
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, conn->fd_, &ev) != 0) {
    TW_LOG_ERROR("epoll_ctl(ADD) for %s: %s", conn->name_.c_str(), std::strerror(errno));
  }
  if (conn->rx_end_ > conn->rx_begin_) schedule(conn.get());
  wake();  // a progress() asleep before this connection existed
}

void Poller::remove(const std::shared_ptr<Conn>& conn) {
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, conn->fd_, nullptr);
  {
    std::lock_guard<std::mutex> lock(conn->tx_mu_);
    conn->poller_ = nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  conns_.erase(conn.get());
  count_.store(conns_.size(), std::memory_order_relaxed);
}

void Poller::listen(int fd, std::function<void(int)> on_accept) {
  listen_fd_ = fd;
  on_accept_ = std::move(on_accept);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &listen_marker;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
}

void Poller::update(Conn* conn, bool want_out, bool want_in) {
  epoll_event ev{};
  ev.events = (want_in ? std::uint32_t(EPOLLIN | EPOLLRDHUP) : 0u) | (want_out ? std::uint32_t(EPOLLOUT) : 0u);
  ev.data.ptr = conn;
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, conn->fd_, &ev);
}

void Poller::schedule(Conn* conn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(conn);
  if (it == conns_.end()) return;
  ready_.push_back(it->second);
  has_ready_.store(true, std::memory_order_release);
  wake();  // its bytes are buffered, not in the socket: a nap on fd() must still end
}

void Poller::wake() {
  const std::uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
  (void)ignored;
}

unsigned Poller::progress(int timeout_ms) {
  // One thread at a time (an inline device's workers have no lock of their
  // own: two waiters reading one socket at once tore its frames apart). A
  // caller that finds it busy, or a handler that waits inside it, returns:
  // the thread inside handles what is ready.
  if (busy_.exchange(true, std::memory_order_acquire)) return 0;
  struct Leave {
    std::atomic<bool>& busy;
    ~Leave() { busy.store(false, std::memory_order_release); }
  } leave{busy_};
  unsigned handled = 0;
  auto serve = [&](const std::shared_ptr<Conn>& c, std::uint32_t events) {
    if (events & EPOLLOUT) handled += c->on_writable();
    if (c->reading_paused() && (events & (EPOLLHUP | EPOLLERR))) {
      // Nothing will read its frames nor take our replies: a paused connection that hangs up ends.
      c->finish("closed by the peer with " + std::to_string(c->queued()) + " bytes of replies unread");
      remove(c);
      return;
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
      if (!c->on_readable(&handled)) {
        remove(c);
        return;
      }
    }
    if (c->moving_) {
      // Handed to another poller by its frame handler (Conn::move_to).
      auto to = c->move_to_;
      auto on_frame = std::move(c->move_frame_);
      auto on_close = std::move(c->move_close_);
      remove(c);
      if (to) to->add(c, std::move(on_frame), std::move(on_close));  // else parked by its owner
    }
  };
  if (has_ready_.load(std::memory_order_acquire)) {
    std::vector<std::shared_ptr<Conn>> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready.swap(ready_);
      has_ready_.store(false, std::memory_order_relaxed);
    }
    for (auto& c : ready) serve(c, EPOLLIN);
    timeout_ms = 0;
  }
  if (count_.load(std::memory_order_relaxed) == 0 && listen_fd_ < 0 && timeout_ms == 0) return handled;
  // A look (timeout 0: a spinning waiter's) at a poller with one connection
  // that has nothing to write: its recv says whether bytes came, where
  // epoll_wait and then the recv were two syscalls per frame (a 1 KiB tcp
  // slot round trip 0.6 us shorter; bench/results/net_one_socket_riders.txt).
  if (timeout_ms == 0 && listen_fd_ < 0 && count_.load(std::memory_order_relaxed) == 1) {
    std::shared_ptr<Conn> only;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (conns_.size() == 1) only = conns_.begin()->second;
    }
    if (only && !only->tx_busy_.load(std::memory_order_acquire)) {
      serve(only, EPOLLIN);
      return handled;
    }
  }
  if (listen_paused_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= listen_paused_until_) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = &listen_marker;
      ::epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);
      listen_paused_ = false;
    } else {
      const int left =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(listen_paused_until_ - now).count()) +
          1;
      if (timeout_ms < 0 || timeout_ms > left) timeout_ms = left;
    }
  }
  epoll_event events[64];
  int n;
  do {
    n = ::epoll_wait(epfd_, events, 64, timeout_ms);
  } while (n < 0 && errno == EINTR);
  for (int i = 0; i < n; ++i) {
    void* p = events[i].data.ptr;
    if (p == &wake_marker) {
      std::uint64_t v;
      ssize_t ignored = ::read(wake_fd_, &v, sizeof(v));
      (void)ignored;
      continue;
    }
    if (p == &listen_marker) {
      for (;;) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            // Out of descriptors: the pending connection stays pending and
            // the listener readable, which would spin this thread. It rests
            // out of the poll for a while; connections that end meanwhile give descriptors back.
            TW_LOG_WARN("cannot accept a connection: %s (retrying in %d ms)", std::strerror(errno), kAcceptPauseMs);
            ::epoll_ctl(epfd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
            listen_paused_until_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(kAcceptPauseMs);
            listen_paused_ = true;
          }
          break;
        }
        ++handled;
        on_accept_(fd);
      }
      continue;
    }
    std::shared_ptr<Conn> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = conns_.find(static_cast<Conn*>(p));
      if (it == conns_.end()) continue;  // finished earlier in this batch
      c = it->second;
    }
    serve(c, events[i].events);
  }
  return handled;
}

}  // namespace tensorwire::net
