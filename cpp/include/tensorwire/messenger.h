// Copyright tensorwire authors.
//
// Messenger: tagged point-to-point messages between the ranks of a group, with
// MPI's matching rule: a receive takes the earliest message of its source and
// tag that no earlier receive took (per source and tag, in posting order); a
// receive from kAnySource takes the earliest unmatched message with its tag
// from any rank. The torch.distributed backend's send/recv, the collectives
// (tensorwire/collectives.h) and World's point to point all run on it.
//
// Paths, chosen by the message's size (both sides know it from their own
// buffer; sizes that differ fail both sides, naming both):
//   eager   (<= eager_bytes): a header and the payload written into the
//           sender's slot of the receiver's inbox ring, then the slot's
//           sequence word (data, fence, flag: docs/contracts.md §1). Credits
//           come back as a word the receiver writes into the sender's arena.
//   placed  (larger): the paper's static placement into the receiver's own
//           (registered) buffer: the receiver's ready-to-receive record names
//           the buffer's descriptor; the sender writes the payload straight
//           into it from its own registered memory, then a DONE record (the
//           flag outside the payload).
//
// Progress: a progress thread moves posted messages while nobody waits (a
// large isend whose sender goes on computing is delivered); a thread that
// waits drives the engine itself (no wake-up on the latency path).
//
// Completion: a send's request completes when its buffer may be reused; a
// receive's when the data is in its buffer. A failed peer fails every request
// that involves it within the Device's liveness bound, and every request of a
// collective (negative tags: a collective cannot finish without every rank),
// also those posted later; Request::failed_rank() names it. close() fails
// everything still pending.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "tensorwire/device.h"
#include "tensorwire/request.h"

namespace tensorwire {

inline constexpr int kAnySource = -1;

// How the ranks of a group meet: a key-value store they all reach (the c10d
// store a torch backend is handed; World's store).
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting until some rank has set it (Timeout after timeout_s).
  virtual std::string get(const std::string& key, double timeout_s) = 0;
};

// Memory a message moves: `nbytes` at `data`. `base`/`base_bytes` name the
// allocation that holds it (a torch storage), which the placed path registers
// once and reuses for every buffer inside it; nullptr: [data, data + nbytes).
// `keep` holds that allocation alive while the engine may touch it (the
// request, and a cached registration of it).
struct Buffer {
  void* data = nullptr;
  std::size_t nbytes = 0;
  void* base = nullptr;
  std::size_t base_bytes = 0;
  std::shared_ptr<const void> keep;
};

struct MessengerConfig {
  // How long a posted message may wait for its peer before it fails (naming
  // the peer). Request::wait takes its own timeout besides.
  double timeout_s = 300.0;
  std::size_t eager_bytes = std::size_t(128) << 10;  // the largest message copied through the ring
  // Namespace of the store keys and published regions (one per group).
  std::string name = "msg";
  bool progress_thread = true;  // a thread moves posted messages while nobody waits
};

struct MessengerStats {
  std::uint64_t eager_sends = 0;
  std::uint64_t placed_sends = 0;
  std::uint64_t unexpected = 0;           // messages that arrived before their receive was posted
  std::uint64_t shared_receives = 0;      // placed receives that read part of the sender's buffer themselves
  std::uint64_t stale_registrations = 0;  // cached registrations dropped: their memory was unmapped
};

class Messenger {
 public:
  virtual ~Messenger() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Posts a send of `buffer` to `peer` with `tag` (>= 0 for users; negative
  // tags belong to the collectives). Never blocks until the receive is
  // posted. Bad arguments (peer out of range, itself, closed) throw
  // InvalidArgument/ConnectionError before anything is posted.
  virtual Request isend(const Buffer& buffer, int peer, std::int64_t tag) = 0;
  // Posts a receive into `buffer` from `peer` (or kAnySource). When the
  // request completes, *source (if given; it must live until then) holds the
  // sender's rank.
  virtual Request irecv(const Buffer& buffer, int peer, std::int64_t tag, int* source = nullptr) = 0;
  virtual double timeout() const = 0;
  virtual MessengerStats stats() const = 0;
  // Whether large messages with `peer` share their copy: each side's CPU
  // moves its own transfers there (shared memory whose RMA needs no target).
  virtual bool shares_copies(int peer) const = 0;
  // Fails every pending request (ConnectionError), stops the progress thread,
  // unpublishes. Idempotent; the destructor calls it.
  virtual void close() = 0;
};

// The engine: `device` reaches the peers, whose addresses it learns through
// `rendezvous` (keys "<name>/addr/<rank>"); every rank of the group calls it
// with the same name and size. Returns once a channel to every peer is up.
std::unique_ptr<Messenger> make_messenger(Device& device, int rank, int size, Rendezvous& rendezvous,
                                          const MessengerConfig& config = {});

}  // namespace tensorwire
