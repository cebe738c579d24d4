// Copyright tensorwire authors.
//
// Collectives: one layer of collective operations on a Messenger, used by the
// torch.distributed backend and World alike. Each call is blocking (the
// backend runs it on its own thread) and every rank of the group must make the
// same calls in the same order with matching sizes (the caller's contract, as
// in MPI); a call's messages carry negative tags counted per call, so a call
// never takes another call's messages and users' tags (>= 0) never meet them.
//
// Algorithms are chosen by size (docs/collectives.md): recursive doubling for
// small all_reduce, reduce-scatter + all-gather on a ring for large ones, a
// ring all-gather, a binomial tree broadcast, pairwise all-to-all.
//
// Failure: a call fails with the first error of its messages (a failed peer:
// PeerFailed, and Messenger requests name the rank), or Timeout after
// `timeout_s` (< 0: the Messenger's). After a failure the group's calls are
// no longer aligned: the caller must not make further collective calls on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tensorwire/messenger.h"
#include "tensorwire/slot.h"  // DType

namespace tensorwire {

enum class ReduceOp {
  kSum,
  kProduct,
  kMin,
  kMax,
  kBand,      // integers and bool
  kBor,
  kBxor,
  kAvg,       // sum, then divided by the group size (floating and complex dtypes)
  kPremulSum, // each rank's input multiplied by `factor` first, then summed
};

const char* reduce_op_name(ReduceOp op);

// Reduces `count` elements of `src` into `dst` in place (dst = dst op src).
// Every dtype of the one dtype table, complex64/128 for kSum/kProduct; an op
// a dtype does not support (kBand on floats, kMin on complex) throws
// InvalidArgument. kAvg and kPremulSum reduce as kSum here.
void reduce_into(void* dst, const void* src, std::size_t count, DType dtype, ReduceOp op);

class Collectives {
 public:
  explicit Collectives(Messenger& messenger) : m_(messenger) {}
  int rank() const { return m_.rank(); }
  int size() const { return m_.size(); }

  // data (count elements) = op over every rank's data, on every rank.
  // kPremulSum multiplies by `factor` first; kAvg divides by size().
  void allreduce(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, double factor = 1.0,
                 double timeout_s = -1);
  // data at `root` = op over every rank's data; other ranks' data unchanged.
  void reduce(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, int root, double factor = 1.0,
              double timeout_s = -1);
  // root's data.nbytes bytes to every rank's data.
  void broadcast(const Buffer& data, int root, double timeout_s = -1);
  // out = every rank's `in` (in.nbytes each) in rank order (out.nbytes == size() * in.nbytes).
  void allgather(const Buffer& in, const Buffer& out, double timeout_s = -1);
  // out (count elements) = op over every rank's in[rank() * count, +count).
  void reduce_scatter(const Buffer& in, const Buffer& out, std::size_t count, DType dtype, ReduceOp op,
                      double factor = 1.0, double timeout_s = -1);
  // out at root = every rank's `in` in rank order; out is ignored elsewhere.
  void gather(const Buffer& in, const Buffer& out, int root, double timeout_s = -1);
  // out on every rank = root's in[rank() * out.nbytes, +out.nbytes).
  void scatter(const Buffer& in, const Buffer& out, int root, double timeout_s = -1);
  // Rank r sends in[send_offsets[p], +send_bytes[p]) to each p and receives
  // p's block into out[recv_offsets[p], +recv_bytes[p]). Sizes must agree
  // pairwise (send_bytes[p] here == recv_bytes[r] at p).
  void alltoall(const Buffer& in, const std::vector<std::size_t>& send_offsets,
                const std::vector<std::size_t>& send_bytes, const Buffer& out,
                const std::vector<std::size_t>& recv_offsets, const std::vector<std::size_t>& recv_bytes,
                double timeout_s = -1);
  void barrier(double timeout_s = -1);

  std::uint64_t calls() const { return calls_; }

 private:
  class Call;  // one call's tag, deadline and posted requests (collectives.cc)
  std::int64_t next_tag();  // a fresh negative tag for this call
  // Scratch memory kept across calls and grown when a call needs more, so
  // that the engine registers it once (Buffer::base/keep name the whole
  // allocation). kWork holds a working copy (reduce, reduce_scatter,
  // premul_sum), kRecv what arrives before it is reduced.
  enum Area : int { kWork = 0, kRecv = 1, kAreas = 2 };
  struct Scratch {
    std::shared_ptr<std::byte> memory;
    std::size_t bytes = 0;
  };
  // Makes area `a` at least `bytes` long; call before posting anything.
  void reserve(Area a, std::size_t bytes);
  // [offset, +nbytes) of area `a` as the engine's Buffer.
  Buffer scratch(Area a, std::size_t offset, std::size_t nbytes) const;
  void* scratch_data(Area a, std::size_t offset) const;
  // After a failed call, requests may still write the scratch: the next call gets fresh areas.
  void drop_scratch();

  void allreduce_doubling(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, Call& call);
  void allreduce_ring(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, Call& call);
  void broadcast_tree(const Buffer& data, int root, Call& call);
  void broadcast_scatter_allgather(const Buffer& data, int root, Call& call);
  // Ring all-gather of the blocks [offsets[i], +bytes[i]) of `data`, rank i's block its own.
  void ring_allgather(const Buffer& data, const std::vector<std::size_t>& offsets,
                      const std::vector<std::size_t>& bytes, Call& call);

  Messenger& m_;
  std::uint64_t calls_ = 0;
  Scratch scratch_[kAreas];
};

}  // namespace tensorwire
