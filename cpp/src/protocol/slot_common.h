// Copyright tensorwire authors.
//
// Shared pieces of the slot protocols: waiting on a word in local memory
// while driving progress, attaching, the checks every slot message passes
// first, the doorbell, and wait_any's view of a slot.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>

#include "common/bytes.h"
#include "core/channel_impl.h"
#include "core/device_port.h"
#include "core/messages.h"
#include "core/waiter.h"
#include "tensorwire/slot.h"

namespace tensorwire::detail {

inline std::uint64_t load_acquire(const void* p) {
  return std::atomic_ref<const std::uint64_t>(*static_cast<const std::uint64_t*>(p)).load(std::memory_order_acquire);
}

inline void store_release(void* p, std::uint64_t v) {
  std::atomic_ref<std::uint64_t>(*static_cast<std::uint64_t*>(p)).store(v, std::memory_order_release);
}

// The worker a sink's messages arrived on (-1: none yet), for waiters to drive.
inline WorkerCtl* inbox_of(const DevicePort& dev, const std::atomic<int>& index) {
  return dev ? dev.worker(index.load(std::memory_order_relaxed)) : nullptr;
}

// Every data worker of `dev` into a wait, on standby (core/waiter.h): for a
// message that may come on any of them.
inline void add_every_worker_on_standby(Drivers& drivers, const DevicePort& dev) {
  for (int i = 0; dev && i < static_cast<int>(Drivers::kMax) && dev.worker(i); ++i) {
    drivers.add(dev.worker(i), /*standby=*/true);
  }
}

// What a wait on a slot's word drives (core/waiter.h): the worker the peer's
// messages arrive on (the sink's `inbox`, once known: message form, driven
// whatever the transport); else `channel`'s worker when the peer's writes
// need this side to progress (tcp: Lane::waiter_drives); without a
// channel, `worker`. With inline progress and no inbox known yet, every data
// worker of `dev` too, on standby (every 64th round): the peer may still send
// a message on any lane (GPU tensors of a dynamic slot always travel as
// messages, and lanes may differ in form), and no thread but this one would
// take it in.
// The spin is the channel's worker's spin_us (50 us when 0), restarted by each
// event (the events are the awaited data arriving).
inline WaitPolicy prepare_slot_wait(Drivers& drivers, ChannelImpl* channel, WorkerCtl* worker, const DevicePort& dev,
                                    const std::atomic<int>& inbox) {
  WorkerCtl* known = inbox_of(dev, inbox);
  WorkerCtl* w = known ? known : channel ? (channel->lane().waiter_drives() ? channel->worker.get() : nullptr) : worker;
  drivers.add(w);
  WorkerCtl* mode_of = channel ? channel->worker.get() : worker;
  if (!known && mode_of && mode_of->mode() == ProgressMode::kInline) add_every_worker_on_standby(drivers, dev);
  // A channel's other worker's deferred notifications go now (w's go with each drive).
  if (channel && channel->worker.get() != w) channel->worker->flush_deferred();
  WorkerCtl* spin_of = channel ? channel->worker.get() : worker;
  WaitPolicy policy;
  policy.spin = std::chrono::microseconds(spin_of && spin_of->spin_us() ? spin_of->spin_us() : 50);
  return policy;
}

// Waits for `ready()` on a word in local memory (core/waiter.h). Returns
// false at the deadline (timeout_s < 0: never), or as soon as `channel`
// failed (callers then raise the channel's failure).
template <typename Ready>
bool wait_until(ChannelImpl* channel, WorkerCtl* worker, Ready ready, double timeout_s, const DevicePort& dev,
                const std::atomic<int>& inbox, void (*announce)(void*, bool, Drivers*) = nullptr,
                void* announce_ctx = nullptr) {
  if (ready()) return true;
  Drivers drivers;
  WaitPolicy policy = prepare_slot_wait(drivers, channel, worker, dev, inbox);
  policy.announce = announce;
  policy.announce_ctx = announce_ctx;
  auto failed = [channel] { return channel && channel->failed(); };
  return wait_for(drivers, ready, failed, deadline_after(timeout_s), policy) == WaitEnd::kReady;
}

inline std::size_t align64(std::size_t v) { return (v + 63) & ~std::size_t(63); }

// Memory a slot exports to its peer: whole pages of its own, so that a key
// of exactly this range (DevicePort::export_for; RDMA keys are per page)
// reaches no other data.
inline Block allocate_exported(MemoryPool& pool, std::size_t nbytes) {
  constexpr std::size_t kPage = 4096;
  return pool.allocate((nbytes + kPage - 1) & ~(kPage - 1), kPage);
}
inline Block allocate_exported(const DevicePort& dev, std::size_t nbytes) {
  return allocate_exported(dev.pool(), nbytes);
}

// A slot's link back to its one sender, made by the sender's attach call
// (payload: the descriptor of the sender's ack block, then the id its
// messages reach it by). The sender is the peer that made the call on its own
// connection; it keeps the slot until it fails.
struct SenderLink {
  std::mutex mu;
  Channel channel;  // lane 0 back to the sender
  RemoteRegion ack;
  std::uint64_t sender_id = 0;
  std::uint64_t sender_sink = 0;  // the sender's message sink (acks in the message form)
  std::atomic<bool> attached{false};
  std::uint64_t generation = 0;  // attaches so far (under mu)

