// Copyright tensorwire authors.
//
// Static placement. Receiver block layout, `depth` buffers of `stride` bytes:
//   buffer i at i*stride: payload (nbytes, padded to 64) | u64 sequence | pad to 64
// A slot in GPU memory keeps the payloads there (stride = the padded
// payload) and the sequence words in a host block, one per 64-byte line, so
// that polling stays a CPU load (the paper's GPUDirect layout).
// Sender: ack block, u64 "last released sequence" written by the receiver;
// one u64 sequence source word per buffer.
// Attach: the sender calls "tw.static/<name>" with its device id and the ack
// word's descriptor; the reply describes the slot (see encode_static_meta).
#include <cstring>

#include "protocol/slot_common.h"
#include "protocol/staging.h"
#include "tensorwire/wait.h"

namespace tensorwire {

std::size_t TensorSpec::nbytes() const {
  if (!dtype.valid()) throw InvalidArgument("unsupported dtype " + dtype.name());
  std::size_t n = dtype.itemsize();
  for (auto d : shape) {
    if (d < 0) throw InvalidArgument("negative dimension in shape " + describe());
    if (d != 0 && n > (std::size_t(1) << 62) / static_cast<std::size_t>(d)) {
      throw InvalidArgument("tensor " + describe() + " is too large");
    }
    n *= static_cast<std::size_t>(d);
  }
  return n;
}

std::string TensorSpec::describe() const {
  std::string s = dtype.name() + "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace detail {

namespace {
constexpr std::size_t kMaxNdim = 64;

std::string encode_spec(const TensorSpec& spec) {
  ByteWriter w;
  w.put<std::uint8_t>(spec.dtype.code);
  w.put<std::uint8_t>(spec.dtype.bits);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(spec.shape.size()));
  for (auto d : spec.shape) w.put<std::int64_t>(d);
  return std::move(w.str());
}

TensorSpec decode_spec(ByteReader& r) {
  TensorSpec s;
  s.dtype.code = r.get<std::uint8_t>();
  s.dtype.bits = r.get<std::uint8_t>();
  auto n = r.get<std::uint32_t>();
  if (n > kMaxNdim) throw InvalidArgument("slot description with too many dimensions");
  for (std::uint32_t i = 0; i < n; ++i) s.shape.push_back(r.get<std::int64_t>());
  s.nbytes();  // validates
  return s;
}
}  // namespace

struct StaticLayout {
  std::size_t nbytes = 0, payload = 0, stride = 0;
  bool separate = false;  // sequence words in their own (host) block
  StaticLayout(std::size_t n, bool separate_words)
      : nbytes(n), payload(align64(n)), stride(separate_words ? align64(n) : align64(n) + 64),
        separate(separate_words) {}
  std::size_t payload_offset(std::size_t i) const { return i * stride; }
  // In the payload block, or in the word block (64 bytes per word).
  std::size_t seq_offset(std::size_t i) const { return separate ? i * 64 : i * stride + payload; }
  std::size_t seq_stride() const { return separate ? 64 : stride; }
};

class StaticSlotImpl : public MessageSink, public std::enable_shared_from_this<StaticSlotImpl> {
 public:
  StaticSlotImpl(const DevicePort& dev, std::string name, TensorSpec spec, int depth, std::uint64_t first,
                 MemoryType memory, int gpu)
      : device(dev.weak()), name(std::move(name)), spec(std::move(spec)), depth(depth), first_seq(first),
        layout(this->spec.nbytes(), memory == MemoryType::kCuda) {
    if (layout.separate) {
      block = allocate_exported(dev.pool(MemoryType::kCuda, gpu), layout.stride * depth);
      words = allocate_exported(dev, 64 * static_cast<std::size_t>(depth));
      std::memset(words.data(), 0, words.size());
    } else {
      block = allocate_exported(dev, layout.stride * depth);
      std::memset(block.data(), 0, block.size());
    }
    ack_src = dev.pool().allocate(8 * kAckRing, 64);
    ack_pending.resize(kAckRing);
  }

