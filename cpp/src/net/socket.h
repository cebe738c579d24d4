// Copyright tensorwire authors.
//
// tensorwire's own tcp transport: framed messages over plain sockets, for
// every connection a network peer can reach (the control plane, and the data
// lanes of the tcp transport). UCX's tcp transport is not used there: its
// target carries out any put or get a peer's packet names, at any address of
// the process (docs/contracts.md §11), which no check of ours can stop. Here
// the target reads every byte itself and decides where it lands.
//
// A frame: u32 magic "TWSK" | u32 header length | u64 payload length |
// header | payload (little-endian). The header is what the owner decodes
// (a control message, a data message's header); the payload is bytes whose
// destination the receiver chooses after reading the header: a payload of at
// most kEagerMax arrives whole in the receive buffer, a larger one is read
// from the socket straight into the destination the handler names
// (Payload::land), or discarded.
//
// Threads: a Poller's progress() runs in one thread at a time (another
// thread's call returns at once); it reads, dispatches frames, writes what
// send() queued and delivers closes. send() and close() may be called from
// any thread.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tensorwire::net {

inline constexpr std::uint32_t kFrameMagic = 0x4b535754;  // "TWSK"
inline constexpr std::size_t kPrefixSize = 16;
inline constexpr std::size_t kMaxHeader = (std::size_t(1) << 20) + 4096;  // a control message of 1 MiB and its header
inline constexpr std::uint64_t kMaxPayload = std::uint64_t(1) << 40;
inline constexpr std::size_t kEagerMax = std::size_t(64) << 10;

struct Prefix {
  std::uint32_t header_length = 0;
  std::uint64_t payload_length = 0;
};
// Decodes the 16 bytes at p; "" when valid, else why not (bad magic, sizes past the limits).
std::string decode_prefix(const char* p, Prefix* out);
std::string encode_prefix(std::size_t header_length, std::uint64_t payload_length);
void append_prefix(std::string* out, std::size_t header_length, std::uint64_t payload_length);

class Conn;
class Poller;

// A landing its destination's owner can call off (the memory is being
// freed): the socket holds mu around every copy into the destination, and
// once discard is set it reads the rest of the payload into a sink and calls
// done(false). So after the owner set discard under mu, no byte of the frame
// reaches the destination again (a recv in progress finishes first: bounded
// by what the socket holds).
struct LandingGuard {
  std::mutex mu;
  bool discard = false;
};

// The payload of the frame being dispatched, as its handler sees it.
class Payload {
 public:
  std::uint64_t length() const { return length_; }
  // The whole payload when it arrived with the header (valid during the handler), else nullptr.
  const char* data() const { return eager_; }
  // Lands the payload at dst (length() bytes) and calls done(ok) once it is
  // all there: at once for an eager payload, else as the socket delivers it
  // (done(false) if the connection closes first). At most once, during the
  // handler; a payload nobody lands is read and dropped. With a guard, the
  // landing stops when guard->discard is set (see LandingGuard).
  void land(void* dst, std::function<void(bool ok)> done, std::shared_ptr<LandingGuard> guard = nullptr);
  bool eager() const { return eager_ != nullptr || length_ == 0; }

 private:
  friend class Conn;
  Payload(Conn* conn, const char* eager, std::uint64_t length) : conn_(conn), eager_(eager), length_(length) {}
  Conn* conn_;
  const char* eager_;
  std::uint64_t length_;
  bool taken_ = false;
};

using FrameHandler = std::function<void(const std::shared_ptr<Conn>& conn, const char* header,
                                        std::size_t header_length, Payload& payload)>;