  // Returns true when this attach replaces a sender that failed.
  bool attach(const std::shared_ptr<Peer>& caller, const std::string& payload, std::size_t min_ack,
              const std::string& slot) {
    ByteReader r(payload.data(), payload.size(), "slot attach");
    std::string desc = r.get_bytes32();
    const std::uint64_t sink = r.get<std::uint64_t>();
    if (r.left() != 0) throw InvalidArgument(slot + ": malformed attach call (trailing bytes)");
    RegionDescriptor d = RegionDescriptor::from_bytes(desc.data(), desc.size());
    if (d.length < min_ack) throw InvalidArgument(slot + ": the sender's ack region is too small");
    std::lock_guard<std::mutex> lock(mu);
    const bool replaces = attached.load();
    if (replaces && !channel.impl()->failed()) {
      throw InvalidArgument(slot + " already has a sender (" + channel.impl()->peer->describe() +
                            "); a second sender may attach only once that one is gone");
    }
    // The channel back goes to the workers the caller named in its own HELLO.
    Channel ch(caller->channel(0));
    RemoteRegion region(caller->accept_export(d));  // the attach call exports the ack block
    ch.impl()->check_remote(region);                // a bad key fails the attach, not a later ack
    ack = region;
    channel = ch;
    sender_id = caller->hello.device_id;
    sender_sink = sink;
    ++generation;
    attached = true;
    return replaces;
  }
  ChannelImpl* channel_impl() const { return attached ? channel.impl() : nullptr; }
  // Whether a message from `from` comes from the attached sender (its
  // connection's identity, core/messages.h).
  bool is(const std::shared_ptr<Peer>& from) {
    std::lock_guard<std::mutex> lock(mu);
    return attached && channel.impl()->peer == from && !channel.impl()->failed();
  }
  // Sends a message without payload (`extra` after the header) to the sender's sink.
  void notify(MsgKind kind, std::uint64_t a, std::uint64_t b, std::string_view extra = {}) {
    DataHeader h;
    h.kind = kind;
    h.target = sender_sink;
    h.a = a;
    h.b = b;
    channel.impl()->send_message(h, extra, nullptr, 0, 0);
  }
};

// The start of every slot message handler (MessageSink::on_message), the
// receiving end's and the sending end's alike.
//
// A slot (`link` set): a kWake doorbell from its attached sender records the
// worker it came on in `inbox` and ends there; a message of another kind than
// `expected`, or one from a peer that is not the attached sender, is refused
// (DevicePort::refuse_message). Returns the slot's device to go on with, or
// an empty port when the message was handled here (the device gone, a
// doorbell, a refusal).
inline DevicePort accept_slot_message(const DevicePort::Weak& device, SenderLink& link, const char* slot,
                                      const std::string& name, const std::shared_ptr<Peer>& from, const DataHeader& h,
                                      MsgKind expected, std::atomic<int>& inbox, int worker_index) {
  DevicePort dev = device.lock();
  if (!dev) return dev;
  if (h.kind == MsgKind::kWake) {  // a doorbell: its arrival ended the nap; it names the worker to nap on
    if (link.is(from)) inbox.store(worker_index, std::memory_order_relaxed);
    return {};
  }
  if (h.kind != expected) {
    dev.refuse_message("%s '%s': a message of kind %d", slot, name.c_str(), static_cast<int>(h.kind));
    return {};
  }
  if (!link.is(from)) {
    dev.refuse_message("%s '%s': a tensor from %s, which is not its sender", slot, name.c_str(),
                       from->describe().c_str());
    return {};
  }
  return dev;
}

// A sender (the slot's end on `channel`): true for a message of kind
// `expected` from the slot's peer, whose worker goes into `inbox`; a kWake
// doorbell from that peer ends here (its arrival ended the nap), anything
// else is refused.
inline bool accept_sender_message(const Channel& channel, const char* sender, const std::shared_ptr<Peer>& from,
                                  const DataHeader& h, MsgKind expected, std::atomic<int>& inbox, int worker_index) {
  const bool from_peer = from == channel.impl()->peer;
  if (h.kind == MsgKind::kWake && from_peer) return false;
  if (h.kind != expected || !from_peer) {
    if (auto dev = DevicePort(*from)) dev.refuse_message("%s: a message it did not expect", sender);
    return false;
  }
  inbox.store(worker_index, std::memory_order_relaxed);
  return true;
}

// A region described in a slot's attach reply: exported by the slot's owner.
inline RemoteRegion exported_by_peer(Channel& channel, const std::string& descriptor) {
  return RemoteRegion(
      channel.impl()->peer->accept_export(RegionDescriptor::from_bytes(descriptor.data(), descriptor.size())));
}

// The local regions a sender exported to its receiver (the tw.export call,
// once per region; contracts §10.4): the receiver reads a sender's memory
// only inside them. Remembers at most 1024, then starts over.
class ExportCache {
 public:
  // The key the receiver was given for `local`, exporting it first if needed.
  const std::string& key_for(Channel& channel, const LocalRegion& local, double timeout_s) {
    auto key = std::make_tuple(reinterpret_cast<std::uintptr_t>(local.address), local.length, *local.rkey);
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (keys_.size() >= 1024) keys_.clear();
      it = keys_.emplace(std::move(key), channel.export_region(local, timeout_s).rkey).first;
    }
    return it->second;
  }