  std::string attach(const std::shared_ptr<Peer>& caller, const std::string& payload) {
    auto dev = device.lock();
    if (!dev) throw ConnectionError("device is closed");
    const std::uint64_t got = received, done = consumed;
    link.attach(caller, payload, 8, "static slot '" + name + "'");
    // Forget what anyone but this sender (a failed one, a peer that wrote
    // without attaching) left in buffers not yet received; held ones stay.
    for (std::uint64_t k = got; k < done + depth; ++k) store_release(const_cast<void*>(seq_word(k % depth)), 0);
    store_release(sender_napping(), 0);  // and a failed sender's napping flag
    arrived = got;  // the message form continues from the next tensor too
    ByteWriter w;
    w.put_raw(encode_spec(spec));
    w.put<std::uint32_t>(static_cast<std::uint32_t>(depth));
    w.put<std::uint64_t>(first_seq);
    w.put<std::uint64_t>(first_seq + got);       // the next sequence the slot waits for
    w.put<std::uint64_t>(first_seq + done - 1);  // the last released one
    w.put<std::uint64_t>(layout.stride);
    w.put<std::uint64_t>(layout.payload);
    w.put_bytes32(dev.export_for(block.descriptor(), *caller).to_bytes());
    w.put<std::uint64_t>(sink.id);
    const auto [place_from, place_to] = place_window(dev);  // the sizes its sender places (§12)
    w.put<std::uint64_t>(place_from);
    w.put<std::uint64_t>(place_to);
    if (layout.separate) {  // appended: where the sequence words are (§10.3)
      w.put<std::uint64_t>(layout.seq_stride());
      w.put_bytes32(dev.export_for(words.descriptor(), *caller).to_bytes());
    }
    return std::move(w.str());
  }

  // The message form of a send: the payload goes straight into its buffer
  // (UCX's rendezvous fetches a large one there), then the sequence word is
  // set, as the RMA form's second write would.
  void on_message(const std::shared_ptr<Peer>& from, const DataHeader& h, ByteReader&, Incoming& payload,
                  int worker_index) override {
    const DevicePort dev =
        accept_slot_message(device, link, "static slot", name, from, h, MsgKind::kStaticSend, inbox, worker_index);
    if (!dev) return;
    const std::uint64_t seq = h.a, next = first_seq + arrived.load();
    // In order, and never into a buffer the receiver still holds.
    if (seq != next || seq >= first_seq + consumed_.load(std::memory_order_acquire) + depth) {
      return dev.refuse_message("static slot '%s': tensor %llu out of turn (next %llu)", name.c_str(),
                                static_cast<unsigned long long>(seq), static_cast<unsigned long long>(next));
    }
    const bool placed = h.b == kPlacedSend;
    const auto [place_from, place_to] = place_window(dev);
    if (h.b > kPlacedSend || (placed && (payload.length() != 0 || layout.nbytes < place_from ||
                                         layout.nbytes > place_to)) ||
        (!placed && payload.length() != layout.nbytes)) {
      return dev.refuse_message("static slot '%s': a tensor of %zu bytes (form %llu), the slot holds %zu",
                                name.c_str(), payload.length(), static_cast<unsigned long long>(h.b),
                                layout.nbytes);
    }
    inbox.store(worker_index, std::memory_order_relaxed);
    arrived.fetch_add(1);
    const std::size_t idx = (seq - first_seq) % depth;
    void* word = const_cast<void*>(seq_word(idx));
    if (placed) {  // its sender's put landed before this header was sent (§12)
      store_release(word, seq);
      return;
    }
    payload.receive_into(
        static_cast<char*>(block.data()) + layout.payload_offset(idx), block.region().memh,
        [word, seq](bool ok) {
          if (ok) store_release(word, seq);
        },
        shared_from_this());
  }

