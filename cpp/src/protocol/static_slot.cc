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
// A host slot has one more page after its buffers: the shared copy's area
// (SharedCopy below).
#include <cstring>

#include "core/bulk_copy.h"
#include "protocol/dynamic_record.h"
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
      : nbytes(n),
        payload(align64(n)),
        stride(separate_words ? align64(n) : align64(n) + 64),
        separate(separate_words) {}
  std::size_t payload_offset(std::size_t i) const { return i * stride; }
  // In the payload block, or in the word block (64 bytes per word).
  std::size_t seq_offset(std::size_t i) const { return separate ? i * 64 : i * stride + payload; }
  std::size_t seq_stride() const { return separate ? 64 : stride; }
};

// The shared copy (contracts §10.3): where the slot's buffers are mapped at
// the sender (shared memory), a tensor of 256 KiB to 2 MiB is copied by both
// sides at once. The sender offers it in the slot's help area and copies
// chunks into the buffer; a receiver waiting for it in recv() copies other
// chunks out of the sender's memory (exported to it, as a dynamic slot's
// records are), the chunks taken one at a time from a shared counter. The
// sender sets the sequence word once every chunk is in, and its send returns
// only then: no copy reads the tensor afterwards.
// The sender offers only when the receiver has released every earlier tensor:
// a receiver still consuming one overlaps this copy already (a stream), and
// taking chunks only delayed its consumption. Above 2 MiB a tensor the sender
// had just written (its lines dirty in the sender's cache) went erratic,
// 4 MiB often slower than the sender alone (bench/results/shared_copy.txt).
//
// Help area, the page after the buffers (host slots), written by both sides:
//   0   u64 claim: sequence << 24 | the next chunk to take
//   8   u64 done:  sequence << 24 | chunks copied
//   64  u64 the tensor's address in the sender's memory
//   72  u32 its key's length, then the key (a packed rkey, <= 2048 bytes)
struct SharedCopy {
  static constexpr std::size_t kAreaBytes = 4096;
  static constexpr std::size_t kClaimAt = 0, kDoneAt = 8, kAddressAt = 64, kKeyLengthAt = 72, kKeyAt = 76;
  static constexpr int kCountBits = 24;
  static constexpr std::uint64_t kCountMask = (std::uint64_t(1) << kCountBits) - 1;
  static constexpr std::uint64_t kTagMask = ~kCountMask;
  static constexpr std::size_t kMaxBytes = std::size_t(2) << 20;
  static std::uint64_t tag(std::uint64_t seq) { return seq << kCountBits; }
  // Chunks of 64 KiB, at most 16 of them (then larger, in whole pages).
  static std::size_t chunk_bytes(std::size_t n) {
    constexpr std::size_t kMinChunk = std::size_t(64) << 10, kMaxChunks = 16, kPage = 4096;
    return std::max(kMinChunk, ((n + kMaxChunks - 1) / kMaxChunks + kPage - 1) / kPage * kPage);
  }
  static std::uint64_t chunks(std::size_t n) { return (n + chunk_bytes(n) - 1) / chunk_bytes(n); }
  static std::atomic_ref<std::uint64_t> word(char* area, std::size_t at) {
    return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(area + at));
  }
};