// Delivered once, from the poller's thread, when the connection ends (EOF,
// error, a protocol violation, or close()).
using CloseHandler = std::function<void(const std::shared_ptr<Conn>& conn, const std::string& why)>;
using SendDone = std::function<void(bool ok)>;

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  // Connects to addr within timeout_s (ConnectionError naming `name`
  // otherwise), tuned as tune(fd, keepalive_s) says, through `interface` when
  // one is named (SO_BINDTODEVICE).
  static std::shared_ptr<Conn> dial(const sockaddr_storage& addr, socklen_t len, const std::string& name,
                                    double timeout_s, double keepalive_s, const std::string& interface = "");
  Conn(int fd, std::string name);  // takes a connected socket
  ~Conn();
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  // Sends one frame: header is copied, payload must stay valid until sent.
  // True when the whole frame left now; false when the rest is queued:
  // then when_queued() is called (once, under this connection's lock: it
  // must not use the connection) and what it returns is called with ok once
  // the rest left, or with false when the connection closes first. So a
  // frame that leaves at once costs its sender no tracking. Throws
  // ConnectionError on a closed connection.
  //
  // A reply (an answer to a frame this side read: `reply`) that is queued
  // counts against the peer: once more than kPauseReadingAt bytes of replies
  // wait unsent (the peer does not read them), this connection stops reading
  // the peer's frames until they are down to kResumeReadingAt (backpressure:
  // a peer that asks and never reads cannot grow its target's memory). Only
  // replies count: two sides writing to each other at once each keep reading.
  bool send(std::string_view header, const void* payload = nullptr, std::uint64_t length = 0,
            const std::function<SendDone()>& when_queued = nullptr, bool reply = false);
  static constexpr std::size_t kPauseReadingAt = std::size_t(16) << 20;
  static constexpr std::size_t kResumeReadingAt = std::size_t(4) << 20;
  static constexpr std::size_t kReplyOverhead = 256;  // what a queued frame costs beyond its bytes
  bool reading_paused() const { return read_paused_.load(std::memory_order_acquire); }
  // A header-only frame that waits for this connection's next send() and
  // leaves in the same write, ahead of that send's frame (no syscall and no
  // segment of its own: a slot's release rides on the reply it precedes). A
  // later rider with the same `key` replaces a waiting one. Returns true when
  // none was waiting: the caller then arranges a flush_riders() for the case
  // that no send comes. Throws ConnectionError on a closed connection.
  bool ride(const void* key, std::string_view header);
  // Sends the riders still waiting, in one write.
  void flush_riders();
  // Ends the connection (any thread); the poller delivers the close handler.
  void close(const std::string& why);
  bool closed() const { return closing_.load(std::memory_order_acquire); }
  const std::string& name() const { return name_; }
  // Bytes in flight in send() calls not yet written (the sender's backlog).
  std::size_t queued() const;
  // Copies the payload of every queued frame whose payload overlaps
  // [start, end) into memory the frame owns: that memory is about to be freed
  // (a get's reply must not read it after its grant ended).
  void own_payloads(std::uintptr_t start, std::uintptr_t end);
  // From this connection's frame handler: once the handler returns, its
  // poller hands the connection to `to`, whose handlers get every later frame
  // (bytes already received included); with `to` null it only leaves the
  // poller (its owner adds it somewhere later).
  void move_to(Poller* to, FrameHandler on_frame, CloseHandler on_close) {
    move_to_ = to;
    move_frame_ = std::move(on_frame);
    move_close_ = std::move(on_close);
    moving_ = true;
  }

 private:
  friend class Poller;
  friend class Payload;
  // Poller side (its thread): false once the connection ended.
  bool on_readable(unsigned* frames);
  unsigned on_writable();
  bool dispatch_buffered(unsigned* frames);
  enum Read { kNothing, kDrained, kMore };  // read_more: nothing (EAGAIN, or the end), all there was, a full buffer
  Read read_more();
  void ask_delayed_acks();              // TCP_QUICKACK off, at most every kDelayedAcksEvery
  void finish(const std::string& why);  // fails what is pending, delivers the close handler
  void want_writable(bool on);          // under tx_mu_

  struct TxOp {
    std::string head;  // prefix + header
    const char* payload = nullptr;
    std::uint64_t length = 0;
    std::uint64_t sent = 0;  // of head + payload
    SendDone done;
    std::string owned;       // the payload, when own_payloads copied it
    std::size_t charge = 0;  // what it adds to reply_backlog_ (replies only)
  };
  std::size_t reply_backlog_ = 0;         // under tx_mu_: queued replies' bytes and kReplyOverhead each
  std::atomic<bool> read_paused_{false};  // set and cleared under tx_mu_
  void sync_events();  // tx_mu_ held: tells the poller what to wait for (EPOLLIN unless paused, EPOLLOUT)
  // Writes what it can of `op` (tx_mu_ held); false on an error (errno_ set).
  bool write_some(TxOp& op);
  void size_send_buffer(std::uint64_t frame);  // tx_mu_ held, as a frame starts

  const int fd_;
  const std::string name_;
  std::atomic<bool> closing_{false};
  std::string close_why_;  // under tx_mu_
  mutable std::mutex tx_mu_;
  std::deque<TxOp> txq_;
  std::size_t tx_bytes_ = 0;
  std::vector<std::pair<const void*, std::string>> riders_;  // under tx_mu_: (key, prefix + header)
  bool take_riders(TxOp& op);                                // tx_mu_ held: puts the waiting riders ahead of op's frame
  // Whether a write is under way or queued (want_out_), read without tx_mu_ by
  // Poller::progress's direct look: a recv on the socket waits in the kernel
  // for the socket's lock, which a large write holds (a spinning waiter beside
  // a thread sending 1 MiB frames on the same socket halved its rate).
  std::atomic<bool> tx_busy_{false};
  std::atomic<bool> queued_out_{false};  // want_out_, for the same readers
  struct Writing {                       // tx_busy_ while a send holds tx_mu_
    explicit Writing(Conn& c) : conn(c) { conn.tx_busy_.store(true, std::memory_order_release); }
    ~Writing() { conn.tx_busy_.store(conn.queued_out_.load(std::memory_order_acquire), std::memory_order_release); }
    Conn& conn;
  };
  bool want_out_ = false;
  bool small_sndbuf_ = false;  // under tx_mu_: the send buffer is kStreamSndbuf (a large frame is going)
  int errno_ = 0;

  Poller* poller_ = nullptr;  // set by Poller::add (under tx_mu_)
  FrameHandler on_frame_;
  CloseHandler on_close_;
  bool finished_ = false;
  bool moving_ = false;  // see move_to
  Poller* move_to_ = nullptr;
  FrameHandler move_frame_;
  CloseHandler move_close_;

  // Receive side (the poller's thread only).
  std::vector<char> rx_;
  std::size_t rx_begin_ = 0, rx_end_ = 0;
  std::chrono::steady_clock::time_point delayed_acks_at_{};  // when read_more last asked for them
  char* land_at_ = nullptr;                                  // a streamed payload being landed
  std::uint64_t land_left_ = 0;  // its bytes still to come (also a discard's, with land_at_ null)
  std::function<void(bool)> land_done_;
  std::shared_ptr<LandingGuard> land_guard_;  // the landing's, when its owner may call it off
  bool discarding_ = false;
  bool land_failed_ = false;  // called off: done(false) once the rest was read
};

