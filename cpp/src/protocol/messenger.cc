// Copyright tensorwire authors.
//
// The tagged-message engine (tensorwire/messenger.h). One arena per rank,
// published and looked up by every peer, holds the inbox rings the peers
// write into, their sequence words, the credit words and this rank's own
// staging:
//
//   inbox     n senders x kSlots records of `slot` bytes (64 B header + payload)
//   flags     n senders x kSlots sequence words: record m of sender s lands in
//             slot m % kSlots, then its word becomes m (data, fence, flag)
//   acks      n words: receiver r writes how many of our records it consumed
//   staging   n peers x kSlots records: what we write into peer p's ring
//   flagsrc   n x kSlots words: the sources of our sequence words
//   acksrc    n words: the sources of our credit words
//
// Matching is the receiver's (MPI's rule, any source included): records of
// one sender are consumed in ring order, each arrival (an eager payload or a
// large message's RTS) is matched against the posted receives in posting
// order, and what matches nothing waits in the unexpected queue, which a
// receive looks at first. A large message is a receiver-driven rendezvous:
// RTS (size, the sender's op id), RTR (the receiver's buffer as an exported
// descriptor, offset, op ids), the sender's write straight into that buffer,
// then DONE (the flag outside the payload: after a fence, or after the
// write's completion where a completed write has landed: message-form lanes).
// Where each side's CPU does its own transfers (shared memory: UCX's cma
// copies in the calling process) the two share the copy: the RTS also offers
// the sender's buffer, the RTR says how much of it the sender writes, and the
// receiver reads the rest meanwhile, then tells the sender (FIN) that its
// buffer is free; the receive completes on DONE and its own read.
//
// Everything runs under one mutex. Whoever holds it progresses: a thread
// waiting on a request (its poller), a poster, or the progress thread, which
// sleeps in wait_any on the next sequence word of every peer meanwhile.
#include "tensorwire/messenger.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <ucm/api/ucm.h>

#include "core/channel_impl.h"
#include "core/request_state.h"
#include "tensorwire/error.h"
#include "tensorwire/wait.h"

namespace tensorwire {
namespace {

using Clock = std::chrono::steady_clock;
Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

constexpr std::size_t kSlots = 64;  // records in flight per direction and peer (a power of two)
constexpr std::size_t kHeader = 64;
constexpr std::size_t kMaxUnexpected = 16384;    // arrivals a peer may leave unmatched (then refused)
constexpr std::size_t kRegistrationsKept = 256;  // allocations registered for the placed path
constexpr double kCloseFlushS = 5.0;

enum Kind : std::int64_t { kEager = 1, kRts = 2, kRtr = 3, kDone = 4, kErr = 5, kBye = 6, kFin = 7 };

// Placed messages from this size up share their copy between the two sides
// (where each side's CPU moves its own part): half each, at a 4 KiB boundary.
constexpr std::size_t kShareFrom = std::size_t(256) << 10;

struct Header {
  std::int64_t kind = 0, tag = 0;
  std::int64_t id = 0;      // EAGER/RTS: the sender's op id; RTR: the receiver's; DONE: the receiver's
  std::int64_t nbytes = 0;  // the message's size
  std::int64_t offset = 0;  // RTS (offered)/RTR: where in the descriptor's region the buffer starts
  std::int64_t plen = 0;    // payload bytes after the header (RTS, RTR: a region descriptor)
  std::int64_t aux = 0;     // RTR/ERR/FIN: the sender's op id
  std::int64_t split = 0;   // RTR: the bytes the sender writes (0: all; the receiver reads the rest)
};
static_assert(sizeof(Header) == kHeader);

std::size_t page_up(std::size_t n) { return (n + 4095) / 4096 * 4096; }

struct Layout {
  Layout(int n, std::size_t eager) : slot(kHeader + (eager + 63) / 64 * 64) {
    std::size_t off = 0;
    auto take = [&](std::size_t bytes) {
      std::size_t start = off;
      off = page_up(off + bytes);
      return start;
    };
    ring = kSlots * slot;
    inbox = take(n * ring);
    flags = take(n * kSlots * 8);
    acks = take(n * 8);
    staging = take(n * ring);
    flagsrc = take(n * kSlots * 8);
    acksrc = take(n * 8);
    total = off;
  }
  std::size_t slot, ring, inbox, flags, acks, staging, flagsrc, acksrc, total;
};

struct Op {
  bool send = false;
  int peer = 0;  // a receive's source as posted (kAnySource)
  std::int64_t tag = 0;
  std::int64_t id = 0;
  Buffer buf;
  int* source_out = nullptr;
  detail::RequestState* state = nullptr;  // our reference
  bool done = false;                      // completed or failed (delivered to state outside the lock)
  Clock::time_point deadline;
  // the placed path
  Registration reg;
  Request write;  // a send's data write (a shared receive's read) in flight
  bool writing = false;
  bool records_left = false;  // a record of this op waits for credit
  bool rtr_wanted = false;    // a placed send waiting for its RTR
  bool offered = false;       // a placed send that offered its buffer for a shared copy
  bool fin_wanted = false;    // ... whose receiver reads part of it: complete on its FIN
  bool done_wanted = false;   // a placed receive waiting for the sender's DONE
  std::int64_t own_id = 0;    // a send's id as its RTS named it (FIN and ERR name it)

  Op() = default;
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  ~Op() {
    if (state) state->release();
  }