  // The tensor sizes this slot asks its sender to place (§12): its device's
  // window for a host slot, none for one in GPU memory.
  std::pair<std::uint64_t, std::uint64_t> place_window(const DevicePort& dev) const {
    return layout.separate ? std::pair<std::uint64_t, std::uint64_t>{1, 0} : dev.place_window();
  }

  volatile void* seq_word(std::size_t i) const {
    return static_cast<char*>(layout.separate ? words.data() : block.data()) + layout.seq_offset(i);
  }
  // The release's doorbell (§10.3): the sender's napping flag, the u64 after
  // sequence word 0 (in its 64-byte line in both layouts).
  void* sender_napping() const { return const_cast<char*>(static_cast<volatile char*>(seq_word(0))) + 8; }

  bool ready_next() const {
    if (!link.attached) return false;  // only the attached sender's tensors count
    std::size_t idx = received % depth;
    return load_acquire(const_cast<void*>(seq_word(idx))) == first_seq + received;
  }

  ChannelImpl* channel() const { return link.channel_impl(); }

  // The doorbell (contracts §10.3): its flag is word 1 of the sender's ack block.
  static constexpr std::size_t kNappingAt = 8;
  Doorbell doorbell;

  // For wait_any (SlotSource): a full slot is ready too, so that recv() says why at once.
  bool wait_ready() const { return received - consumed >= static_cast<std::uint64_t>(depth) || ready_next(); }
  std::string describe_wait() const {
    return "static slot '" + name + "': tensor " + std::to_string(first_seq + received);
  }

  DevicePort::Weak device;
  std::string name;
  TensorSpec spec;
  int depth;
  std::uint64_t first_seq;
  StaticLayout layout;
  Block block, ack_src;
  Block words;  // the sequence words of a slot in GPU memory (host memory)
  SenderLink link;
  std::uint64_t received = 0, consumed = 0;
  std::atomic<std::uint64_t> consumed_{0};  // `consumed`, for the message handler
  std::atomic<std::uint64_t> arrived{0};    // tensors placed by the message handler
  std::atomic<int> inbox{-1};               // the worker messages arrive on
  std::atomic<std::uint64_t> pending_release{0};
  std::atomic<bool> release_queued{false};
  SinkRegistration sink;

  // A deferred release (message form): the latest released sequence.
  void send_release() {
    release_queued.store(false, std::memory_order_seq_cst);
    if (!link.attached) return;
    link.notify(MsgKind::kStaticRelease, pending_release.load(std::memory_order_acquire), 0);
  }
  SlotStats stats;
  // Ack writes in flight, one per source word: release() does not wait for
  // them (over tcp a write completes only once the sender progresses, and a
  // sender that is done sending may not), only before reusing a word.
  static constexpr std::size_t kAckRing = 64;
  std::vector<Request> ack_pending;
};

class StaticSenderImpl : public MessageSink {
 public:
  // The receiver's release in the message form.
  void on_message(const std::shared_ptr<Peer>& from, const DataHeader& h, ByteReader&, Incoming&,
                  int worker_index) override {
    if (!accept_sender_message(channel, "static sender", from, h, MsgKind::kStaticRelease, inbox, worker_index)) return;
    // Monotonic: a release never takes back an earlier one.
    std::atomic_ref<std::uint64_t> word(*static_cast<std::uint64_t*>(ack.data()));
    std::uint64_t cur = word.load(std::memory_order_relaxed);
    while (h.a > cur && !word.compare_exchange_weak(cur, h.a, std::memory_order_release)) {
    }
  }

