// Copyright tensorwire authors.
//
// Dynamic allocation. The receiver's record is protocol/dynamic_record.h.
// The sender's ack block: 0 u64 acked sequence | 8 u64 status of that record
// (0 accepted, else a RecordStatus); the receiver writes status, fences, then
// the sequence.
#include <cstring>

#include "protocol/dynamic_record.h"
#include "protocol/slot_common.h"
#include "protocol/staging.h"
#include "tensorwire/wait.h"

namespace tensorwire {
namespace detail {

class DynamicSlotImpl : public MessageSink, public std::enable_shared_from_this<DynamicSlotImpl> {
 public:
  DevicePort::Weak device;
  std::string name;
  int max_ndim = 8;
  std::size_t max_nbytes = 0;
  std::size_t record_size = 0;
  std::unique_ptr<MemoryPool> tensors;
  bool gpu = false;  // tensors go to GPU memory  // where received tensors go: the host pool or a GPU's CUDA arena
  Block record, ack_src;
  SenderLink link;
  std::atomic<std::uint64_t> expected{1};
  SlotStats stats;
  SinkRegistration sink;
  std::atomic<int> inbox{-1};
  // A tensor that came in the message form: validated, placed (or refused)
  // by the handler; `arrival_ready` once recv() may take it.
  struct Arrival {
    std::uint64_t seq = 0;
    RecordStatus status = kAccepted;
    TensorSpec spec;
    Block block;
  };
  std::mutex arrival_mu;
  Arrival arrival;
  std::atomic<bool> arrival_pending{false}, arrival_ready{false};
  // The block offered (in the last ack) for the next tensor to be placed in,
  // and its size (contracts §10.4, §12); under arrival_mu.
  Block landing;
  std::size_t landing_nbytes = 0;

  const char* base() const { return static_cast<const char*>(record.data()); }
  bool ready() const {
    return arrival_ready.load(std::memory_order_acquire) || load_acquire(base() + record_size - 64) == expected;
  }
  // For wait_any (SlotSource).
  bool wait_ready() const { return ready(); }
  // The doorbell (contracts §10.3, §10.4): its flag is word 2 of the sender's
  // ack block (sequence and status come first).
  static constexpr std::size_t kNappingAt = 16;
  Doorbell doorbell;
  ChannelImpl* channel() const { return link.channel_impl(); }
  std::string describe_wait() const { return "dynamic slot '" + name + "'"; }

  // The message form of a send: the record (inline form) in the header,
  // checked like one written into the record; the payload straight into the
  // block allocated for it.
  void on_message(const std::shared_ptr<Peer>& from, const DataHeader& h, ByteReader& extra, Incoming& payload,
                  int worker_index) override {
    const DevicePort dev =
        accept_slot_message(device, link, "dynamic slot", name, from, h, MsgKind::kDynamicSend, inbox, worker_index);
    if (!dev) return;
    const bool placed = h.b == kPlacedSend;  // the payload was put into the landing block
    if (h.b > kPlacedSend || (placed && payload.length() != 0)) {
      return dev.refuse_message("dynamic slot '%s': a tensor of form %llu with %zu bytes", name.c_str(),
                                static_cast<unsigned long long>(h.b), payload.length());
    }
    if (h.a != expected.load() || arrival_pending.exchange(true)) {
      return dev.refuse_message("dynamic slot '%s': tensor %llu out of turn", name.c_str(),
                                static_cast<unsigned long long>(h.a));
    }
    inbox.store(worker_index, std::memory_order_relaxed);
    const std::string bytes = extra.get_n(extra.left());
    Arrival a;
    a.seq = h.a;
    DynamicRecord rec;
    a.status = decode_record(bytes.data(), bytes.size(), max_ndim, max_nbytes, &rec, RecordForm::kInlineData);
    if (a.status == kAccepted && !placed && payload.length() != rec.nbytes) a.status = kSizeMismatch;
    a.spec = rec.spec;
    if (placed) {  // its sender's put landed before this message was sent (§12)
      std::lock_guard<std::mutex> lock(arrival_mu);
      if (a.status == kAccepted && (!landing || rec.nbytes == 0 || landing_nbytes != rec.nbytes)) {
        a.status = kSizeMismatch;
      }
      if (a.status == kAccepted) {
        const RegionDescriptor d = landing.descriptor();
        from->revoke(d.address, d.address + d.length);  // the tensor is the user's now, not the sender's to write
        a.block = std::move(landing);
        landing_nbytes = 0;
      }
      arrival = std::move(a);
      arrival_ready.store(true, std::memory_order_release);
      return;
    }
    if (a.status == kAccepted) {
      try {
        a.block = tensors->allocate(rec.nbytes ? rec.nbytes : 1, 64);
      } catch (const PoolExhausted&) {
        a.status = kPoolExhausted;
      }
    }
    void* dst = a.block ? a.block.data() : nullptr;
    ucp_mem_h memh = a.block ? a.block.region().memh : nullptr;
    const bool receive = a.status == kAccepted && rec.nbytes > 0;
    {
      std::lock_guard<std::mutex> lock(arrival_mu);
      arrival = std::move(a);
    }
    if (!receive) {
      arrival_ready.store(true, std::memory_order_release);
      return;  // a refused payload is dropped (its send completes)
    }
    Arrival* slot = &arrival;
    std::atomic<bool>* done_flag = &arrival_ready;
    payload.receive_into(
        dst, memh,
        [slot, done_flag](bool ok) {
          if (!ok) slot->status = kReadFailed;
          done_flag->store(true, std::memory_order_release);
        },
        shared_from_this());
  }