  std::string what(int me) const {
    return std::string(send ? "send" : "receive") + " of " + std::to_string(buf.nbytes) + " B " +
           (send ? "to rank " : "from ") + (peer == kAnySource && !send ? "any rank" : "rank " + std::to_string(peer)) +
           " (tag " + std::to_string(tag) + ") at rank " + std::to_string(me);
  }
};
using OpPtr = std::shared_ptr<Op>;

struct Arrival {  // a message that came before its receive
  int src = 0;
  std::int64_t kind = 0, tag = 0, id = 0, nbytes = 0, offset = 0;
  std::string payload;  // an eager message's bytes; an RTS's offered region descriptor
};

struct Outcome {  // a completion, delivered to its request once the engine's lock is released
  OpPtr op;
  bool ok = true;
  ErrorKind kind = ErrorKind::kGeneric;
  std::string why;
  int at_fault = -1;
};

struct Queued {  // a record waiting for credit
  Header h;
  std::string payload;
  OpPtr op;  // completes (its last record) once posted
};

struct PeerState {
  Channel ch;
  RemoteRegion arena;
  bool landed_on_completion = false;           // a completed write has landed (DONE after completion, no fence)
  bool shares_copies = false;                  // each side moves its own transfers (shared memory): split large copies
  std::uint64_t sent = 0, got = 0, acked = 0;  // records posted / consumed / credited back
  std::vector<Request> post_req = std::vector<Request>(kSlots);
  std::deque<Queued> outq;
  std::string failed;  // why (empty: alive)
  ErrorKind failed_kind = ErrorKind::kGeneric;
  std::map<const void*, RegionDescriptor> exported;  // registration -> descriptor exported to this peer
};

// Memory the process gives back to the kernel (munmap, a brk that shrinks,
// madvise DONTNEED) while the engine has a registration of it cached: UCX's
// memory hooks (libucm) report it, as they do for UCX's own registration
// cache. A later allocation at the same address is other memory (on RDMA a
// registration pins the old pages), so the engine drops what overlaps.
// The callback runs inside whichever thread unmaps, maybe under the engine's
// lock: it takes only its own spin lock and never allocates.
class UnmapWatch {
 public:
  UnmapWatch() { watching_ = ucm_set_event_handler(UCM_EVENT_VM_UNMAPPED, 0, &UnmapWatch::on_event, this) == UCS_OK; }
  ~UnmapWatch() {
    if (watching_) ucm_unset_event_handler(UCM_EVENT_VM_UNMAPPED, &UnmapWatch::on_event, this);
  }
  UnmapWatch(const UnmapWatch&) = delete;
  UnmapWatch& operator=(const UnmapWatch&) = delete;
  // Whether anything was unmapped since the last take; the ranges, or [0, max) after an overflow.
  bool take(std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& out) {
    if (!pending_.load(std::memory_order_acquire)) return false;
    lock();
    if (overflow_) {
      out.assign(1, {0, UINTPTR_MAX});
    } else {
      out.assign(ranges_, ranges_ + n_);
    }
    n_ = 0;
    overflow_ = false;
    pending_.store(false, std::memory_order_release);
    unlock();
    return true;
  }
  bool watching() const { return watching_; }

 private:
  static void on_event(ucm_event_type_t, ucm_event_t* event, void* arg) {
    auto* self = static_cast<UnmapWatch*>(arg);
    const auto lo = reinterpret_cast<std::uintptr_t>(event->vm_unmapped.address);
    self->lock();
    if (self->n_ < kRanges) {
      self->ranges_[self->n_++] = {lo, lo + event->vm_unmapped.size};
    } else {
      self->overflow_ = true;
    }
    self->pending_.store(true, std::memory_order_release);
    self->unlock();
  }
  void lock() {
    while (busy_.test_and_set(std::memory_order_acquire)) {
    }
  }
  void unlock() { busy_.clear(std::memory_order_release); }

  static constexpr std::size_t kRanges = 256;  // then every cached registration goes
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  std::atomic<bool> pending_{false};
  std::pair<std::uintptr_t, std::uintptr_t> ranges_[kRanges];
  std::size_t n_ = 0;
  bool overflow_ = false;
  bool watching_ = false;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  Engine(Device& device, int rank, int size, Rendezvous& rv, const MessengerConfig& cfg);
  ~Engine() { close(); }
  void start();
  Request isend(const Buffer& b, int peer, std::int64_t tag);
  Request irecv(const Buffer& b, int peer, std::int64_t tag, int* source);
  void close();
  void poll();  // progress if nobody else is
  bool shares_copies(int p) const { return p >= 0 && p < size && p != rank && peers_[p].shares_copies; }
  int rank, size;
  MessengerConfig cfg;
  MessengerStats stats{};

 private:
  void check_args(const Buffer& b, int peer, bool recv_any) const;
  Request handle(const OpPtr& op, const Channel* ch);
  void progress_locked();
  void consume(int p, std::uint64_t m);
  void arrive(int p, Arrival a);
  void match(const OpPtr& recv, Arrival& a);
  void post(int p, const Header& h, const void* payload, std::size_t plen, const OpPtr& op);
  void post_now(int p, const Header& h, const void* payload, std::size_t plen);
  void place(const OpPtr& send, const Header& rtr, const char* payload);
  void complete(const OpPtr& op);
  void fail(const OpPtr& op, ErrorKind kind, const std::string& why, int rank_at_fault = -1);
  // `died`: the peer failed rather than left (its BYE): a collective's ops fail with it too.
  void fail_peer(int p, ErrorKind kind, const std::string& why, bool died = true);
  const RegionDescriptor& export_to(int p, const Registration& reg);
  Registration registration_of(const Buffer& b);
  void background();
  bool busy_locked() const;
  // Hands the completions gathered under the lock to their requests: their
  // callbacks (a torch future's) may post again, so never under the lock.
  void deliver(std::unique_lock<std::mutex>& lock);
  struct DeliverAtExit {  // deliver() when a public call returns, also by an exception
    Engine* e;
    std::unique_lock<std::mutex>& l;
    ~DeliverAtExit() { e->deliver(l); }
  };
  std::vector<Outcome> outcomes_;