  Channel channel;
  std::uint64_t slot_sink = 0;
  std::atomic<int> inbox{-1};
  SinkRegistration sink;
  RemoteRegion slot;
  TensorSpec spec;
  int depth = 0;
  std::uint64_t first_seq = 1, next_seq = 1;
  std::size_t stride = 0, payload = 0;
  std::uint64_t place_from = 1, place_to = 0;  // the tensor sizes the slot asks to be placed (§12)
  RemoteRegion words;           // where the sequence words are: `slot` itself, or a host block
  std::size_t seq_at = 0, seq_stride = 0;  // word i at seq_at + i * seq_stride in `words`
  Block ack, seq_src;
  SlotStats stats;

  std::uint64_t acked() const { return load_acquire(ack.data()); }
  // The release's doorbell (contracts §10.3): the flag after the receiver's
  // sequence word 0, which it reaches as mapped memory (nullptr: messages
  // form, or not mapped here).
  std::uint64_t* napping_at_receiver = nullptr;
  void check_spec(const TensorSpec& given) const;  // InvalidArgument unless it is the slot's
  // One tensor from local[offset..]: StaticSender::send without its accounting of the source.
  Request send(const LocalRegion& local, std::size_t offset, const TensorSpec& given, double timeout_s);
};

}  // namespace detail

// ---- StaticSlot ----

StaticSlot::StaticSlot(Device& device, const std::string& name, const TensorSpec& spec, int depth,
                       std::uint64_t first_seq, MemoryType memory, int gpu) {
  if (depth < 1 || depth > 1024) throw InvalidArgument("depth must be in 1..1024, got " + std::to_string(depth));
  if (first_seq == 0) throw InvalidArgument("first_seq must be >= 1");
  if (spec.shape.size() > 64) throw InvalidArgument("at most 64 dimensions");
  if (detail::StaticLayout(spec.nbytes(), false).stride > (std::size_t(1) << 62) / static_cast<std::size_t>(depth)) {
    throw InvalidArgument("static slot '" + name + "': " + std::to_string(depth) + " buffers of " + spec.describe() +
                          " exceed 2^62 bytes");
  }
  detail::DevicePort dev(device);
  impl_ = std::make_shared<detail::StaticSlotImpl>(dev, name, spec, depth, first_seq, memory, gpu);
  impl_->sink.add(dev, impl_);
  detail::serve_attach(dev, "tw.static/" + name, impl_);
}

Awaitable::Awaitable(const StaticSlot& slot)
    : source_(std::make_shared<detail::SlotSource<detail::StaticSlotImpl>>(slot.impl_)) {}

StaticSlot::~StaticSlot() { detail::stop_attach(impl_->device, "tw.static/" + impl_->name); }

int StaticSlot::recv(double timeout_s) {
  auto& s = *impl_;
  if (s.received - s.consumed >= static_cast<std::uint64_t>(s.depth)) {
    throw InvalidArgument("static slot '" + s.name + "': " + std::to_string(s.depth) +
                          " tensors are held; release() one before receiving more");
  }
  auto dev = s.device.lock();
  detail::WorkerCtl* worker = dev ? dev.worker(0) : nullptr;
  if (!detail::wait_until(s.channel(), worker, [&] { return s.ready_next(); }, timeout_s, dev, s.inbox,
                          &detail::announce_nap<detail::StaticSlotImpl>, &s)) {
    if (s.channel() && s.channel()->failed()) s.channel()->check_usable();
    throw Timeout("static slot '" + s.name + "': no tensor (sequence " + std::to_string(s.first_seq + s.received) +
                  ") within " + std::to_string(timeout_s) + " s");
  }
  int idx = static_cast<int>(s.received % s.depth);
  ++s.received;
  ++s.stats.received;
  s.stats.bytes += s.layout.nbytes;
  return idx;
}

int StaticSlot::poll() {
  auto& s = *impl_;
  if (s.received - s.consumed >= static_cast<std::uint64_t>(s.depth)) return -1;
  if (!s.ready_next()) {
    auto dev = s.device.lock();
    if (auto* in = detail::inbox_of(dev, s.inbox)) {
      in->progress();
    } else if (auto* ch = s.channel()) {
      ch->worker->progress();
    }
    if (!s.ready_next()) return -1;
  }
  int idx = static_cast<int>(s.received % s.depth);
  ++s.received;
  ++s.stats.received;
  s.stats.bytes += s.layout.nbytes;
  return idx;
}