  // Takes the tensor the message handler placed: the data, or the refusal.
  Block take_arrival(TensorSpec* spec) {
    Arrival a;
    {
      std::lock_guard<std::mutex> lock(arrival_mu);
      a = std::move(arrival);
      arrival = Arrival();
    }
    arrival_ready.store(false, std::memory_order_relaxed);
    arrival_pending.store(false, std::memory_order_release);
    ++expected;
    *spec = a.spec;
    if (a.status != kAccepted) {
      ++stats.rejected;
      try {
        ack(a.seq, a.status);
      } catch (const Error&) {  // the sender is gone: nothing to unblock
      }
      const std::string why = "dynamic slot '" + name + "' refused record " + std::to_string(a.seq) + ": " +
                              describe_record_status(a.status);
      if (a.status == kPoolExhausted) throw PoolExhausted(why);
      if (a.status == kReadFailed) throw ConnectionError(why);
      throw InvalidArgument(why);
    }
    const std::size_t nbytes = a.spec.nbytes();
    ack(a.seq, kAccepted, offer_landing(nbytes));
    ++stats.received;
    stats.bytes += nbytes;
    return std::move(a.block);
  }

  // The ack's offer (message form, §10.4): a block for the next tensor if it
  // has the size of this one and the slot's device asks for placement
  // (DeviceImpl::place_window), as its descriptor exported to the sender;
  // empty otherwise. Reuses the block offered before when it was not taken.
  std::string offer_landing(std::size_t nbytes) {
    auto dev = device.lock();
    std::lock_guard<std::mutex> lock(arrival_mu);
    const auto [from, to] = dev ? dev.place_window() : std::pair<std::uint64_t, std::uint64_t>{1, 0};
    if (!dev || gpu || nbytes == 0 || nbytes < from || nbytes > to || !link.channel.impl()->lane().rma_is_messages()) {
      landing = Block();
      landing_nbytes = 0;
      return {};
    }
    if (!landing || landing_nbytes != nbytes) {
      landing = Block();
      landing_nbytes = 0;
      try {
        landing = tensors->allocate(nbytes, 64);
      } catch (const PoolExhausted&) {
        return {};  // no offer: the next tensor travels in its message
      }
      landing_nbytes = nbytes;
    }
    ByteWriter w;
    w.put_bytes32(dev.export_for(landing.descriptor(), *link.channel.impl()->peer).to_bytes());
    w.put<std::uint64_t>(nbytes);  // the one size it takes (the block is rounded up)
    return std::move(w.str());
  }

