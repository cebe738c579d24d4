// Copyright tensorwire authors.
//
// A lane: the transport under one channel (core/channel_impl.h). One type
// per transport: a UCX endpoint (one-sided RMA, or AM messages where its RMA
// is emulated), a channel's endpoint to this very device (its pool blocks
// are our own memory: a copy), and tensorwire's own socket (net/socket.h:
// messages only). The channel owns the forms built on top (the message form
// of write/read, the direct copy, ordering) and asks the lane's properties
// to choose between them; the protocols ask the same properties, never which
// transport it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

#include "core/memory_impl.h"
#include "core/messages.h"
#include "core/worker_ctl.h"
#include "net/socket.h"
#include "tensorwire/request.h"

namespace tensorwire::detail {

class PendingOps;  // core/channel_impl.h

// TENSORWIRE_LANE_FORM, per lane: what a UCX lane carries write/read as.
enum class LaneForm { kAuto, kRma, kMessages };

// Which transport a lane is: for descriptions and tests, never to branch on
// (ask the properties).
enum class LaneKind { kUcx, kSelf, kSocket };

// What a lane works with, from its channel.
struct LaneContext {
  std::shared_ptr<WorkerCtl> worker;
  PendingOps* ops = nullptr;  // the channel's: tracks this lane's operations (the channel outlives them)
  std::string peer_name;      // Peer::describe(), for errors
};

class Lane {
 public:
  explicit Lane(LaneContext context) : ctx_(std::move(context)) {}
  virtual ~Lane() = default;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  virtual LaneKind kind() const = 0;

  // ---- properties
  // Whether write, read and flush travel as messages the target serves
  // (core/messages.h), and so do slots: where RMA is emulated (needs the
  // target's progress), a socket, or as TENSORWIRE_LANE_FORM forces. Then a
  // completed write has landed (the target answered once it applied it).
  // Never on a channel to this very device. The first answer stays.
  virtual bool rma_is_messages() const = 0;
  // Whether a write from the peer lands only when this side progresses its
  // worker (tcp and UCX's other emulated RMA); not over shared memory or
  // verbs RC/DC. Conservative (true) until UCX can tell.
  virtual bool needs_target_progress() const = 0;
  // Whether a message-form write of `length` bytes is applied by the target
  // before any message sent after it: then a fence after it waits for nothing.
  virtual bool write_message_in_order(std::size_t length) const = 0;
  // Whether rma(), flush() and fence() exist: one-sided UCX operations
  // (a message-form UCX lane still has them, for placed payloads).
  virtual bool one_sided() const = 0;
  // Whether write_flagged(landed = false) goes unanswered: its send completes
  // once the bytes left, saving a syscall at each end and a wake-up per record.
  virtual bool unanswered_flagged_writes() const = 0;
  // Whether a completed write has landed at the target (it answered once it
  // applied it): a flag may follow it without a fence.
  bool write_landed_on_completion() const { return rma_is_messages(); }
  // Whether a waiter for something the peer sends must drive this lane's
  // worker: emulated RMA, or messages (handled by whoever progresses).
  bool waiter_drives() const { return needs_target_progress() || rma_is_messages(); }

  // ---- the connection
  virtual bool usable() const = 0;  // false once closed
  virtual void close() = 0;         // force-close; what is pending fails
  // "transport/device" of each transport it uses (empty when UCX cannot say).
  virtual std::vector<std::string> transports() const = 0;
  virtual std::string info() const = 0;  // a description of the transport, for people

  // ---- the peer's memory
  // remote's key on this lane (unpacked once) and where this process maps
  // its first byte, checked (InvalidArgument for a key a peer made up); a
  // socket has no keys: {}.
  virtual RemoteRegionImpl::Access access(const RemoteRegion& remote) const = 0;
  // Where this process maps remote's first byte for a copy, else nullptr.
  virtual char* mapping(const RemoteRegion& remote) const = 0;

  // ---- one-sided operations (one_sided() lanes)
  // UCX's put (is_write) or get of local[local_offset..+length) at the
  // peer's address `raddr`, with `rkey` from access(). Completes locally.
  virtual Request rma(bool is_write, const LocalRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                      ucp_rkey_h rkey, std::uint64_t raddr, std::size_t length) = 0;
  virtual Request flush() = 0;  // every one-sided operation posted before it has completed
  virtual void fence() = 0;     // orders the operations posted before it before those after

  // ---- data messages
  // Sends header + payload (registered as memh, or nullptr); completes when
  // the payload may be reused.
  virtual Request send(const std::string& header, const void* payload, std::size_t length, ucp_mem_h memh,
                       const std::shared_ptr<const void>* local_owner) = 0;
  // Sends a message that the target answers (the answer completes its
  // operation): not tracked here, the payload kept by the operation.
  // `in_order`: as write_message_in_order promised. Throws Error when it
  // could not be posted.
  virtual void post(const std::string& header, const void* payload, std::size_t length, ucp_mem_h memh,
                    bool in_order) = 0;
  // A header-only message that rides in the next one sent (a slot's
  // release), or goes at the worker's next flush point; false where the
  // lane cannot (then send it the usual way).
  virtual bool ride(const void* key, const DataHeader& h) { return false; }

 protected:
  const LaneContext ctx_;
};

// The lanes, around connections their channel made.
std::unique_ptr<Lane> ucx_lane(LaneContext context, std::shared_ptr<ucx::Endpoint> ep, LaneForm form,
                               std::shared_ptr<PoolImpl> pool, std::uint32_t peer_pid);
// A channel to this very device: pool blocks of `own` are copied to and from.
std::unique_ptr<Lane> self_lane(LaneContext context, std::shared_ptr<ucx::Endpoint> ep, std::weak_ptr<PoolImpl> own);
// `borrowed`: the peer dialled it (Peer::inbound_lane), not ours to close.
std::unique_ptr<Lane> socket_lane(LaneContext context, std::shared_ptr<net::Conn> conn, bool borrowed, int lane,
                                  std::string transport);

}  // namespace tensorwire::detail