  Device& device_;
  Rendezvous& rv_;
  Layout lay_;
  Block arena_;
  LocalRegion local_;
  char* base_ = nullptr;
  std::vector<PeerState> peers_;
  std::mutex mu_;
  std::list<OpPtr> recvs_;                           // posted, unmatched receives in posting order
  std::unordered_map<std::int64_t, OpPtr> matched_;  // placed receives waiting for DONE, by id
  std::unordered_map<std::int64_t, OpPtr> sends_;    // placed sends waiting for RTR, by id
  std::unordered_map<std::int64_t, OpPtr> fins_;     // shared placed sends waiting for FIN, by own id
  std::list<OpPtr> writing_;                         // placed sends whose data write is in flight
  std::list<Arrival> unexpected_;
  std::list<OpPtr> deadlined_;  // every pending op, for its deadline
  struct Cached {               // a registered allocation, held alive while cached (no stale registration)
    void* base;
    std::size_t bytes;
    Registration reg;
    std::shared_ptr<const void> keep;
  };
  void drop_cached(std::list<Cached>::iterator it);
  void drop_unmapped();     // cached registrations of memory the process unmapped since
  std::list<Cached> regs_;  // least recently used last
  UnmapWatch unmaps_;
  std::int64_t next_id_ = 0;
  std::string group_failed_;  // the first peer failure: a collective's op posted later fails at once
  ErrorKind group_failed_kind_ = ErrorKind::kGeneric;
  int group_failed_rank_ = -1;
  bool closed_ = false;
  std::condition_variable wake_;            // ends the progress thread's nap (close)
  std::atomic<Clock::rep> user_polled_{0};  // when a waiting thread last polled
  std::thread thread_;
  std::string name_;
};

Engine::Engine(Device& device, int rank_, int size_, Rendezvous& rv, const MessengerConfig& cfg_)
    : rank(rank_),
      size(size_),
      cfg(cfg_),
      device_(device),
      rv_(rv),
      lay_(size_, cfg_.eager_bytes),
      peers_(size_),
      name_(cfg_.name) {
  if (size <= 0 || rank < 0 || rank >= size) {
    throw InvalidArgument("messenger: rank " + std::to_string(rank) + " of a group of " + std::to_string(size));
  }
  if (cfg.eager_bytes > (std::size_t(16) << 20)) throw InvalidArgument("messenger: eager_bytes above 16 MiB");
}

void Engine::start() {
  arena_ = device_.allocate(lay_.total, 4096);
  local_ = arena_.region();
  base_ = static_cast<char*>(arena_.data());
  std::memset(base_ + lay_.flags, 0, lay_.staging - lay_.flags);
  std::memset(base_ + lay_.flagsrc, 0, lay_.total - lay_.flagsrc);
  const double t = std::min(cfg.timeout_s, 600.0);
  if (size > 1) {
    device_.publish(name_ + ".arena", arena_.descriptor());
    rv_.set(name_ + "/addr/" + std::to_string(rank), device_.address() + " " + std::to_string(device_.id()));
    std::vector<std::string> addr(size);
    std::vector<std::uint64_t> ids(size);
    for (int p = 0; p < size; ++p) {
      std::string v = rv_.get(name_ + "/addr/" + std::to_string(p), t);
      auto sp = v.find(' ');
      if (sp == std::string::npos)
        throw ProtocolMismatch("messenger: rank " + std::to_string(p) + " published '" + v + "'");
      addr[p] = v.substr(0, sp);
      ids[p] = std::stoull(v.substr(sp + 1));
    }
    // One connection per pair: the lower rank connects, the higher takes the channel back.
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      if (p > rank) {
        peers_[p].ch = device_.connect(addr[p]);
      } else {
        auto deadline = after(t);
        for (;;) {
          try {
            peers_[p].ch = device_.channel_to(ids[p]);
            break;
          } catch (const Error&) {
            if (Clock::now() >= deadline) {
              throw Timeout("messenger: rank " + std::to_string(p) + " did not connect to rank " +
                            std::to_string(rank) + " within " + std::to_string(t) + " s");
            }
            try {
              device_.wait_for_peer(0.05);
            } catch (const Error&) {
            }
          }
        }
      }
      peers_[p].arena = peers_[p].ch.lookup(name_ + ".arena", t);
      const detail::Lane& lane = peers_[p].ch.impl()->lane();
      peers_[p].landed_on_completion = lane.write_landed_on_completion();
      peers_[p].shares_copies = !lane.rma_is_messages() && !lane.needs_target_progress();
    }
    // Every rank has looked up every arena before any may leave (a lookup of a closed device fails).
    rv_.set(name_ + "/ready/" + std::to_string(rank), "1");
    for (int p = 0; p < size; ++p) rv_.get(name_ + "/ready/" + std::to_string(p), t);
  }
  if (cfg.progress_thread && size > 1) thread_ = std::thread([self = shared_from_this()] { self->background(); });
}

void Engine::check_args(const Buffer& b, int peer, bool recv) const {
  if (closed_) throw ConnectionError("messenger: closed");
  if (!(peer >= 0 && peer < size && peer != rank) && !(recv && peer == kAnySource)) {
    throw InvalidArgument("messenger: peer must be another rank in 0.." + std::to_string(size - 1) +
                          (recv ? " or any source" : "") + ", got " + std::to_string(peer) + " at rank " +
                          std::to_string(rank));
  }
  if (b.nbytes && !b.data)
    throw InvalidArgument("messenger: a buffer of " + std::to_string(b.nbytes) + " B at address 0");
  if (b.base && (static_cast<char*>(b.data) < static_cast<char*>(b.base) ||
                 static_cast<char*>(b.data) + b.nbytes > static_cast<char*>(b.base) + b.base_bytes)) {
    throw InvalidArgument("messenger: the buffer lies outside the allocation named as its base");
  }
}

Request Engine::handle(const OpPtr& op, const Channel* ch) {
  auto worker = ch && ch->impl() ? ch->impl()->worker : nullptr;
  auto* state = new detail::RequestState(worker, 2);  // the Request and the op
  op->state = state;
  op->deadline = after(std::min(cfg.timeout_s, 1e7));
  std::weak_ptr<Engine> weak = weak_from_this();
  state->poller = [weak, state]() {
    if (state->finished()) return true;
    if (auto self = weak.lock()) self->poll();
    return state->finished();
  };
  state->inbound = !op->send;
  return Request(state);
}

Request Engine::isend(const Buffer& b, int peer, std::int64_t tag) {
  std::unique_lock<std::mutex> lock(mu_);
  DeliverAtExit deliver_at_exit{this, lock};
  check_args(b, peer, false);
  PeerState& ps = peers_[peer];
  if (!ps.failed.empty()) throw_error(ps.failed_kind, ps.failed);
  if (tag < 0 && !group_failed_.empty()) throw_error(group_failed_kind_, group_failed_);
  auto op = std::make_shared<Op>();
  op->send = true;
  op->peer = peer;
  op->tag = tag;
  op->buf = b;
  op->id = ++next_id_;
  Header h;
  h.tag = tag;
  h.id = op->id;
  h.nbytes = static_cast<std::int64_t>(b.nbytes);
  if (b.nbytes <= cfg.eager_bytes) {
    ++stats.eager_sends;
    h.kind = kEager;
    if (ps.outq.empty() && ps.sent + 1 - ps.acked <= kSlots) {
      post_now(peer, h, b.data, b.nbytes);  // copied into staging: done
      if (!ps.failed.empty()) throw_error(ps.failed_kind, ps.failed);
      progress_locked();
      return Request();
    }
    Request r = handle(op, &ps.ch);
    deadlined_.push_back(op);
    post(peer, h, b.data, b.nbytes, op);
    return r;
  }
  ++stats.placed_sends;
  op->reg = registration_of(b);
  op->own_id = op->id;
  std::string offer;  // our buffer, for the receiver to read its part of
  if (ps.shares_copies && b.nbytes >= kShareFrom) {
    try {
      const RegionDescriptor& d = export_to(peer, op->reg);
      offer = d.to_bytes();
      h.offset = static_cast<std::int64_t>(static_cast<char*>(b.data) - reinterpret_cast<char*>(d.address));
      op->offered = true;
    } catch (const Error& e) {  // the control call to the peer failed: if the peer did, say which rank
      if (!(ps.ch.impl() && ps.ch.impl()->failed())) throw;
      fail_peer(peer, ErrorKind::kPeerFailed, "rank " + std::to_string(peer) + " failed: " + e.what());
      throw_error(ps.failed_kind, ps.failed);
    }
  }
  Request r = handle(op, &ps.ch);
  h.kind = kRts;
  op->rtr_wanted = true;
  sends_[op->id] = op;
  deadlined_.push_back(op);
  post(peer, h, offer.data(), offer.size(), nullptr);
  progress_locked();
  return r;
}

Request Engine::irecv(const Buffer& b, int peer, std::int64_t tag, int* source) {
  std::unique_lock<std::mutex> lock(mu_);
  DeliverAtExit deliver_at_exit{this, lock};
  check_args(b, peer, true);
  auto op = std::make_shared<Op>();
  op->peer = peer;
  op->tag = tag;
  op->buf = b;
  op->source_out = source;
  op->id = ++next_id_;
  const Channel* ch = peer != kAnySource ? &peers_[peer].ch : nullptr;
  if (!ch) {
    for (auto& ps : peers_) {
      if (ps.ch.impl()) {
        ch = &ps.ch;
        break;
      }
    }
  }
  Request r = handle(op, ch);
  deadlined_.push_back(op);
  progress_locked();  // what arrived meanwhile goes to the unexpected queue first (MPI order)
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    if ((peer == kAnySource || it->src == peer) && it->tag == tag) {
      Arrival a = std::move(*it);
      unexpected_.erase(it);
      match(op, a);
      return r;
    }
  }
  if (peer != kAnySource && !peers_[peer].failed.empty()) {
    fail(op, peers_[peer].failed_kind, peers_[peer].failed, peer);
  } else if (tag < 0 && !group_failed_.empty()) {
    fail(op, group_failed_kind_, group_failed_, group_failed_rank_);
  } else if (peer == kAnySource) {
    bool alive = false;
    for (int p = 0; p < size; ++p) alive |= p != rank && peers_[p].failed.empty();
    if (!alive) fail(op, ErrorKind::kPeerFailed, "messenger: every peer failed; " + op->what(rank));
  }
  if (!op->done) recvs_.push_back(op);
  return r;
}