  std::string attach(const std::shared_ptr<Peer>& caller, const std::string& payload) {
    auto dev = device.lock();
    if (!dev) throw ConnectionError("device is closed");
    link.attach(caller, payload, 16, "dynamic slot '" + name + "'");
    store_release(const_cast<char*>(base()) + record_size - 64, 0);  // a record left by anyone else
    store_release(const_cast<char*>(base()) + record_size - 56, 0);  // and a failed sender's napping flag
    {
      std::lock_guard<std::mutex> lock(arrival_mu);
      if (arrival_ready.load()) {  // likewise a message-form tensor the failed sender left
        arrival = Arrival();
        arrival_ready = false;
        arrival_pending = false;
      }
      landing = Block();  // offered to the failed sender only
      landing_nbytes = 0;
    }
    ByteWriter w;
    w.put<std::uint32_t>(static_cast<std::uint32_t>(max_ndim));
    w.put<std::uint64_t>(max_nbytes);
    w.put<std::uint64_t>(record_size);
    w.put<std::uint64_t>(expected);
    w.put_bytes32(dev.export_for(record.descriptor(), *caller).to_bytes());
    w.put<std::uint64_t>(sink.id);
    w.put<std::uint8_t>(static_cast<std::uint8_t>(gpu ? MemoryType::kCuda : MemoryType::kHost));  // appended (§10.4)
    return std::move(w.str());
  }

  // Status first, fence, then the sequence: the sender reads the sequence,
  // then trusts the status. `landing_offer`: the message form's (offer_landing).
  void ack(std::uint64_t seq, std::uint64_t status, std::string_view landing_offer = {}) {
    if (link.channel.impl()->lane().rma_is_messages()) {
      link.notify(MsgKind::kDynamicAck, seq, status, landing_offer);  // one message, applied in order by the sender
      return;
    }
    auto* w = static_cast<std::uint64_t*>(ack_src.data());
    w[0] = seq;
    w[1] = status;
    LocalRegion src = ack_src.region();
    Request a = link.channel.write(src, 8, link.ack, 8, 8);
    Request b = link.channel.write_ordered(src, 0, link.ack, 0, 8);
    const bool in_place = b.state() > 0;
    a.wait(10.0);
    b.wait(10.0);
    // The ack's doorbell (§10.4): the sender said it naps on its request.
    if (in_place && ring_if_napping(base() + record_size - 56, link.channel, link.sender_sink, seq)) ++stats.doorbells;
  }

  // Consumes the record that is ready: returns the data, or throws.
  Block take(TensorSpec* spec) {
    auto dev = device.lock();
    if (!dev) throw ConnectionError("device is closed");
    if (arrival_ready.load(std::memory_order_acquire)) return take_arrival(spec);
    const std::uint64_t seq = expected++;
    if (!link.attached) {
      // Anyone who looked the slot up can write its record; only the
      // attached sender's records are read (and acked).
      ++stats.rejected;
      throw InvalidArgument("dynamic slot '" + name + "' refused record " + std::to_string(seq) +
                            ": no sender is attached");
    }
    DynamicRecord rec;
    const RecordStatus status = decode_record(base(), record_size - 64, max_ndim, max_nbytes, &rec);
    *spec = rec.spec;
    const std::uint64_t nbytes = rec.nbytes;
    // Every refusal is acked with its reason: the sender's request fails with
    // it, and the slot takes the next record.
    auto refuse = [&](RecordStatus why) {
      ++stats.rejected;
      try {
        ack(seq, why);
      } catch (const Error&) {  // the sender is gone: nothing to unblock
      }
    };
    if (status != kAccepted) {
      refuse(status);
      throw InvalidArgument("dynamic slot '" + name + "' refused record " + std::to_string(seq) + ": " +
                            describe_record_status(status));
    }
    RemoteRegion src;
    if (nbytes > 0) {
      RegionDescriptor d;
      d.device_id = link.sender_id;
      d.address = rec.address;
      d.length = nbytes;
      d.rkey = rec.rkey;
      // Read only what the sender exported to this device (its export call):
      // remote_region refuses anything else.
      try {
        src = link.channel.remote_region(d);
      } catch (const InvalidArgument&) {
        refuse(kNotExported);
        throw InvalidArgument("dynamic slot '" + name + "' refused record " + std::to_string(seq) + ": " +
                              describe_record_status(kNotExported));
      }
    }
    Block out;
    try {
      out = tensors->allocate(nbytes ? nbytes : 1, 64);
    } catch (const PoolExhausted& e) {
      refuse(kPoolExhausted);
      throw PoolExhausted("dynamic slot '" + name + "' refused record " + std::to_string(seq) + " of " +
                          std::to_string(nbytes) + " bytes: " + e.what());
    }
    if (nbytes > 0) {
      try {
        link.channel.read(out.region(), 0, src, 0, nbytes).wait(60.0);
      } catch (const Error&) {
        ++stats.rejected;
        try {
          ack(seq, kReadFailed);
        } catch (const Error&) {
        }
        throw;
      }
    }
    ack(seq, kAccepted);
    ++stats.received;
    stats.bytes += nbytes;
    return out;
  }
};

class DynamicSenderImpl : public MessageSink {
 public:
  // The receiver's ack in the message form: its offer of a block for the
  // next tensor, the status, then the sequence.
  void on_message(const std::shared_ptr<Peer>& from, const DataHeader& h, ByteReader& extra, Incoming&,
                  int worker_index) override {
    if (!accept_sender_message(channel, "dynamic sender", from, h, MsgKind::kDynamicAck, inbox, worker_index)) return;
    {
      std::lock_guard<std::mutex> lock(landing_mu);
      landing.clear();
      if (extra.left() > 0) {
        try {
          landing = extra.get_bytes32();
          landing_nbytes = extra.get<std::uint64_t>();
          landing_seq = h.a + 1;
        } catch (const Error&) {  // a malformed offer: the next tensor travels in its message
          landing.clear();
        }
      }
    }
    store_release(static_cast<char*>(ack.data()) + 8, h.b);
    store_release(ack.data(), h.a);
  }