 private:
  std::map<std::tuple<std::uintptr_t, std::size_t, std::string>, std::string> keys_;
};

// Answers a slot's attach call. The slot's memory is not published: only
// the sender that attached receives its descriptor (in the attach reply).
template <typename SlotImpl>
void serve_attach(const DevicePort& dev, const std::string& call, const std::shared_ptr<SlotImpl>& slot) {
  std::weak_ptr<SlotImpl> weak = slot;
  dev.on_call(call, [weak](const std::shared_ptr<Peer>& caller, const std::string& payload) -> std::string {
    auto s = weak.lock();
    if (!s) throw NotFound("the slot is gone");
    return s->attach(caller, payload);
  });
}

inline void stop_attach(const DevicePort::Weak& device, const std::string& call) {
  if (auto dev = device.lock()) {
    if (!dev.closed()) dev.on_call(call, nullptr);
  }
}

// The device of a channel's local end: ConnectionError once it is closed.
inline DevicePort open_port(Channel& channel) {
  DevicePort dev(*channel.impl()->peer);
  if (!dev) throw ConnectionError("device is closed");
  return dev;
}

// Sender side of the attach call: returns the slot's description.
inline std::string attach_to_slot(Channel& channel, const std::string& call, const Block& ack, std::uint64_t sink,
                                  double timeout_s) {
  DevicePort dev = open_port(channel);
  ByteWriter w;
  w.put_bytes32(dev.export_for(ack.descriptor(), *channel.impl()->peer).to_bytes());
  w.put<std::uint64_t>(sink);
  try {
    return channel.call(call, w.str(), timeout_s);
  } catch (const NotFound&) {
    // The slot's attach call is how its name is found: say it in slot terms.
    const auto slash = call.find('/');
    throw NotFound("no " + call.substr(3, slash - 3) + " slot named '" + call.substr(slash + 1) + "' on " +
                   channel.impl()->peer->describe() + " (the receiver makes it: device." + call.substr(3, slash - 3) +
                   "_slot(name, ...))");
  }
}

