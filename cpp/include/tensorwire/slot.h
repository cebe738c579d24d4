// Copyright tensorwire authors.
//
// Tensor slots: the paper's two ways to move a tensor with one-sided writes.
//
// Static placement (StaticSlot / StaticSender): the receiver pre-allocates
// `depth` buffers of a known shape and dtype in registered memory, each
// followed by an 8-byte sequence word. The sender writes the payload, FENCES,
// then writes the sequence number; the receiver polls the word. The receiver
// writes its consumed count back into the sender's ack word, and the sender
// never overwrites a buffer that was not consumed.
//
// Dynamic allocation (DynamicSlot / DynamicSender): the receiver pre-allocates
// a fixed-size metadata record (dtype, shape, nbytes, the sender's address and
// rkey, sequence at the tail). The sender writes the record, fences, writes
// the sequence; the receiver validates it, allocates from its pool, RDMA-reads
// the data and acks so the sender may reuse its buffer.
//
// Wire layouts are in docs/contracts.md. Never rely on the NIC writing bytes
// in address order: the fence is the contract.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire/channel.h"
#include "tensorwire/device.h"
#include "tensorwire/memory.h"

namespace tensorwire {

class Awaitable;

// Element type in DLPack terms (code: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool).
struct DType {
  std::uint8_t code = 2;
  std::uint8_t bits = 32;
  bool operator==(const DType&) const = default;
  std::size_t itemsize() const { return bits / 8; }
  bool valid() const;
  std::string name() const;  // "float32", "bfloat16", ...
  // The buffer-protocol format of one element ("f", ...; bfloat16, which has
  // none, as its raw 16-bit word "H"); "" for an unsupported dtype.
  const char* format() const;
  // The supported dtype called `name` ("float32"); InvalidArgument otherwise.
  static DType from_name(const std::string& name);
};

// Every supported dtype, in one table (the core's and Python's).
struct DTypeInfo {
  const char* name;
  DType dtype;
  const char* format;  // buffer-protocol format (bfloat16: its raw word, "H")
};
const std::vector<DTypeInfo>& dtypes();

struct TensorSpec {
  std::vector<std::int64_t> shape;
  DType dtype;
  std::size_t nbytes() const;    // product(shape) * itemsize; throws on overflow
  std::string describe() const;  // "float32[4, 4]"
};

struct SlotStats {
  std::uint64_t sent = 0, received = 0;
  std::uint64_t bytes = 0;
  // How a sender's tensors left: from pool memory (a Block: zero copy),
  // copied into its staging block, or registered in place.
  std::uint64_t copies = 0, registrations = 0, zero_copy = 0;
  std::uint64_t waits_for_ack = 0;  // sends that had to wait for the receiver
  std::uint64_t rejected = 0;       // dynamic records refused by the receiver
  std::uint64_t doorbells = 0;      // wake messages sent to a napping peer (one-sided form, contracts §10.3)
  std::uint64_t placed = 0;         // message-form sends whose payload was put into its buffer (contracts §12)
  std::uint64_t shared = 0;         // static slot tensors whose copy both sides shared (contracts §10.3)
};

// A tensor outside the pool, as the caller hands it to a sender: contiguous
// bytes in host or GPU memory. For GPU memory, the kernels that write it must
// be complete (docs/contracts.md §1.1).
struct OutsideTensor {
  const void* data = nullptr;
  MemoryType memory = MemoryType::kHost;
  int gpu = 0;
  // Held until the send no longer reads `data` (path kRegister), then dropped
  // on a thread that calls into the sender (its next send, or its destructor),
  // never in a completion callback: a language binding may hold its object here.
  std::shared_ptr<const void> keep;
};

// How a sender moves an OutsideTensor: copied into the sender's staging block
// in the tensor's memory (one per sender, reused and grown; the default), or
// registered in place (no copy; the registration and `keep` are held until
// the send completes).
enum class SendPath { kCopy, kRegister };

namespace detail {
class StaticSlotImpl;
class StaticSenderImpl;
class DynamicSlotImpl;
class DynamicSenderImpl;
class SenderStaging;
}  // namespace detail

// ---- static placement ----

class StaticSlot {
 public:
  // `memory` kCuda: the buffers are GPU `gpu`'s memory, their sequence words
  // host memory (polling stays a CPU load).
  StaticSlot(Device& device, const std::string& name, const TensorSpec& spec, int depth = 2,
             std::uint64_t first_seq = 1, MemoryType memory = MemoryType::kHost, int gpu = 0);
  ~StaticSlot();
  // Waits for the next tensor; returns the index of the buffer holding it.
  // At most `depth` tensors may be received and not yet released.
  int recv(double timeout_s = -1.0);
  // Non-blocking: the buffer index, or -1 if the next tensor is not there yet.
  int poll();
  // Marks the oldest received tensor consumed and tells the sender.
  void release();
  void* buffer(int index) const;
  MemoryType memory_type() const;
  int gpu() const;  // -1 for host memory
  const TensorSpec& spec() const;
  int depth() const;
  std::uint64_t next_seq() const;  // the sequence number recv() waits for
  SlotStats stats() const;
  bool has_sender() const;
  // Holds the buffers' memory alive (a view of them may outlive the slot).
  std::shared_ptr<const void> buffers_owner() const { return impl_; }