  // The block the receiver offered for tensor `seq` of `nbytes` (§10.4), if
  // any; each offer serves one send.
  RemoteRegion take_landing(std::uint64_t seq, std::size_t nbytes) {
    std::string offer;
    {
      std::lock_guard<std::mutex> lock(landing_mu);
      if (landing_seq != seq || landing_nbytes != nbytes) {
        landing.clear();
        return {};
      }
      offer.swap(landing);
    }
    if (offer.empty() || nbytes == 0) return {};
    try {
      RemoteRegion r = exported_by_peer(channel, offer);
      return r.length() >= nbytes ? r : RemoteRegion();
    } catch (const InvalidArgument&) {
      return {};
    }
  }
  std::mutex landing_mu;
  std::string landing;                                // the offer's descriptor bytes
  std::uint64_t landing_seq = 0, landing_nbytes = 0;  // the tensor it is for, and its size

  Channel channel;
  std::uint64_t slot_sink = 0;
  std::atomic<int> inbox{-1};
  SinkRegistration sink;
  RemoteRegion record;
  int max_ndim = 8;
  bool gpu_slot = false;  // the slot puts tensors in GPU memory (its attach reply says)
  std::size_t max_nbytes = 0, record_size = 0;
  std::uint64_t next_seq = 1;
  Block ack, record_src, seq_src;  // record_src: the record is built here, then written
  SlotStats stats;
  ExportCache exported;  // the local regions the receiver may read
  std::uint64_t acked() const { return load_acquire(ack.data()); }
  std::uint64_t status() const { return load_acquire(static_cast<const char*>(ack.data()) + 8); }
  // The ack's doorbell (contracts §10.4): the sender's napping flag, the u64
  // after the record's sequence word, which it reaches as mapped memory
  // (nullptr: messages form, or not mapped here).
  std::uint64_t* napping_at_receiver = nullptr;
  std::size_t check_spec(const TensorSpec& spec) const;  // its nbytes; InvalidArgument past the slot's bounds
  // One tensor from local[offset..]: DynamicSender::send without its accounting of the source.
  Request send(const std::shared_ptr<DynamicSenderImpl>& self, const LocalRegion& local, std::size_t offset,
               const TensorSpec& spec, double timeout_s);
};

}  // namespace detail

// ---- DynamicSlot ----

DynamicSlot::DynamicSlot(Device& device, const std::string& name, int max_ndim, std::size_t max_nbytes,
                         MemoryType memory, int gpu)
    : impl_(std::make_shared<detail::DynamicSlotImpl>()) {
  if (max_ndim < 0 || max_ndim > 64) throw InvalidArgument("max_ndim must be in 0..64");
  detail::DevicePort dev(device);
  auto& s = *impl_;
  s.device = dev.weak();
  s.name = name;
  s.max_ndim = max_ndim;
  s.max_nbytes = max_nbytes;
  s.record_size = detail::record_size_for(max_ndim);
  // The record stays in host memory (polled by the CPU); tensors go where the slot says.
  s.tensors = std::make_unique<MemoryPool>(dev.pool(memory, gpu));
  s.gpu = memory == MemoryType::kCuda;
  s.record = detail::allocate_exported(dev, s.record_size);
  std::memset(s.record.data(), 0, s.record_size);
  s.ack_src = dev.pool().allocate(64, 64);
  s.sink.add(dev, impl_);
  detail::serve_attach(dev, "tw.dynamic/" + name, impl_);
}

// Ready once a record (or a message-form tensor) arrived; recv() then
// validates, allocates and reads it.
Awaitable::Awaitable(const DynamicSlot& slot)
    : source_(std::make_shared<detail::SlotSource<detail::DynamicSlotImpl>>(slot.impl_)) {}

DynamicSlot::~DynamicSlot() { detail::stop_attach(impl_->device, "tw.dynamic/" + impl_->name); }

Block DynamicSlot::recv(TensorSpec* spec, double timeout_s) {
  auto& s = *impl_;
  auto dev = s.device.lock();
  detail::WorkerCtl* worker = dev ? dev.worker(0) : nullptr;
  detail::ChannelImpl* ch = s.link.channel_impl();
  if (!detail::wait_until(
          ch, worker, [&] { return s.ready(); }, timeout_s, dev, s.inbox,
          &detail::announce_nap<detail::DynamicSlotImpl>, &s)) {
    if (ch && ch->failed()) ch->check_usable();
    throw Timeout("dynamic slot '" + s.name + "': no tensor within " + std::to_string(timeout_s) + " s");
  }
  return s.take(spec);
}

bool DynamicSlot::poll(Block* out, TensorSpec* spec) {
  auto& s = *impl_;
  if (!s.ready()) {
    auto dev = s.device.lock();
    if (auto* in = detail::inbox_of(dev, s.inbox)) {
      in->progress();
    } else if (auto* ch = s.link.channel_impl()) {
      ch->worker->progress();
    }
    if (!s.ready()) return false;
  }
  *out = s.take(spec);
  return true;
}

SlotStats DynamicSlot::stats() const { return impl_->stats; }
std::size_t DynamicSlot::record_size() const { return impl_->record_size; }
std::uint64_t DynamicSlot::next_seq() const { return impl_->expected; }

// ---- DynamicSender ----

DynamicSender::DynamicSender(Channel channel, const std::string& name, double timeout_s)
    : impl_(std::make_shared<detail::DynamicSenderImpl>()), staging_(std::make_unique<detail::SenderStaging>()) {
  auto& s = *impl_;
  std::string reply = detail::attach_sender(impl_, channel, "tw.dynamic/" + name, timeout_s);
  detail::ByteReader r(reply.data(), reply.size(), "dynamic slot description");
  s.max_ndim = static_cast<int>(r.get<std::uint32_t>());
  s.max_nbytes = r.get<std::uint64_t>();
  s.record_size = r.get<std::uint64_t>();
  s.next_seq = r.get<std::uint64_t>();
  std::string desc = r.get_bytes32();
  s.slot_sink = r.get<std::uint64_t>();
  s.record = detail::exported_by_peer(channel, desc);
  s.gpu_slot = r.left() > 0 && r.get<std::uint8_t>() == static_cast<std::uint8_t>(MemoryType::kCuda);
  if (s.max_ndim < 0 || s.max_ndim > detail::kRecordMaxNdim || s.record_size != detail::record_size_for(s.max_ndim) ||
      s.record.length() < s.record_size) {
    throw ProtocolMismatch("dynamic slot '" + name + "' has an inconsistent description");
  }
  detail::store_release(s.ack.data(), s.next_seq - 1);
  detail::DevicePort dev = detail::open_port(channel);
  s.record_src = dev.pool().allocate(s.record_size, 64);
  s.seq_src = dev.pool().allocate(64, 64);
  if (!channel.impl()->lane().rma_is_messages()) {
    if (char* base = channel.impl()->direct_target(s.record, s.record_src.region())) {
      s.napping_at_receiver = reinterpret_cast<std::uint64_t*>(base + s.record_size - 56);
    }
  }
}

DynamicSender::~DynamicSender() = default;

Request DynamicSender::send(const OutsideTensor& tensor, const TensorSpec& spec, SendPath path, double timeout_s) {
  impl_->check_spec(spec);  // before anything is copied or registered
  detail::DevicePort dev(*impl_->channel.impl()->peer);
  if (!dev) throw ConnectionError("device is closed");
  auto staged = staging_->stage(dev, tensor, spec.nbytes(), path, timeout_s);
  Request req = impl_->send(impl_, staged.local, 0, spec, staged.timeout_left);
  staging_->sent(std::move(staged), req, impl_->stats);
  return req;
}

Request DynamicSender::send(const LocalRegion& local, std::size_t offset, const TensorSpec& spec, double timeout_s) {
  Request req = impl_->send(impl_, local, offset, spec, timeout_s);
  ++impl_->stats.zero_copy;  // only once sent: a refused tensor leaves the stats unchanged
  return req;
}

namespace detail {

std::size_t DynamicSenderImpl::check_spec(const TensorSpec& spec) const {
  const std::size_t n = spec.nbytes();  // validates dtype and shape
  if (spec.shape.size() > static_cast<std::size_t>(max_ndim)) {
    throw InvalidArgument("the slot takes at most " + std::to_string(max_ndim) + " dimensions, got " + spec.describe());
  }
  if (n > max_nbytes) {
    throw InvalidArgument("tensor of " + std::to_string(n) + " bytes exceeds the slot's limit of " +
                          std::to_string(max_nbytes));
  }
  return n;
}

Request DynamicSenderImpl::send(const std::shared_ptr<DynamicSenderImpl>& self, const LocalRegion& local,
                                std::size_t offset, const TensorSpec& spec, double timeout_s) {
  auto& s = *this;
  const std::size_t n = check_spec(spec);
  if (n > 0 && (offset > local.length || n > local.length - offset)) {
    throw InvalidArgument("tensor range exceeds its local region");
  }
  // GPU memory on either side travels in the message form: UCX pushes it
  // with its rendezvous (cuda_ipc on one host), while its ucp_get of GPU
  // memory is a software emulation (UCX 1.22 over shm: 0.68 GB/s against
  // 43 GB/s for 16 MiB on an H100, bench/results/gpu_dynamic_forms.txt).
  const bool messages =
      s.channel.impl()->lane().rma_is_messages() || s.gpu_slot || (n > 0 && detail::gpu_memory(local));
  // The receiver reads only ranges exported to it: export the whole local
  // region once (one control call, remembered per sender). The message form
  // carries the data itself: nothing to export.
  const std::string* export_key = nullptr;  // the key the receiver was given for `local`
  if (n > 0 && !messages) {
    if (!local.rkey || local.rkey->size() > detail::kRecordMaxRkey) {
      throw InvalidArgument("local memory has no usable rkey");
    }
    export_key = &s.exported.key_for(s.channel, local, timeout_s);
  }
  const std::uint64_t seq = s.next_seq;
  // One record in flight: the previous send must have been acknowledged.
  if (s.acked() < seq - 1) {
    ++s.stats.waits_for_ack;
    DevicePort dev(*s.channel.impl()->peer);
    // Like a wait on the request: a long one asks the receiver to ring (§10.4).
    if (!detail::wait_until(
            s.channel.impl(), nullptr, [&] { return s.acked() >= seq - 1; }, timeout_s, dev, s.inbox,
            &detail::announce_sender_nap<detail::DynamicSenderImpl>, &s)) {
      s.channel.impl()->check_usable();
      throw Timeout("dynamic slot: the receiver has not taken the previous tensor within " + std::to_string(timeout_s) +
                    " s; nothing of this tensor was sent");
    }
  }
  detail::DynamicRecord rec;
  rec.spec = spec;
  rec.nbytes = n;
  if (auto dev = DevicePort(*s.channel.impl()->peer)) rec.device_id = dev.id();
  std::shared_ptr<std::pair<Request, Request>> posted;
  if (messages) {
    // One message: the record (inline form) as header, the tensor as payload.
    std::string record(s.record_size, '\0');
    record.resize(detail::encode_record(rec, s.max_ndim, record.data(), detail::RecordForm::kInlineData));
    detail::DataHeader h;
    h.kind = detail::MsgKind::kDynamicSend;
    h.target = s.slot_sink;
    h.a = seq;
    RemoteRegion landing = s.gpu_slot ? RemoteRegion() : s.take_landing(seq, n);
    if (landing && s.channel.impl()->can_place(local, landing)) {  // put into the offered block, then the record
      h.b = detail::kPlacedSend;
      posted = std::make_shared<std::pair<Request, Request>>(
          s.channel.impl()->put_then_message(local, offset, landing, 0, n, h, std::move(record)), Request());
      ++s.stats.placed;
    } else {
      posted = std::make_shared<std::pair<Request, Request>>(
          s.channel.impl()->send_message(h, record, &local, offset, n), Request());
    }
  } else {
    // Build the record in registered memory, then write it.
    rec.address = reinterpret_cast<std::uint64_t>(static_cast<char*>(local.address) + offset);
    if (n) rec.rkey = *export_key;
    const std::size_t record_bytes = detail::encode_record(rec, s.max_ndim, static_cast<char*>(s.record_src.data()));
    Request body = s.channel.write(s.record_src.region(), 0, s.record, 0, record_bytes);
    *static_cast<std::uint64_t*>(s.seq_src.data()) = seq;
    Request flag = s.channel.write_ordered(s.seq_src.region(), 0, s.record, s.record_size - 64, 8);
    // The word was set in place (shared memory): ring a receiver that naps.
    if (flag.state() > 0 &&
        detail::ring_if_napping(static_cast<char*>(s.ack.data()) + detail::DynamicSlotImpl::kNappingAt, s.channel,
                                s.slot_sink, seq)) {
      ++s.stats.doorbells;
    }
    posted = std::make_shared<std::pair<Request, Request>>(std::move(body), std::move(flag));
  }
  s.next_seq = seq + 1;
  ++s.stats.sent;
  s.stats.bytes += n;
  // Completes on the receiver's ack; keeps the local memory alive until then.
  auto impl = self;
  auto* state = new detail::RequestState(s.channel.impl()->worker, 1);
  state->local_owner = local.owner;
  if (!messages) {  // the ack is a one-sided write: ask to be rung
    state->announce = &announce_sender_nap<DynamicSenderImpl>;
    state->announce_ctx = impl.get();  // alive: the poller holds it
  }
  // Over a message-form lane the ack is a message, an event of this worker:
  // the wait may sleep on its fd (a GPU tensor's ack over shared memory is a
  // one-sided write, no event).
  state->poller_evented = s.channel.impl()->lane().rma_is_messages();
  state->poller = [posted, impl, seq, state]() {
    // state(), not test(): the waiter (or the progress thread) progresses.
    for (Request* r : {&posted->first, &posted->second}) {
      if (r->state() < 0) {
        state->complete_error(r->error_kind(), r->error_message());
        return true;
      }
    }
    if (impl->acked() < seq) {
      if (impl->channel.impl()->failed()) {
        try {
          impl->channel.impl()->check_usable();
        } catch (const Error& e) {
          state->complete_error(e.kind(), e.what());
          return true;
        }
      }
      return false;
    }
    std::uint64_t status = impl->status();
    if (status == detail::kAccepted) {
      state->complete_ok();
    } else {
      ++impl->stats.rejected;
      state->complete_error(status == detail::kPoolExhausted ? ErrorKind::kPoolExhausted : ErrorKind::kInvalidArgument,
                            std::string("the receiver refused the tensor: ") + detail::describe_record_status(status));
    }
    return true;
  };
  return Request(state);
}

}  // namespace detail

SlotStats DynamicSender::stats() const { return impl_->stats; }
RemoteRegion DynamicSender::region() const { return impl_->record; }

}  // namespace tensorwire