// ---- records ----------------------------------------------------------------

void Engine::post(int p, const Header& h, const void* payload, std::size_t plen, const OpPtr& op) {
  PeerState& ps = peers_[p];
  if (ps.outq.empty() && ps.sent + 1 - ps.acked <= kSlots) {
    post_now(p, h, payload, plen);
    return;
  }
  Queued q;
  q.h = h;
  q.payload.assign(static_cast<const char*>(payload), plen);
  q.op = op;
  if (op) op->records_left = true;
  ps.outq.push_back(std::move(q));
}

void Engine::post_now(int p, const Header& h0, const void* payload, std::size_t plen) {
  PeerState& ps = peers_[p];
  const std::uint64_t m = ++ps.sent;
  const std::size_t j = m % kSlots;
  Request& prev = ps.post_req[j];
  if (prev.state() == 0) prev.wait(cfg.timeout_s);  // long done in practice: the record was consumed
  const std::size_t staging = lay_.staging + (p * kSlots + j) * lay_.slot;
  const std::size_t flagsrc = lay_.flagsrc + (p * kSlots + j) * 8;
  Header h = h0;
  h.plen = static_cast<std::int64_t>(plen);
  std::memcpy(base_ + staging, &h, kHeader);
  if (plen) std::memcpy(base_ + staging + kHeader, payload, plen);
  std::memcpy(base_ + flagsrc, &m, 8);
  const std::size_t inbox = lay_.inbox + (rank * kSlots + j) * lay_.slot;
  const std::size_t flag = lay_.flags + (rank * kSlots + j) * 8;
  try {  // unanswered on a tcp lane: the reader's credits say the slot was read
    ps.post_req[j] = ps.ch.write_flagged(local_, staging, ps.arena, inbox, kHeader + plen, flagsrc, flag, false);
  } catch (const Error& e) {  // the channel failed: so did the peer, for every op with it
    fail_peer(p, ErrorKind::kPeerFailed, "rank " + std::to_string(p) + " cannot be written to: " + e.what());
  }
}

// ---- progress -----------------------------------------------------------------

void Engine::poll() {
  user_polled_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  if (!closed_) progress_locked();
  deliver(lock);
}

void Engine::deliver(std::unique_lock<std::mutex>& lock) {
  if (outcomes_.empty()) return;
  std::vector<Outcome> out;
  out.swap(outcomes_);
  lock.unlock();
  for (Outcome& o : out) {
    detail::RequestState* st = o.op->state;
    if (o.ok) {
      st->complete_ok();
    } else {
      st->failed_rank = o.at_fault;
      st->complete_error(o.kind, o.why);
    }
  }
  out.clear();  // (ops may go with the last reference: outside the lock too)
  lock.lock();
}