class Poller {
 public:
  Poller();
  ~Poller();  // closes every connection still added (their close handlers run)
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  // An fd that polls readable when progress() has something to do.
  int fd() const { return epfd_; }
  // Adds a connection; frames and its close go to the handlers from now on.
  // Bytes it already holds (a connection moved from another poller) are dispatched at the next progress().
  void add(const std::shared_ptr<Conn>& conn, FrameHandler on_frame, CloseHandler on_close);
  // Takes a connection out (the poller's thread, e.g. from its frame
  // handler, to move it to another poller); no close handler runs.
  void remove(const std::shared_ptr<Conn>& conn);
  // A listening socket: each accepted connection goes to on_accept (the poller's thread).
  void listen(int fd, std::function<void(int fd)> on_accept);
  // Handles what is ready: waits up to timeout_ms (0: not at all, -1: until
  // something happens). Returns how many frames, completed sends and closes
  // it handled.
  unsigned progress(int timeout_ms);
  void wake();  // ends a progress() that waits
  bool empty() const { return count_.load(std::memory_order_relaxed) == 0; }

 private:
  friend class Conn;
  void update(Conn* conn, bool want_out, bool want_in);  // EPOLLOUT, EPOLLIN on or off
  void schedule(Conn* conn);                             // dispatch buffered bytes at the next progress
  int epfd_ = -1;
  int wake_fd_ = -1;
  int listen_fd_ = -1;
  std::function<void(int)> on_accept_;
  std::mutex mu_;
  std::unordered_map<Conn*, std::shared_ptr<Conn>> conns_;
  std::vector<std::shared_ptr<Conn>> ready_;  // to dispatch without an event (under mu_)
  std::atomic<std::size_t> count_{0};
  std::atomic<bool> has_ready_{false};
  std::atomic<bool> busy_{false};  // a thread is inside progress()
  bool listen_paused_ = false;     // out of descriptors: the listener is out of the poll until listen_paused_until_
  std::chrono::steady_clock::time_point listen_paused_until_{};
};

// Whether tcp connections size their send buffer per frame (Conn: a small
// one for frames over 2 MiB): only where net.core.wmem_max lets it go back to
// the kernel's own 4 MiB.
bool send_buffers_settable();

// "host:port" -> address (InvalidArgument when it does not resolve).
sockaddr_storage resolve(const std::string& host, std::uint16_t port, socklen_t* len);
std::pair<std::string, std::uint16_t> split_address(const std::string& address);
// TCP_NODELAY, and keepalive probes every keepalive_s when > 0.
void tune(int fd, double keepalive_s);

}  // namespace tensorwire::net