// A slot end's registration as a message sink: the id travels in the attach
// call or reply; dropped with the object.
struct SinkRegistration {
  DevicePort::Weak device;
  std::uint64_t id = 0;
  void add(const DevicePort& dev, std::weak_ptr<MessageSink> sink) {
    device = dev.weak();
    id = dev.add_sink(std::move(sink));
  }
  ~SinkRegistration() {
    if (auto dev = device.lock()) dev.remove_sink(id);
  }
};

// The doorbell of a slot's one-sided form (contracts §10.3): a receiver about
// to nap raises a flag in its sender's ack block, which it reaches as mapped
// memory; the sender, after setting the slot's word in place, finds it raised
// and sends a kWake message, whose arrival ends the nap on the worker's event
// fd. Without it an idle receiver notices the word only when its nap ends
// (up to 1 ms).
struct Doorbell {
  std::uint64_t generation = 0;  // the link's attach it was looked up for (0: none yet)
  RemoteRegion held;             // that sender's ack block: keeps its mapping alive
  std::uint64_t* flag = nullptr;
  // The flag (the u64 at `offset` of the sender's ack block), or nullptr
  // where there is none: messages form (every tensor is a message already),
  // an ack block not mapped here (its writes are UCX puts), no sender.
  // Looked up once per attached sender, at a wait's first nap.
  std::uint64_t* flag_of(SenderLink& link, const Block& local, std::size_t offset) {
    std::lock_guard<std::mutex> lock(link.mu);  // a new sender may be attaching
    if (link.generation == generation) return flag;
    generation = link.generation;
    held = link.ack;
    flag = nullptr;
    ChannelImpl* ch = link.attached ? link.channel.impl() : nullptr;
    try {
      if (ch && !ch->lane().rma_is_messages() && held.descriptor().length >= offset + 8) {
        char* base = ch->direct_target(held, local.region());
        if (base) flag = reinterpret_cast<std::uint64_t*>(base + offset);
      }
    } catch (const Error&) {  // a failed sender: no doorbell, the wait fails on its own
    }
    return flag;
  }
};

// WaitPolicy::announce of a slot's recv(): before the first nap the flag goes
// up and the wait naps on the worker a doorbell arrives on (the one messages
// came on, else every data worker, on standby); down when the wait ends.
// Slot has link, ack_src, doorbell, kNappingAt, device and inbox.
template <typename Slot>
void announce_nap(void* ctx, bool napping, Drivers* drivers) {
  auto* s = static_cast<Slot*>(ctx);
  std::uint64_t* f = s->doorbell.flag_of(s->link, s->ack_src, Slot::kNappingAt);
  if (!f) return;
  if (napping && drivers) {
    DevicePort dev = s->device.lock();
    if (WorkerCtl* in = inbox_of(dev, s->inbox)) {
      drivers->add(in, /*standby=*/true);
    } else {
      add_every_worker_on_standby(*drivers, dev);
    }
  }
  // seq_cst: the recheck of the word after raising the flag, and the
  // sender's load of the flag after setting the word, cannot both miss.
  std::atomic_ref<std::uint64_t>(*f).store(napping ? 1 : 0, std::memory_order_seq_cst);
}