void StaticSlot::release() {
  auto& s = *impl_;
  if (s.consumed == s.received) throw InvalidArgument("static slot '" + s.name + "': nothing to release");
  ++s.consumed;
  s.consumed_.store(s.consumed, std::memory_order_release);
  if (!s.link.attached) return;
  // The ack word: the sequence number of the last released tensor.
  const std::uint64_t last = s.first_seq + s.consumed - 1;
  if (s.link.channel.impl()->uses_messages()) {
    // Deferred to the next flush point on the worker (WorkerCtl::defer):
    // the caller's next send goes first. Releases coalesce: only the last
    // counts. Inline progress has no thread that would flush it while the
    // caller does something else (a receiver that then blocks on a pipe left
    // its sender waiting forever): there it goes at once.
    s.pending_release.store(last, std::memory_order_release);
    auto& worker = *s.link.channel.impl()->worker;
    if (worker.mode() == ProgressMode::kInline) {
      s.send_release();
      return;
    }
    // A socket lane: it rides in the caller's next send on that socket (its
    // reply, in a ping-pong), in the same write and segment.
    detail::DataHeader h;
    h.kind = detail::MsgKind::kStaticRelease;
    h.target = s.link.sender_sink;
    h.a = last;
    if (s.link.channel.impl()->ride_message(impl_.get(), h)) return;
    if (!s.release_queued.exchange(true)) {
      std::weak_ptr<detail::StaticSlotImpl> weak = impl_;
      s.link.channel.impl()->worker->defer([weak] {
        if (auto slot = weak.lock()) slot->send_release();
      });
    }
    return;
  }
  const std::size_t word = s.consumed % detail::StaticSlotImpl::kAckRing;
  s.ack_pending[word].wait(10.0);  // the write that last used this source word
  std::memcpy(static_cast<char*>(s.ack_src.data()) + 8 * word, &last, 8);
  s.ack_pending[word] = s.link.channel.write(s.ack_src.region(), 8 * word, s.link.ack, 0, 8);
  // The release's doorbell (§10.3): the sender said it naps, waiting for it.
  if (s.ack_pending[word].state() > 0 &&
      detail::ring_if_napping(s.sender_napping(), s.link.channel, s.link.sender_sink, last)) {
    ++s.stats.doorbells;
  }
}

void* StaticSlot::buffer(int index) const {
  if (index < 0 || index >= impl_->depth) throw InvalidArgument("buffer index out of range");
  return static_cast<char*>(impl_->block.data()) + impl_->layout.payload_offset(index);
}
const TensorSpec& StaticSlot::spec() const { return impl_->spec; }
MemoryType StaticSlot::memory_type() const { return impl_->block.memory_type(); }
int StaticSlot::gpu() const { return impl_->block.gpu(); }
int StaticSlot::depth() const { return impl_->depth; }
std::uint64_t StaticSlot::next_seq() const { return impl_->first_seq + impl_->received; }
SlotStats StaticSlot::stats() const { return impl_->stats; }
bool StaticSlot::has_sender() const { return impl_->link.attached; }

// ---- StaticSender ----