 private:
  friend class Awaitable;
  std::shared_ptr<detail::StaticSlotImpl> impl_;
};

class StaticSender {
 public:
  // Attaches to the slot `name` on the channel's peer (one sender per slot).
  StaticSender(Channel channel, const std::string& name, double timeout_s = 10.0);
  ~StaticSender();
  // Sends `spec` bytes from local[offset..]; the spec must equal the slot's
  // (InvalidArgument, nothing written). Waits (bounded by timeout_s) while
  // the buffer it would overwrite is not consumed. The returned request
  // completes when the local bytes may be reused.
  Request send(const LocalRegion& local, std::size_t offset, const TensorSpec& spec, double timeout_s = 10.0);
  // Sends a tensor outside the pool by `path` (SendPath). A tensor of another
  // spec is refused before anything is copied; every wait (the staging block
  // still read by the previous send, then the buffer) is within timeout_s.
  Request send(const OutsideTensor& tensor, const TensorSpec& spec, SendPath path, double timeout_s = 10.0);
  // Blocks until the receiver released sequence number `seq` (Timeout).
  void wait_consumed(std::uint64_t seq, double timeout_s);
  std::uint64_t consumed() const;
  std::uint64_t last_sent() const;
  RemoteRegion region() const;  // the slot's memory, exported to this sender by the attach
  const TensorSpec& spec() const;
  SlotStats stats() const;

 private:
  std::shared_ptr<detail::StaticSenderImpl> impl_;
  // Beside impl_, not in it: it holds sends whose completion holds impl_.
  std::unique_ptr<detail::SenderStaging> staging_;
};

// ---- dynamic allocation ----

class DynamicSlot {
 public:
  // `memory` kCuda: received tensors are allocated in GPU `gpu`'s CUDA arena
  // and read there (the record stays in host memory).
  DynamicSlot(Device& device, const std::string& name, int max_ndim = 8, std::size_t max_nbytes = std::size_t(1) << 32,
              MemoryType memory = MemoryType::kHost, int gpu = 0);
  ~DynamicSlot();
  // Waits for the next record, validates it, allocates, reads the data, acks.
  // A record that lies (bad version, unknown dtype, nbytes != product(dims) x
  // itemsize, over max_nbytes) is refused with InvalidArgument: nothing is
  // allocated or read, and the sender's request fails.
  Block recv(TensorSpec* spec, double timeout_s = -1.0);
  // Non-blocking: false if no record is there yet.
  bool poll(Block* out, TensorSpec* spec);
  SlotStats stats() const;
  std::size_t record_size() const;
  std::uint64_t next_seq() const;

 private:
  friend class Awaitable;
  std::shared_ptr<detail::DynamicSlotImpl> impl_;
};

class DynamicSender {
 public:
  DynamicSender(Channel channel, const std::string& name, double timeout_s = 10.0);
  ~DynamicSender();
  RemoteRegion region() const;  // the slot's record, exported to this sender by the attach
  // Describes local[offset..+spec.nbytes()] to the receiver. Waits (bounded)
  // for the previous send's ack first. The request completes on the
  // receiver's ack (the local bytes may then be reused or freed); it fails if
  // the receiver refused the record. local.owner stays alive until then.
  Request send(const LocalRegion& local, std::size_t offset, const TensorSpec& spec, double timeout_s = 10.0);
  // Sends a tensor outside the pool by `path` (as StaticSender::send). With
  // kCopy the staging block is reused only once the receiver took the
  // previous tensor (bounded by timeout_s).
  Request send(const OutsideTensor& tensor, const TensorSpec& spec, SendPath path, double timeout_s = 10.0);
  SlotStats stats() const;

 private:
  std::shared_ptr<detail::DynamicSenderImpl> impl_;
  std::unique_ptr<detail::SenderStaging> staging_;  // as StaticSender's
};

}  // namespace tensorwire