// WaitPolicy::announce of a sender's wait for its receiver's word (a static
// sender's release, a dynamic send's ack), the other direction of the
// doorbell: the flag the sender reaches in the receiver's memory
// (Sender::napping_at_receiver) goes up before the first long nap, and the
// wait naps on every data worker (the wake comes to the worker of its lane 0
// back), down when it ends. Nothing where the sender has no such flag.
template <typename Sender>
void announce_sender_nap(void* ctx, bool napping, Drivers* drivers) {
  auto* s = static_cast<Sender*>(ctx);
  if (!s->napping_at_receiver) return;
  if (napping && drivers) add_every_worker_on_standby(*drivers, DevicePort(*s->channel.impl()->peer));
  std::atomic_ref<std::uint64_t>(*s->napping_at_receiver).store(napping ? 1 : 0, std::memory_order_seq_cst);
}

// Either side of the doorbell, after writing its word in place (a plain
// store: a sequence word, a release, an ack): a kWake message to the peer's
// `sink` over `channel` if the peer's napping flag (in this side's own
// memory) is raised. Returns whether it rang. Never throws: the word is
// written, and a dead peer's failure surfaces on the next wait.
inline bool ring_if_napping(const void* flag, const Channel& channel, std::uint64_t sink, std::uint64_t seq) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the word's store before this load
  auto& napping = *static_cast<std::uint64_t*>(const_cast<void*>(flag));
  if (std::atomic_ref<std::uint64_t>(napping).load(std::memory_order_relaxed) == 0) return false;
  DataHeader h;
  h.kind = MsgKind::kWake;
  h.target = sink;
  h.a = seq;
  try {
    channel.impl()->send_message(h, std::string_view(), nullptr, 0, 0);  // completes on its own (contracts §2)
    return true;
  } catch (const Error&) {
    return false;
  }
}

// A sender's side of attaching to slot `call` ("tw.static/name") over
// `channel`: its ack block (exported to the slot in the call) and its message
// sink, then the call. Returns the slot's description. Sender has channel,
// ack and sink.
template <typename Sender>
std::string attach_sender(const std::shared_ptr<Sender>& s, Channel channel, const std::string& call,
                          double timeout_s) {
  s->channel = channel;
  DevicePort dev = open_port(channel);
  s->ack = allocate_exported(dev, 64);
  std::memset(s->ack.data(), 0, 64);
  s->sink.add(dev, s);
  return attach_to_slot(channel, call, s->ack, s->sink.id, timeout_s);
}

// A slot for wait_any(): ready once its next tensor arrived (Slot::wait_ready,
// which consumes nothing), failed with its sender's channel; the wait drives
// what the slot's recv() would. Slot has channel(), device, inbox and
// describe_wait() ("static slot 'x': tensor 7").
template <typename Slot>
class SlotSource : public WaitSource {
 public:
  explicit SlotSource(std::shared_ptr<Slot> slot) : s_(std::move(slot)) {}
  bool ready() override { return s_->wait_ready(); }
  bool failed() override { return s_->channel() && s_->channel()->failed(); }
  void throw_failure() override {
    s_->channel()->check_usable();
    throw ConnectionError(s_->describe_wait() + ": its sender's channel failed");
  }
  bool prepare(Drivers& drivers, WaitPolicy& policy) override {
    dev_ = s_->device.lock();
    policy = prepare_slot_wait(drivers, s_->channel(), dev_ ? dev_.worker(0) : nullptr, dev_, s_->inbox);
    return true;
  }
  std::string describe() override { return s_->describe_wait(); }
  void announce(bool napping, Drivers* drivers) override { announce_nap<Slot>(s_.get(), napping, drivers); }
  bool announces() const override { return true; }

 private:
  std::shared_ptr<Slot> s_;
  DevicePort dev_;  // its workers stay alive while the wait drives them
};

}  // namespace tensorwire::detail