void Engine::progress_locked() {
  auto* words = reinterpret_cast<std::uint64_t*>(base_ + lay_.flags);
  auto* acks = reinterpret_cast<std::uint64_t*>(base_ + lay_.acks);
  for (int p = 0; p < size; ++p) {
    PeerState& ps = peers_[p];
    if (p == rank || !ps.failed.empty()) continue;
    // (read before the ring: what a peer wrote before it went is consumed first, and then it fails)
    const bool dead = ps.ch.impl() && ps.ch.impl()->failed();
    for (;;) {
      const std::uint64_t next = ps.got + 1;
      if (__atomic_load_n(&words[p * kSlots + next % kSlots], __ATOMIC_ACQUIRE) != next) break;
      consume(p, next);
      if (!ps.failed.empty()) break;
      // Credit back, once the record is read whole (its slot may be written again at once).
      if (next % (kSlots / 2) == 0) {
        const std::size_t src = lay_.acksrc + p * 8;
        std::memcpy(base_ + src, &next, 8);
        try {
          ps.ch.write(local_, src, ps.arena, lay_.acks + rank * 8, 8);
        } catch (const Error&) {
          // a sender that is gone needs no credit; what it sent before it went is still read
        }
      }
    }
    if (!ps.failed.empty()) continue;
    ps.acked = std::max(ps.acked, __atomic_load_n(&acks[p], __ATOMIC_ACQUIRE));
    while (!ps.outq.empty() && ps.sent + 1 - ps.acked <= kSlots) {
      Queued q = std::move(ps.outq.front());
      ps.outq.pop_front();
      post_now(p, q.h, q.payload.data(), q.payload.size());
      if (q.op) {
        q.op->records_left = false;
        if (ps.failed.empty()) {
          complete(q.op);
        } else {
          fail(q.op, ps.failed_kind, ps.failed, p);
        }
      }
    }
    if (dead) {
      try {
        ps.ch.impl()->check_usable();
      } catch (const Error& e) {
        fail_peer(p, ErrorKind::kPeerFailed, std::string("rank ") + std::to_string(p) + " failed: " + e.what());
      }
    }
  }
  for (auto it = writing_.begin(); it != writing_.end();) {
    const OpPtr& op = *it;
    const int st = op->write.state();
    if (st == 0) {
      ++it;
      continue;
    }
    op->writing = false;
    if (!op->send) {  // a shared receive's read of its part: the sender's buffer is free now
      Header h;
      h.kind = st < 0 ? kErr : kFin;
      h.tag = op->tag;
      h.aux = op->own_id;
      post(op->peer, h, nullptr, 0, nullptr);
      if (st < 0) {
        fail(op, op->write.error_kind(),
             "messenger: the read of a " + op->what(rank) + " failed: " + op->write.error_message(), op->peer);
      } else {
        complete(op);
      }
    } else if (st < 0) {
      fail(op, op->write.error_kind(),
           "messenger: the data write of a " + op->what(rank) + " failed: " + op->write.error_message(), op->peer);
    } else if (peers_[op->peer].landed_on_completion) {
      Header h;
      h.kind = kDone;
      h.tag = op->tag;
      h.id = op->id;  // (the receiver's id, set by place)
      post(op->peer, h, nullptr, 0, op);
      if (!op->records_left) complete(op);
    } else if (!op->records_left) {
      complete(op);
    }
    it = writing_.erase(it);
  }
  if (!deadlined_.empty()) {
    const auto now = Clock::now();
    for (auto it = deadlined_.begin(); it != deadlined_.end();) {
      if ((*it)->done) {
        it = deadlined_.erase(it);
      } else if (now >= (*it)->deadline) {
        OpPtr op = *it;
        it = deadlined_.erase(it);
        recvs_.remove(op);  // never matched: nothing will write into it
        fail(op, ErrorKind::kTimeout,
             "messenger: " + op->what(rank) + " did not complete within " + std::to_string(cfg.timeout_s) + " s",
             op->peer);
      } else {
        ++it;
      }
    }
  }
}

void Engine::consume(int p, std::uint64_t m) {
  PeerState& ps = peers_[p];
  const char* slot = base_ + lay_.inbox + (p * kSlots + m % kSlots) * lay_.slot;
  Header h;
  std::memcpy(&h, slot, kHeader);
  ps.got = m;
  // The peer wrote every field: check them before any is used (contracts §11).
  const std::size_t room = lay_.slot - kHeader;
  if (h.kind < kEager || h.kind > kFin || h.nbytes < 0 || h.plen < 0 || std::size_t(h.plen) > room ||
      (h.kind == kEager && h.plen != h.nbytes) || (h.kind != kEager && h.kind != kRtr && h.kind != kRts && h.plen)) {
    fail_peer(p, ErrorKind::kProtocolMismatch,
              "rank " + std::to_string(p) + " sent a malformed record (kind " + std::to_string(h.kind) + ", " +
                  std::to_string(h.nbytes) + " B, payload " + std::to_string(h.plen) + " B); its messages are refused");
    return;
  }
  switch (h.kind) {
    case kEager:
    case kRts: {
      Arrival a;
      a.src = p;
      a.kind = h.kind;
      a.tag = h.tag;
      a.id = h.id;
      a.nbytes = h.nbytes;
      a.offset = h.offset;
      if (h.kind == kRts) a.payload.assign(slot + kHeader, h.plen);  // an offer, if any
      for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
        const OpPtr& op = *it;
        if ((op->peer == kAnySource || op->peer == p) && op->tag == h.tag) {
          OpPtr r = op;
          recvs_.erase(it);
          if (h.kind == kEager && std::size_t(h.nbytes) == r->buf.nbytes) {  // the common case: no copy out
            if (h.nbytes) std::memcpy(r->buf.data, slot + kHeader, h.nbytes);
            if (r->source_out) *r->source_out = p;
            complete(r);
            return;
          }
          if (h.kind == kEager) a.payload.assign(slot + kHeader, h.plen);
          match(r, a);
          return;
        }
      }
      if (unexpected_.size() >= kMaxUnexpected) {
        fail_peer(p, ErrorKind::kProtocolMismatch,
                  "rank " + std::to_string(p) + " sent more than " + std::to_string(kMaxUnexpected) +
                      " messages nobody receives");
        return;
      }
      if (h.kind == kEager) a.payload.assign(slot + kHeader, h.plen);
      ++stats.unexpected;
      unexpected_.push_back(std::move(a));
      return;
    }
    case kRtr:
    case kDone: {  // names one of our ops that this very peer was given, or the peer lies
      auto& table = h.kind == kRtr ? sends_ : matched_;
      auto it = table.find(h.kind == kRtr ? h.aux : h.id);
      if (it == table.end() || it->second->peer != p) {
        fail_peer(p, ErrorKind::kProtocolMismatch,
                  "rank " + std::to_string(p) + " named an operation it was not given");
        return;
      }
      OpPtr op = it->second;
      table.erase(it);
      if (h.kind == kDone) {
        op->done_wanted = false;
        complete(op);
      } else if (!op->done) {
        place(op, h, slot + kHeader);  // (a send that timed out writes nothing)
      }
      return;
    }
    case kFin: {  // the receiver read its part of our buffer: the send may complete
      auto it = fins_.find(h.aux);
      if (it == fins_.end() || it->second->peer != p) {
        fail_peer(p, ErrorKind::kProtocolMismatch,
                  "rank " + std::to_string(p) + " named an operation it was not given");
        return;
      }
      OpPtr op = it->second;
      fins_.erase(it);
      op->fin_wanted = false;
      complete(op);
      return;
    }
    case kBye:  // the peer closed its end: what it sent before is read; nothing more comes
      fail_peer(p, ErrorKind::kConnection, "rank " + std::to_string(p) + " left the group (closed)", false);
      return;
    case kErr: {
      auto fin = fins_.find(h.aux);  // a shared send: the receiver could not read its part
      if (fin != fins_.end() && fin->second->peer == p) {
        OpPtr op = fin->second;
        fins_.erase(fin);
        fail(op, ErrorKind::kConnection,
             "messenger: rank " + std::to_string(p) + " could not read its part of a " + op->what(rank));
        return;
      }
      auto it = sends_.find(h.aux);
      if (it != sends_.end() && it->second->peer == p) {
        OpPtr op = it->second;
        sends_.erase(it);
        fail(op, ErrorKind::kInvalidArgument,
             "messenger: rank " + std::to_string(rank) + " sends " + std::to_string(op->buf.nbytes) + " B (tag " +
                 std::to_string(op->tag) + ") but rank " + std::to_string(p) + " receives into " +
                 std::to_string(h.nbytes) + " B: send and receive sizes must match");
      }
      return;
    }
  }
}

