// Copyright tensorwire authors.
//
// The message form of the data path (docs/contracts.md §12): on tcp lanes
// (tensorwire's own sockets, net/socket.h) and where a lane's RMA is emulated
// by UCX (UD), slots and plain write/read travel as messages that the
// target's handler applies: one message per tensor (header + payload; a large
// payload is read straight into the buffer the handler names, by the socket
// or by UCX's rendezvous), one small message per release/ack, and every write
// or read of channel memory checked by the *target* against what it exported
// to the initiator before a byte moves.
//
// Identity: a message names its sender by a token the receiver handed it in
// its HELLO over that peer's own control connection (Peer::inbound_token), never by
// a field the sender chooses freely.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ucp/api/ucp.h>

#include "common/bytes.h"
#include "net/socket.h"

namespace tensorwire::detail {

class Peer;

inline constexpr unsigned kDataAmId = 0x7478;            // the one AM id of data messages
inline constexpr std::uint32_t kDataMagic = 0x4d445754;  // "TWDM"

enum class MsgKind : std::uint8_t {
  kStaticSend = 1,     // target: static slot; a = sequence; b = form; payload = tensor (form 0)
  kStaticRelease = 2,  // target: static sender; a = last released sequence
  kDynamicSend =
      3,  // target: dynamic slot; a = sequence; b = form; extra = record (inline form); payload = tensor (form 0)
  kDynamicAck = 4,   // target: dynamic sender; a = sequence; b = RecordStatus; extra = an offered block (optional)
  kPut = 5,          // target: op id to answer; a = address; payload = bytes
  kPutDone = 6,      // target: op id; b = status
  kGet = 7,          // target: op id to answer; a = address; b = length
  kGetData = 8,      // target: op id; b = status; payload = bytes
  kWake = 9,         // target: slot or sender; a = sequence just set, released or acked: the peer napped (a doorbell)
  kPutFlagged = 10,  // as kPut, then the 8-byte flag (extra) at address b, after every byte of the payload
};

// kPutFlagged's operation id 0: the sender wants no reply (Channel::write_flagged
// with landed = false); operation ids start at 1.
inline constexpr std::uint64_t kUnanswered = 0;

// kStaticSend's and kDynamicSend's b: 0, the payload follows in the message;
// kPlacedSend, the sender put it into its buffer (a dynamic slot: the block
// its last ack offered) and flushed before sending this header.
inline constexpr std::uint64_t kPlacedSend = 1;

// Status of a put or get, in its reply.
enum class AccessStatus : std::uint64_t { kOk = 0, kNotExported = 1, kFailed = 2 };

// The fixed header of every data message (little-endian, 40 bytes), then
// kind-specific bytes ("extra").
struct DataHeader {
  MsgKind kind = MsgKind::kPut;
  std::uint64_t token = 0;   // the sender's identity at the receiver
  std::uint64_t target = 0;  // sink id or op id
  std::uint64_t a = 0, b = 0;
  static constexpr std::size_t kSize = 40;
  std::string encode(std::string_view extra = {}) const;
  // Throws InvalidArgument on a short header, bad magic or unknown kind.
  static DataHeader decode(ByteReader& r);
};

// The payload of an arriving message: eager (in UCX's buffer, valid only
// during the handler), announced by UCX's rendezvous (UCX fetches it into the
// buffer the handler names), or a socket frame's (read into that buffer).
class Incoming {
 public:
  Incoming(ucp_worker_h worker, void* data, std::size_t length, bool rendezvous)
      : worker_(worker), data_(data), length_(length), rendezvous_(rendezvous) {}
  explicit Incoming(net::Payload& frame)
      : worker_(nullptr), data_(nullptr), length_(frame.length()), rendezvous_(false), frame_(&frame) {}
  ~Incoming();  // a payload nobody took is released (a refused rendezvous)
  Incoming(const Incoming&) = delete;
  Incoming& operator=(const Incoming&) = delete;
  std::size_t length() const { return length_; }
  // Places the payload at dst (registered as memh, or nullptr) and calls
  // done(ok) once it is there: at once when eager, from a UCX callback when
  // by rendezvous. `keep` stays alive until then and is released outside UCX.
  // With a guard, what lands after the handler returns is copied under its
  // lock and stops once guard->discard is set (done(false)): a put into
  // memory whose grant may end meanwhile (net::LandingGuard).
  void receive_into(void* dst, ucp_mem_h memh, std::function<void(bool ok)> done, std::shared_ptr<const void> keep,
                    std::shared_ptr<net::LandingGuard> guard = nullptr);
  // Whether receive_into completes before it returns (an eager payload).
  bool immediate() const { return frame_ ? frame_->eager() : !rendezvous_; }

 private:
  ucp_worker_h worker_;
  void* data_;
  std::size_t length_;
  bool rendezvous_;
  net::Payload* frame_ = nullptr;
  bool taken_ = false;
};

// Where the answer to a message goes: the UCX endpoint it came on (AM reply
// endpoint), or its socket.
struct ReplyPath {
  ucp_ep_h ep = nullptr;
  std::shared_ptr<net::Conn> conn;
};

// The first frame a tcp lane sends on its socket (before any data message):
// which worker of the acceptor serves it and, as the token the acceptor gave
// it, who the dialing peer is. 24 bytes, little-endian.
struct LaneIntro {
  static constexpr std::uint32_t kMagic = 0x4e4c5754;  // "TWLN"
  std::uint16_t version = 0;
  std::uint16_t worker = 0;
  std::uint32_t lane = 0;
  std::uint64_t token = 0;
  static constexpr std::size_t kSize = 20;
  std::string encode() const;
  // False when `header` is not a lane introduction (another magic or size).
  static bool decode(const char* header, std::size_t length, LaneIntro* out);
};

// An object that messages address by id (slots and slot senders).
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  // Runs on the thread progressing the data worker `worker_index`: must not
  // block. Refusals are logged and counted, never thrown to UCX.
  virtual void on_message(const std::shared_ptr<Peer>& from, const DataHeader& header, ByteReader& extra,
                          Incoming& payload, int worker_index) = 0;
};

// Writes up to this size go as eager messages (UCP_AM_SEND_FLAG_EAGER): the
// target's handler places an eager payload at once, in the order the messages
// were sent on the endpoint, so a fence after them costs nothing (a larger
// payload may come by rendezvous and land later: a fence waits for it). The
// ring records of tensorwire.ranks.messages (<= 128 KiB + header) fit.
inline constexpr std::size_t kOrderedPutMax = 256u << 10;

// Sends a header-only message or one with a payload from registered memory
// (memh may be null). Flags: reply endpoint wanted, header copied; `eager`
// forces UCX's eager protocol (never a rendezvous).
ucs_status_ptr_t post_message(ucp_ep_h ep, const std::string& header, const void* payload, std::size_t length,
                              ucp_mem_h memh, ucp_send_nbx_callback_t cb, void* user_data, bool eager = false);

}  // namespace tensorwire::detail
