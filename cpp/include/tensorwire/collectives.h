// Copyright tensorwire authors.
//
// Collectives: one layer of collective operations on a Messenger, used by the
// torch.distributed backend and World alike. Each call is blocking (the
// backend runs it on its own thread) and every rank of the group must make the
// same calls in the same order with matching sizes (the caller's contract, as
// in MPI); a call's messages carry negative tags counted per call, so a call
// never takes another call's messages and users' tags (>= 0) never meet them.
//
// Algorithms are chosen by size (docs/collectives.md, "The C++ collectives
// layer"): recursive doubling for all_reduce up to 64 KiB, reduce-scatter +
// all-gather on a ring above; reduce by a binomial tree, or above 64 KiB a
// ring reduce-scatter and the blocks to the root; broadcast by a binomial
// tree, or from 512 KiB on 3+ ranks a scatter + ring all-gather; ring
// all-gather and reduce-scatter; gather/scatter direct; pairwise all-to-all;
// a dissemination barrier.
//
// Buffers: the caller's memory is sent from and received into directly (as
// sub-ranges keeping Buffer::base/keep); inputs that must stay unchanged
// (reduce's non-roots, reduce_scatter's `in`) are only read. `out` may be
// `in`'s own block in allgather, gather, scatter and reduce_scatter; all_to_all
// refuses overlapping in and out.
//
// One Collectives per Messenger, used by one thread at a time: the tags are
// counted per object, so two objects on one Messenger would take each other's
// messages.
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
  kBand,  // integers and bool
  kBor,
  kBxor,
  kAvg,        // sum, then divided by the group size (floating and complex dtypes)
  kPremulSum,  // each rank's input multiplied by `factor` first, then summed
};

const char* reduce_op_name(ReduceOp op);

// How allreduce combines: kAuto chooses by size (allreduce_algorithm); the
// others force one (measurements: `tensorwire bench allreduce --algorithm`).
enum class AllreduceAlgorithm {
  kAuto,
  kDoubling,  // recursive doubling: ceil(log2 p) rounds of the whole vector
  kRing,      // reduce-scatter + all-gather on a ring: 2(p-1) rounds of 1/p
};

const char* allreduce_algorithm_name(AllreduceAlgorithm a);  // "auto", "doubling", "ring"

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
  // `algorithm` must be the same on every rank.
  void allreduce(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, double factor = 1.0,
                 double timeout_s = -1, AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto);
  // What kAuto takes for `count` elements of `dtype` in this group: kDoubling
  // up to small_allreduce_limit() bytes or below one element per rank, else kRing.
  AllreduceAlgorithm allreduce_algorithm(std::size_t count, DType dtype) const;
  std::size_t small_allreduce_limit() const { return small_bytes_; }
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
  class Call;               // one call's tag, deadline and posted requests (collectives.cc)
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
  void reduce_large(const Buffer& data, std::size_t count, DType dtype, ReduceOp op, int root, bool premul,
                    double factor, Call& call);
  // Ring reduce-scatter of src's blocks; returns the offset of this rank's result in kRecv.
  std::size_t ring_reduce_scatter(const Buffer& src, const std::vector<std::size_t>& offsets,
                                  const std::vector<std::size_t>& bytes, DType dtype, ReduceOp op, Call& call);
  void broadcast_tree(const Buffer& data, int root, Call& call);
  void broadcast_scatter_allgather(const Buffer& data, int root, Call& call);
  // Ring all-gather of the blocks [offsets[i], +bytes[i]) of `data`, rank i's block its own.
  void ring_allgather(const Buffer& data, const std::vector<std::size_t>& offsets,
                      const std::vector<std::size_t>& bytes, Call& call);

  // all_reduce up to this many bytes takes recursive doubling, larger the
  // ring: 64 KiB, or TENSORWIRE_COLL_SMALL_BYTES when set (measurements).
  static std::size_t small_allreduce_bytes();
  Messenger& m_;
  std::uint64_t calls_ = 0;
  std::size_t small_bytes_ = small_allreduce_bytes();
  Scratch scratch_[kAreas];
};

}  // namespace tensorwire