class StaticSlotImpl : public MessageSink, public std::enable_shared_from_this<StaticSlotImpl> {
 public:
  StaticSlotImpl(const DevicePort& dev, std::string name, TensorSpec spec, int depth, std::uint64_t first,
                 MemoryType memory, int gpu)
      : device(dev.weak()),
        name(std::move(name)),
        spec(std::move(spec)),
        depth(depth),
        first_seq(first),
        layout(this->spec.nbytes(), memory == MemoryType::kCuda) {
    if (layout.separate) {
      block = allocate_exported(dev.pool(MemoryType::kCuda, gpu), layout.stride * depth);
      words = allocate_exported(dev, 64 * static_cast<std::size_t>(depth));
      std::memset(words.data(), 0, words.size());
    } else {
      help_at = layout.stride * depth;
      block = allocate_exported(dev, help_at + SharedCopy::kAreaBytes);
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
    attaches.fetch_add(1, std::memory_order_release);
    if (help_at) {  // and its offer of a shared copy
      SharedCopy::word(help_area(), SharedCopy::kClaimAt).store(0, std::memory_order_release);
      SharedCopy::word(help_area(), SharedCopy::kDoneAt).store(0, std::memory_order_release);
    }
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
    w.put<std::uint64_t>(help_at);  // the shared copy's area in the block (0: none)
    if (layout.separate) {          // appended: where the sequence words are (§10.3)
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
    if (h.b > kPlacedSend ||
        (placed && (payload.length() != 0 || layout.nbytes < place_from || layout.nbytes > place_to)) ||
        (!placed && payload.length() != layout.nbytes)) {
      return dev.refuse_message("static slot '%s': a tensor of %zu bytes (form %llu), the slot holds %zu", name.c_str(),
                                payload.length(), static_cast<unsigned long long>(h.b), layout.nbytes);
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

  char* help_area() const { return static_cast<char*>(block.data()) + help_at; }
  // The receiving end of the shared copy (SharedCopy): chunks of the next
  // tensor, if its sender offered it, copied out of the sender's memory into
  // its buffer. From recv()'s wait; bounded; tried once per tensor.
  void help_copy();
  // The offered tensor's first byte, mapped here; nullptr unless it lies in
  // memory the attached sender exported to this device and is mapped.
  const char* offered_source(const char* area);
  std::size_t help_at = 0;  // the help area's offset in `block` (0: none, a slot in GPU memory)
  std::uint64_t helped_seq = 0;
  struct {  // the last offered source, mapped (senders send from the same memory again)
    RemoteRegion region;
    std::uint64_t address = 0;
    std::string key;
    const char* mapped = nullptr;
    std::uint64_t attach = 0;  // the attach it was checked for: a new sender's offers are checked anew
  } offered;
  std::atomic<std::uint64_t> attaches{0};  // attach() calls so far

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
  RemoteRegion words;                          // where the sequence words are: `slot` itself, or a host block
  std::size_t seq_at = 0, seq_stride = 0;      // word i at seq_at + i * seq_stride in `words`
  Block ack, seq_src;
  SlotStats stats;

  std::uint64_t acked() const { return load_acquire(ack.data()); }
  // The release's doorbell (contracts §10.3): the flag after the receiver's
  // sequence word 0, which it reaches as mapped memory (nullptr: messages
  // form, or not mapped here).
  std::uint64_t* napping_at_receiver = nullptr;
  std::size_t help_at = 0;  // the slot's help area (SharedCopy; 0: none)
  ExportCache exported;     // the regions the receiver may copy from
  std::string broken;       // why this sender sends nothing more (a shared copy left unfinished)
  // The sending end of the shared copy: tensor `seq` from local[offset..+n)
  // into buffer `idx`, offered to the receiver, copied together. False where
  // it does not apply (the caller copies the usual way).
  bool copy_shared(const LocalRegion& local, std::size_t offset, std::size_t n, std::size_t idx, std::uint64_t seq,
                   double timeout_s);
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
  // While it waits, it copies its part of a tensor its sender offers (the shared copy).
  auto ready = [&] {
    if (s.ready_next()) return true;
    s.help_copy();
    return false;
  };
  if (!detail::wait_until(s.channel(), worker, ready, timeout_s, dev, s.inbox,
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
  if (s.link.channel.impl()->lane().rma_is_messages()) {
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
  s.help_at = r.get<std::uint64_t>();
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
      s.slot.length() < s.stride * s.depth ||
      (s.help_at && (separate || s.help_at % 64 || s.help_at < s.stride * s.depth || s.help_at > s.slot.length() ||
                     s.slot.length() - s.help_at < detail::SharedCopy::kAreaBytes))) {
    throw ProtocolMismatch("static slot '" + name + "' has an inconsistent description");
  }
  detail::store_release(s.ack.data(), released);
  s.seq_src = detail::open_port(channel).pool().allocate(8 * s.depth, 64);
  if (!channel.impl()->lane().rma_is_messages() && s.words.length() >= s.seq_at + 16) {
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
  if (!s.broken.empty()) throw ConnectionError(s.broken);
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
      if (!detail::wait_until(
              s.channel.impl(), nullptr, [&] { return s.acked() >= need; }, timeout_s, dev, s.inbox,
              &detail::announce_sender_nap<detail::StaticSenderImpl>, &s)) {
        s.channel.impl()->check_usable();
        throw Timeout("static slot: the receiver has not released tensor " + std::to_string(need) + " within " +
                      std::to_string(timeout_s) + " s; nothing of this tensor was sent");
      }
    }
  }
  if (s.channel.impl()->lane().rma_is_messages()) {
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
  Request payload;  // complete (none) when the shared copy moved it
  if (!s.copy_shared(local, offset, n, idx, seq, timeout_s)) {
    payload = s.channel.write(local, offset, s.slot, idx * s.stride, n);
  }
  auto* word = static_cast<std::uint64_t*>(s.seq_src.data()) + idx;
  *word = seq;
  // The payload lands before the sequence word.
  Request flag = s.channel.write_ordered(s.seq_src.region(), idx * 8, s.words, s.seq_at + idx * s.seq_stride, 8);
  // The word was set in place (shared memory): ring a receiver that naps.
  if (flag.state() > 0 && detail::ring_if_napping(static_cast<char*>(s.ack.data()) + detail::StaticSlotImpl::kNappingAt,
                                                  s.channel, s.slot_sink, seq)) {
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

bool StaticSenderImpl::copy_shared(const LocalRegion& local, std::size_t offset, std::size_t n, std::size_t idx,
                                   std::uint64_t seq, double timeout_s) {
  using SC = SharedCopy;
  // Offered only to a receiver that released every earlier tensor (SharedCopy).
  if (!help_at || n < shared_copy_min() || n > SC::kMaxBytes || acked() + 1 < seq || !local.rkey ||
      local.rkey->size() > kRecordMaxRkey) {
    return false;
  }
  ChannelImpl* ch = channel.impl();
  const std::size_t at = idx * stride;
  if (!ch->check_rma("send", local, offset, slot, at, n)) return false;
  char* mapped = ch->direct_target(slot, local);
  if (!mapped) return false;
  const std::string& key = exported.key_for(channel, local, timeout_s);  // a call, the first time only
  char* area = mapped + help_at;
  const std::uint64_t tag = SC::tag(seq), address = reinterpret_cast<std::uint64_t>(local.address) + offset;
  const auto key_length = static_cast<std::uint32_t>(key.size());
  std::memcpy(area + SC::kAddressAt, &address, 8);
  std::memcpy(area + SC::kKeyLengthAt, &key_length, 4);
  std::memcpy(area + SC::kKeyAt, key.data(), key.size());
  auto claim = SC::word(area, SC::kClaimAt), done = SC::word(area, SC::kDoneAt);
  done.store(tag, std::memory_order_relaxed);
  claim.store(tag, std::memory_order_release);  // the offer: what it names is written
  const std::size_t chunk = SC::chunk_bytes(n);
  const std::uint64_t count = SC::chunks(n);
  std::uint64_t own = 0;
  for (std::uint64_t round = 0; round < count; ++round) {  // at most every chunk, whatever the receiver writes
    const std::uint64_t c = claim.fetch_add(1, std::memory_order_acq_rel);
    const std::uint64_t k = c & SC::kCountMask;
    if ((c & SC::kTagMask) != tag || k >= count) break;
    ch->direct(true, local, offset + k * chunk, mapped, at + k * chunk, std::min<std::size_t>(chunk, n - k * chunk));
    done.fetch_add(1, std::memory_order_release);
    ++own;
  }
  if (own == count) return true;
  ++stats.shared;
  // The receiver's chunks: each is one copy under way (a few microseconds).
  auto all_in = [&] {
    const std::uint64_t d = done.load(std::memory_order_acquire);
    return (d & SC::kTagMask) == tag && (d & SC::kCountMask) >= count;
  };
  if (!all_in()) {
    DevicePort dev(*ch->peer);
    if (!wait_until(ch, nullptr, all_in, timeout_s, dev, inbox)) {
      ch->check_usable();  // the receiver failed: its error
      broken = "static slot: the receiver did not finish copying its part of tensor " + std::to_string(seq) +
               " within " + std::to_string(timeout_s) +
               " s (shared copy, contracts §10.3); it may still read that tensor's memory, so this sender sends "
               "nothing more";
      throw Timeout(broken);
    }
  }
  return true;
}

const char* StaticSlotImpl::offered_source(const char* area) {
  using SC = SharedCopy;
  const std::uint64_t address =
      std::atomic_ref<const std::uint64_t>(*reinterpret_cast<const std::uint64_t*>(area + SC::kAddressAt))
          .load(std::memory_order_relaxed);
  std::uint32_t key_length = 0;
  std::memcpy(&key_length, area + SC::kKeyLengthAt, 4);
  if (key_length == 0 || key_length > kRecordMaxRkey) return nullptr;
  const char* key = area + SC::kKeyAt;
  const std::uint64_t attach = attaches.load(std::memory_order_acquire);
  if (offered.mapped && offered.attach == attach && offered.address == address && offered.key.size() == key_length &&
      std::memcmp(offered.key.data(), key, key_length) == 0) {
    return offered.mapped;
  }
  RegionDescriptor d;
  d.device_id = link.sender_id;
  d.address = address;
  d.length = layout.nbytes;
  d.rkey.assign(key, key_length);
  try {
    RemoteRegion region = link.channel.remote_region(d);  // only what the sender exported to this device
    // Read through the mapping whatever the lane back's form (an inline
    // receiver's may have chosen messages before its endpoint was wired up).
    const char* mapped = link.channel.impl()->mapping_of(region);
    if (!mapped) return nullptr;
    offered = {std::move(region), address, std::move(d.rkey), mapped, attach};
    return mapped;
  } catch (const Error&) {  // not exported, not mapped, a failed sender: it copies alone
    return nullptr;
  }
}

void StaticSlotImpl::help_copy() {
  using SC = SharedCopy;
  const std::uint64_t seq = first_seq + received;
  if (!help_at || layout.nbytes > SC::kMaxBytes || helped_seq == seq || !link.attached) return;  // never offered
  char* area = help_area();
  auto claim = SC::word(area, SC::kClaimAt), done = SC::word(area, SC::kDoneAt);
  const std::uint64_t tag = SC::tag(seq);
  std::uint64_t c = claim.load(std::memory_order_acquire);
  if ((c & SC::kTagMask) != tag) return;  // not offered (yet)
  helped_seq = seq;
  const std::size_t n = layout.nbytes, chunk = SC::chunk_bytes(n);
  const std::uint64_t count = SC::chunks(n);
  const char* from = offered_source(area);
  if (!from) return;
  char* to = static_cast<char*>(block.data()) + layout.payload_offset(received % depth);
  bool helped = false;
  // Bounded whatever the sender writes: each round takes a chunk or sees another side take one.
  for (std::uint64_t round = 0; round < 4 * count + 4; ++round) {
    if ((c & SC::kTagMask) != tag || (c & SC::kCountMask) >= count) break;
    if (!claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const std::size_t at = (c & SC::kCountMask) * chunk;
    bulk_copy(to + at, from + at, std::min(chunk, n - at));
    done.fetch_add(1, std::memory_order_release);
    helped = true;
    c = claim.load(std::memory_order_acquire);
  }
  if (helped) ++stats.shared;
}

}  // namespace detail

void StaticSender::wait_consumed(std::uint64_t seq, double timeout_s) {
  auto& s = *impl_;
  detail::DevicePort dev(*s.channel.impl()->peer);
  if (!detail::wait_until(
          s.channel.impl(), nullptr, [&] { return s.acked() >= seq; }, timeout_s, dev, s.inbox,
          &detail::announce_sender_nap<detail::StaticSenderImpl>, &s)) {
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