StaticSender::StaticSender(Channel channel, const std::string& name, double timeout_s)
    : impl_(std::make_shared<detail::StaticSenderImpl>()), staging_(std::make_unique<detail::SenderStaging>()) {
  auto& s = *impl_;
  std::string reply = detail::attach_sender(impl_, channel, "tw.static/" + name, timeout_s);
  detail::ByteReader r(reply.data(), reply.size(), "static slot description");
  s.spec = detail::decode_spec(r);
  s.depth = static_cast<int>(r.get<std::uint32_t>());
  s.first_seq = r.get<std::uint64_t>();
  s.next_seq = r.get<std::uint64_t>();
  const std::uint64_t released = r.get<std::uint64_t>();
  s.stride = r.get<std::uint64_t>();
  s.payload = r.get<std::uint64_t>();
  std::string desc = r.get_bytes32();
  s.slot_sink = r.get<std::uint64_t>();
  s.slot = detail::exported_by_peer(channel, desc);
  s.place_from = r.get<std::uint64_t>();
  s.place_to = r.get<std::uint64_t>();
  const bool separate = r.left() > 0;  // a slot in GPU memory: its sequence words come next
  bool words_ok = true;
  if (separate) {
    s.seq_stride = r.get<std::uint64_t>();
    s.words = detail::exported_by_peer(channel, r.get_bytes32());
    s.seq_at = 0;
    words_ok = s.seq_stride >= 8 && s.seq_stride <= 4096 &&
               s.words.length() >= s.seq_stride * static_cast<std::uint64_t>(s.depth - 1) + 8;
  } else {
    s.words = s.slot;
    s.seq_at = s.payload;
    s.seq_stride = s.stride;
  }
  if (s.depth < 1 || s.depth > 1024 || s.first_seq == 0 || s.next_seq < s.first_seq || released + 1 < s.first_seq ||
      released >= s.next_seq || s.payload < s.spec.nbytes() || s.stride < 8 ||
      s.payload > (separate ? s.stride : s.stride - 8) || !words_ok ||
      s.stride > (std::uint64_t(1) << 62) / static_cast<std::uint64_t>(s.depth) ||
      s.slot.length() < s.stride * s.depth) {
    throw ProtocolMismatch("static slot '" + name + "' has an inconsistent description");
  }
  detail::store_release(s.ack.data(), released);
  s.seq_src = detail::open_port(channel).pool().allocate(8 * s.depth, 64);
  if (!channel.impl()->uses_messages() && s.words.length() >= s.seq_at + 16) {
    if (char* base = channel.impl()->direct_target(s.words, s.seq_src.region())) {
      s.napping_at_receiver = reinterpret_cast<std::uint64_t*>(base + s.seq_at + 8);
    }
  }
}

StaticSender::~StaticSender() = default;

Request StaticSender::send(const OutsideTensor& tensor, const TensorSpec& spec, SendPath path, double timeout_s) {
  impl_->check_spec(spec);  // before anything is copied or registered
  detail::DevicePort dev(*impl_->channel.impl()->peer);
  if (!dev) throw ConnectionError("device is closed");
  auto staged = staging_->stage(dev, tensor, spec.nbytes(), path, timeout_s);
  Request req = impl_->send(staged.local, 0, spec, staged.timeout_left);
  staging_->sent(std::move(staged), req, impl_->stats);
  return req;
}

Request StaticSender::send(const LocalRegion& local, std::size_t offset, const TensorSpec& spec, double timeout_s) {
  Request req = impl_->send(local, offset, spec, timeout_s);
  ++impl_->stats.zero_copy;  // only once sent: a refused tensor leaves the stats unchanged
  return req;
}