// A receive meets its message (an arrival read out of the ring or the unexpected queue).
void Engine::match(const OpPtr& r, Arrival& a) {
  r->peer = a.src;  // an any-source receive now waits on this sender alone
  if (r->source_out) *r->source_out = a.src;
  if (std::size_t(a.nbytes) != r->buf.nbytes) {
    const std::string why = "messenger: rank " + std::to_string(a.src) + " sends " + std::to_string(a.nbytes) +
                            " B (tag " + std::to_string(a.tag) + ") but rank " + std::to_string(rank) +
                            " receives into " + std::to_string(r->buf.nbytes) + " B: send and receive sizes must match";
    if (a.kind == kRts) {
      Header e;
      e.kind = kErr;
      e.tag = a.tag;
      e.aux = a.id;
      e.nbytes = static_cast<std::int64_t>(r->buf.nbytes);
      post(a.src, e, nullptr, 0, nullptr);
    }
    fail(r, ErrorKind::kInvalidArgument, why);
    return;
  }
  if (a.kind == kEager) {
    if (a.nbytes) std::memcpy(r->buf.data, a.payload.data(), a.nbytes);
    complete(r);
    return;
  }
  PeerState& ps = peers_[a.src];
  std::size_t split = 0;  // the bytes the sender writes (0: all)
  if (!a.payload.empty() && ps.shares_copies) split = std::size_t(a.nbytes) / 2 / 4096 * 4096;
  try {  // placed: register our buffer, export it to the sender (once per allocation), RTR
    r->reg = registration_of(r->buf);
    const RegionDescriptor& d = export_to(a.src, r->reg);
    std::string bytes = d.to_bytes();
    Header h;
    h.kind = kRtr;
    h.tag = a.tag;
    h.id = r->id;
    h.aux = a.id;
    h.nbytes = a.nbytes;
    h.offset = static_cast<std::int64_t>(static_cast<char*>(r->buf.data) - reinterpret_cast<char*>(d.address));
    h.split = static_cast<std::int64_t>(split);
    r->done_wanted = true;
    r->own_id = a.id;  // (the sender's: our FIN names it)
    matched_[r->id] = r;
    post(a.src, h, bytes.data(), bytes.size(), nullptr);
  } catch (const Error& e) {
    if (ps.ch.impl() && ps.ch.impl()->failed()) {  // the peer failed: name it
      fail_peer(a.src, ErrorKind::kPeerFailed, "rank " + std::to_string(a.src) + " failed: " + e.what());
      fail(r, ps.failed_kind, ps.failed, a.src);
    } else {
      fail(r, e.kind(), std::string("messenger: cannot receive into this buffer: ") + e.what());
    }
    return;
  }
  if (!split) return;
  try {  // our part, [split, n), read from the sender's buffer while it writes the rest
    RemoteRegion remote = ps.ch.remote_region(RegionDescriptor::from_bytes(a.payload.data(), a.payload.size()));
    if (a.offset < 0) throw InvalidArgument("a negative offset");
    LocalRegion dst = r->reg.region();
    const std::size_t off = static_cast<char*>(r->buf.data) - static_cast<char*>(dst.address);
    r->write = ps.ch.read(dst, off + split, remote, std::size_t(a.offset) + split, r->buf.nbytes - split);
    r->writing = true;
    ++stats.shared_receives;
    writing_.push_back(r);
  } catch (const Error& e) {  // the offer was the peer's: the core checked it against its exports
    const bool gone = ps.ch.impl() && ps.ch.impl()->failed();
    fail_peer(a.src, gone ? ErrorKind::kPeerFailed : ErrorKind::kProtocolMismatch,
              gone ? "rank " + std::to_string(a.src) + " failed: " + e.what()
                   : "rank " + std::to_string(a.src) + " offered a buffer this rank cannot read (" + e.what() + ")");
    fail(r, ps.failed_kind, ps.failed, a.src);
  }
}