namespace detail {

void StaticSenderImpl::check_spec(const TensorSpec& given) const {
  if (!(given.dtype == spec.dtype) || given.shape != spec.shape) {
    throw InvalidArgument("the slot holds " + spec.describe() + ", refusing a tensor of " + given.describe());
  }
}

Request StaticSenderImpl::send(const LocalRegion& local, std::size_t offset, const TensorSpec& given,
                               double timeout_s) {
  auto& s = *this;
  check_spec(given);
  const std::size_t n = s.spec.nbytes();
  const std::uint64_t seq = s.next_seq;
  const std::size_t idx = (seq - s.first_seq) % s.depth;
  // Never overwrite a buffer the receiver still holds: it was last used by
  // seq - depth, which must have been released.
  if (seq - s.first_seq >= static_cast<std::uint64_t>(s.depth)) {
    const std::uint64_t need = seq - s.depth;
    if (s.acked() < need) {
      ++s.stats.waits_for_ack;
      DevicePort dev(*s.channel.impl()->peer);
      if (!detail::wait_until(s.channel.impl(), nullptr, [&] { return s.acked() >= need; }, timeout_s,
                              dev, s.inbox, &detail::announce_sender_nap<detail::StaticSenderImpl>, &s)) {
        s.channel.impl()->check_usable();
        throw Timeout("static slot: the receiver has not released tensor " + std::to_string(need) + " within " +
                      std::to_string(timeout_s) + " s; nothing of this tensor was sent");
      }
    }
  }
  if (s.channel.impl()->uses_messages()) {
    // One message: the sequence number and the tensor (contracts §12).
    detail::DataHeader h;
    h.kind = detail::MsgKind::kStaticSend;
    h.target = s.slot_sink;
    h.a = seq;
    if (n > 0 && (offset > local.length || n > local.length - offset)) {
      throw InvalidArgument("tensor range exceeds its local region");
    }
    Request sent;
    if (n >= s.place_from && n <= s.place_to && s.channel.impl()->can_place(local, s.slot)) {
      // The payload put into its buffer, then the header.
      h.b = detail::kPlacedSend;
      sent = s.channel.impl()->put_then_message(local, offset, s.slot, idx * s.stride, n, h);
      ++s.stats.placed;
    } else {
      sent = s.channel.impl()->send_message(h, {}, &local, offset, n);
    }
    s.next_seq = seq + 1;
    ++s.stats.sent;
    s.stats.bytes += n;
    return sent;
  }
  Request payload = s.channel.write(local, offset, s.slot, idx * s.stride, n);
  auto* word = static_cast<std::uint64_t*>(s.seq_src.data()) + idx;
  *word = seq;
  // The payload lands before the sequence word.
  Request flag = s.channel.write_ordered(s.seq_src.region(), idx * 8, s.words, s.seq_at + idx * s.seq_stride, 8);
  // The word was set in place (shared memory): ring a receiver that naps.
  if (flag.state() > 0 &&
      detail::ring_if_napping(static_cast<char*>(s.ack.data()) + detail::StaticSlotImpl::kNappingAt, s.channel,
                              s.slot_sink, seq)) {
    ++s.stats.doorbells;
  }
  s.next_seq = seq + 1;
  ++s.stats.sent;
  s.stats.bytes += n;
  if (payload.state() != 0 && flag.state() != 0) {
    if (payload.state() < 0) payload.wait(0);  // throws its error
    return flag;
  }
  // Either is pending: one request that completes when both did.
  std::vector<Request> both;
  both.push_back(std::move(payload));
  both.push_back(std::move(flag));
  return s.channel.impl()->join(std::move(both));
}

}  // namespace detail

void StaticSender::wait_consumed(std::uint64_t seq, double timeout_s) {
  auto& s = *impl_;
  detail::DevicePort dev(*s.channel.impl()->peer);
  if (!detail::wait_until(s.channel.impl(), nullptr, [&] { return s.acked() >= seq; }, timeout_s,
                          dev, s.inbox, &detail::announce_sender_nap<detail::StaticSenderImpl>, &s)) {
    s.channel.impl()->check_usable();
    throw Timeout("the receiver has not released tensor " + std::to_string(seq) + " within " +
                  std::to_string(timeout_s) + " s");
  }
}

std::uint64_t StaticSender::consumed() const { return impl_->acked(); }
std::uint64_t StaticSender::last_sent() const { return impl_->next_seq - 1; }
RemoteRegion StaticSender::region() const { return impl_->slot; }
const TensorSpec& StaticSender::spec() const { return impl_->spec; }
SlotStats StaticSender::stats() const { return impl_->stats; }

}  // namespace tensorwire