// The receiver's RTR for our placed send: write the data straight into its buffer.
void Engine::place(const OpPtr& op, const Header& rtr, const char* payload) {
  const int p = op->peer;
  PeerState& ps = peers_[p];
  op->rtr_wanted = false;
  if (std::size_t(rtr.nbytes) != op->buf.nbytes) {
    fail(op, ErrorKind::kInvalidArgument,
         "messenger: rank " + std::to_string(p) + " receives " + std::to_string(rtr.nbytes) + " B for a " +
             op->what(rank));
    return;
  }
  // A split only of a buffer we offered, inside it: the receiver reads the rest.
  if (rtr.split < 0 || std::size_t(rtr.split) >= op->buf.nbytes || (rtr.split && !op->offered)) {
    fail_peer(p, ErrorKind::kProtocolMismatch,
              "rank " + std::to_string(p) + " asked for a write of " + std::to_string(rtr.split) + " B of a " +
                  op->what(rank));
    fail(op, ps.failed_kind, ps.failed, p);
    return;
  }
  const std::size_t length = rtr.split ? std::size_t(rtr.split) : op->buf.nbytes;
  try {  // the descriptor and offset are the peer's: the core checks them against its exports
    RemoteRegion remote = ps.ch.remote_region(RegionDescriptor::from_bytes(payload, rtr.plen));
    if (rtr.offset < 0) throw InvalidArgument("a negative offset");
    LocalRegion src = op->reg.region();
    const std::size_t off = static_cast<char*>(op->buf.data) - static_cast<char*>(src.address);
    op->write = ps.ch.write(src, off, remote, rtr.offset, length);
    op->writing = true;
  } catch (const Error& e) {
    const bool gone = ps.ch.impl() && ps.ch.impl()->failed();
    fail_peer(p, gone ? ErrorKind::kPeerFailed : ErrorKind::kProtocolMismatch,
              gone ? "rank " + std::to_string(p) + " failed: " + e.what()
                   : "rank " + std::to_string(p) + " sent a ready-to-receive record this rank cannot write to (" +
                         e.what() + ")");
    fail(op, ps.failed_kind, ps.failed, p);
    return;
  }
  op->id = rtr.id;  // from now on: the receiver's id (DONE names it)
  if (rtr.split) {
    op->fin_wanted = true;
    fins_[op->own_id] = op;
  }
  if (!ps.landed_on_completion) {  // data, fence, DONE: the flag outside the payload
    try {
      ps.ch.fence();
    } catch (const Error& e) {
      fail_peer(p, ErrorKind::kPeerFailed, std::string("rank ") + std::to_string(p) + " failed: " + e.what());
      fail(op, ps.failed_kind, ps.failed, p);
      return;
    }
    Header h;
    h.kind = kDone;
    h.tag = op->tag;
    h.id = rtr.id;
    post(p, h, nullptr, 0, op);
  }
  writing_.push_back(op);
}

Registration Engine::registration_of(const Buffer& b) {
  // Without UCX's memory events (UCX_MEM_EVENTS=no) no registration is kept past its message.
  if (!unmaps_.watching()) {
    while (!regs_.empty()) drop_cached(regs_.begin());
  }
  drop_unmapped();
  void* base = b.base ? b.base : b.data;
  std::size_t bytes = b.base ? b.base_bytes : b.nbytes;
  for (auto it = regs_.begin(); it != regs_.end(); ++it) {
    if (it->base == base && it->bytes == bytes) {
      regs_.splice(regs_.begin(), regs_, it);
      if (b.keep) it->keep = b.keep;
      return it->reg;
    }
  }
  Registration reg = device_.pool().register_memory(base, bytes);
  regs_.push_front(Cached{base, bytes, reg, b.keep});
  if (regs_.size() > kRegistrationsKept) drop_cached(std::prev(regs_.end()));
  return reg;
}

void Engine::drop_unmapped() {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> gone;
  if (!unmaps_.take(gone)) return;
  for (auto it = regs_.begin(); it != regs_.end();) {
    const auto lo = reinterpret_cast<std::uintptr_t>(it->base), hi = lo + it->bytes;
    const bool hit =
        std::any_of(gone.begin(), gone.end(), [&](const auto& g) { return g.first < hi && lo < g.second; });
    if (hit) {
      ++stats.stale_registrations;
      drop_cached(it++);
    } else {
      ++it;
    }
  }
}

void Engine::drop_cached(std::list<Cached>::iterator it) {
  const void* gone = it->reg.region().owner.get();
  for (auto& ps : peers_) ps.exported.erase(gone);
  regs_.erase(it);
}

const RegionDescriptor& Engine::export_to(int p, const Registration& reg) {
  const void* key = reg.region().owner.get();
  auto it = peers_[p].exported.find(key);
  if (it != peers_[p].exported.end()) return it->second;
  return peers_[p].exported[key] = peers_[p].ch.export_region(reg.region(), std::min(cfg.timeout_s, 60.0));
}

void Engine::complete(const OpPtr& op) {
  if (op->done || op->records_left || op->writing || op->fin_wanted || op->done_wanted) return;
  op->done = true;
  if (op->state) outcomes_.push_back(Outcome{op, true, ErrorKind::kGeneric, {}, -1});
}

void Engine::fail(const OpPtr& op, ErrorKind kind, const std::string& why, int at_fault) {
  if (op->done) return;
  op->done = true;
  if (op->state) outcomes_.push_back(Outcome{op, false, kind, why, at_fault});
}

void Engine::fail_peer(int p, ErrorKind kind, const std::string& why0, bool died) {
  PeerState& ps = peers_[p];
  if (!ps.failed.empty()) return;
  const std::string why = "messenger: at rank " + std::to_string(rank) + ": " + why0;
  ps.failed = why;
  ps.failed_kind = kind;
  ps.outq.clear();
  // A collective's messages (negative tags) fail with any rank of the group: the call cannot
  // finish without it, and a rank waiting on a healthy but stuck neighbour would otherwise wait
  // out its deadline instead of naming the rank that failed.
  auto hit = [&](const OpPtr& op) { return op->peer == p || (died && op->tag < 0); };
  for (auto& op : recvs_) {
    if (hit(op)) fail(op, kind, why, p);
  }
  recvs_.remove_if(hit);
  for (auto* table : {&matched_, &sends_, &fins_}) {
    for (auto it = table->begin(); it != table->end();) {
      if (hit(it->second)) {
        fail(it->second, kind, why, p);
        it = table->erase(it);
      } else {
        ++it;
      }
    }
  }
  // After a BYE (the peer closed; it did not die) a send whose records all went and that its
  // receiver has nothing more to answer waits only for its own write's local completion: the
  // receiver had its bytes (its FIN, or a DONE behind a fence) before it said goodbye. Where a
  // DONE goes before the write completes (a fence orders it), that BYE can come first; the send
  // then completes or fails with its write, not with the goodbye.
  auto write_only = [&](const OpPtr& op) {
    return !died && op->send && !op->records_left && !op->fin_wanted && !op->done_wanted;
  };
  auto hit_writing = [&](const OpPtr& op) { return hit(op) && !write_only(op); };
  for (auto& op : writing_) {
    if (hit_writing(op)) fail(op, kind, why, p);
  }
  writing_.remove_if(hit_writing);
  if (died) {
    for (auto& op : deadlined_) {  // (queued eager sends of a collective)
      if (op->tag < 0) fail(op, kind, why, p);
    }
    if (group_failed_.empty()) {
      group_failed_ = why;
      group_failed_kind_ = kind;
      group_failed_rank_ = p;
    }
  }
  // (an eager message that arrived whole stays receivable; a rendezvous cannot finish)
  unexpected_.remove_if([&](const Arrival& a) { return a.src == p && a.kind != kEager; });
  // an any-source receive fails only when no live peer is left to send it
  bool alive = false;
  for (int q = 0; q < size; ++q) alive |= q != rank && peers_[q].failed.empty();
  if (!alive) {
    for (auto& op : recvs_) fail(op, kind, why, p);
    recvs_.clear();
  }
}

bool Engine::busy_locked() const {
  if (!recvs_.empty() || !matched_.empty() || !sends_.empty() || !fins_.empty() || !writing_.empty()) return true;
  for (const auto& ps : peers_) {
    if (!ps.outq.empty()) return true;
  }
  return false;
}

// The progress thread: moves posted messages while nobody waits. It never
// drives a worker (the Device's progress threads do that) and never spins:
// it reads the rings every kBusyNap while something is pending, every
// kIdleNap otherwise, and stays out while a waiting thread polls (that thread
// progresses itself, with no wake-up on its latency path).
void Engine::background() {
  using std::chrono::microseconds;
  constexpr microseconds kBusyNap{50}, kIdleNap{2000}, kUserPolled{300};
  std::unique_lock<std::mutex> lock(mu_);
  while (!closed_) {
    const auto polled = Clock::time_point(Clock::duration(user_polled_.load(std::memory_order_relaxed)));
    if (Clock::now() - polled > kUserPolled) {
      try {
        progress_locked();
      } catch (const std::exception& e) {  // never: every peer's error fails that peer's ops
        fprintf(stderr, "tensorwire messenger: rank %d: progress failed: %s\n", rank, e.what());
      }
      deliver(lock);
      if (closed_) break;
    }
    wake_.wait_for(lock, busy_locked() ? kBusyNap : kIdleNap);
  }
}

void Engine::close() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    // Records posted but not landed yet (tcp: in a socket; a large one UCX still copies) are
    // lost if the device closes under them: their requests, then an answered write after them.
    const auto deadline = after(kCloseFlushS);
    auto left = [&] { return std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count()); };
    for (int p = 0; p < size; ++p) {
      PeerState& ps = peers_[p];
      // (every live peer hears BYE, also one we never sent to: it must not take our going for a death)
      if (p == rank || !ps.failed.empty() || !ps.ch.impl()) continue;
      try {
        if (ps.outq.empty() && ps.sent + 1 - ps.acked <= kSlots) {  // goodbye: we left, we did not fail
          Header bye;
          bye.kind = kBye;
          post_now(p, bye, nullptr, 0);
        }
        for (Request& r : ps.post_req) {
          if (r.state() == 0) r.wait(left());
        }
        // an answered write behind them (our credit word again; the peer keeps the largest)
        ps.ch.write(local_, lay_.acksrc + p * 8, ps.arena, lay_.acks + rank * 8, 8).wait(left());
      } catch (const Error&) {
      }
    }
    closed_ = true;
    const std::string why = "messenger: closed at rank " + std::to_string(rank);
    auto fail_all = [&](const OpPtr& op) { fail(op, ErrorKind::kConnection, why); };
    for (auto& op : recvs_) fail_all(op);
    for (auto& kv : matched_) fail_all(kv.second);
    for (auto& kv : sends_) fail_all(kv.second);
    for (auto& kv : fins_) fail_all(kv.second);
    for (auto& op : writing_) fail_all(op);
    for (auto& op : deadlined_) fail_all(op);
    for (auto& ps : peers_) {
      for (auto& q : ps.outq) {
        if (q.op) fail_all(q.op);
      }
      ps.outq.clear();
    }
    recvs_.clear();
    matched_.clear();
    sends_.clear();
    fins_.clear();
    writing_.clear();
    deadlined_.clear();
    unexpected_.clear();
    deliver(lock);
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    if (thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    } else {
      thread_.detach();  // (the thread held the last reference)
    }
  }
  if (size > 1) {
    try {
      device_.unpublish(name_ + ".arena");
    } catch (const Error&) {
    }
  }
}

// The public face: owns the engine, which requests reach through weak references.
class MessengerImpl : public Messenger {
 public:
  explicit MessengerImpl(std::shared_ptr<Engine> e) : e_(std::move(e)) {}
  ~MessengerImpl() override { close(); }
  int rank() const override { return e_->rank; }
  int size() const override { return e_->size; }
  Request isend(const Buffer& b, int peer, std::int64_t tag) override { return e_->isend(b, peer, tag); }
  Request irecv(const Buffer& b, int peer, std::int64_t tag, int* source) override {
    return e_->irecv(b, peer, tag, source);
  }
  double timeout() const override { return e_->cfg.timeout_s; }
  MessengerStats stats() const override { return e_->stats; }
  bool shares_copies(int peer) const override { return e_->shares_copies(peer); }
  void close() override { e_->close(); }

 private:
  std::shared_ptr<Engine> e_;
};

}  // namespace

std::unique_ptr<Messenger> make_messenger(Device& device, int rank, int size, Rendezvous& rendezvous,
                                          const MessengerConfig& config) {
  auto engine = std::make_shared<Engine>(device, rank, size, rendezvous, config);
  engine->start();
  return std::make_unique<MessengerImpl>(std::move(engine));
}

}  // namespace tensorwire
