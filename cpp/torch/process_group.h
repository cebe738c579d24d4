// Copyright tensorwire authors.
//
// ProcessGroupTensorwire: the "tensorwire" torch.distributed backend, a
// c10d::Backend (the shape of ProcessGroupGloo) on tensorwire's message engine
// (tensorwire/messenger.h) and collectives layer (tensorwire/collectives.h).
//
// Each group owns one Device (transport and progress mode as the environment
// asks: docs/torch.md), a Messenger that meets its peers through the c10d
// store torch hands the group (no second rendezvous, no MASTER_PORT needed),
// and a Collectives on it.
//
// Execution (gloo's): a collective is validated on the caller's thread (a bad
// argument throws before any sequence number is taken, so every rank's
// counters stay aligned), then queued to the group's one worker thread, which
// runs the group's collectives one at a time in call order; its Work completes
// there. send/recv skip the queue: send posts the engine's isend and returns
// at once (it never waits for the receive), recv's Work completes through the
// engine's Request. A Work's future completes on its own (outputs as a list
// of tensors, or the error), on the worker or on the group's completion
// thread, never while a backend lock is held.
//
// Failure: an engine error becomes a DistBackendError that names the op and
// the failed peer's rank (Request::failed_rank(), or the engine's message).
// shutdown()/abort() close the Messenger (failing whatever is pending), fail
// the queued Works and join the threads; the destructor does the same.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensorwire/request.h"

namespace tensorwire {
class Device;
class Messenger;
class Collectives;
}  // namespace tensorwire

namespace tensorwire::torch_backend {

class ProcessGroupTensorwire;

// One op's Work. A queued collective completes when the worker ran it; a p2p
// op when its engine Request completes (polled by isCompleted/wait, or pushed
// by the Request's callback once a future was asked for).
class WorkTensorwire : public c10d::Work {
 public:
  WorkTensorwire(ProcessGroupTensorwire* pg, c10d::OpType type, const char* what, std::vector<at::Tensor> outputs,
                 double timeout_s, uint64_t seq);
  ~WorkTensorwire() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return seq_; }

  // Marks the Work done (error: how it failed): runs the copy-back first,
  // wakes waiters, then completes the future (outside every lock). Once.
  void complete(std::exception_ptr error);

 private:
  friend class ProcessGroupTensorwire;
  void complete_from_request();  // p2p: the Request completed

  ProcessGroupTensorwire* pg_;  // for error messages (rank); never used after completion
  int pg_rank_;
  const char* what_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keep_;  // inputs and staging copies the engine reads or writes until done
  std::function<void()> after_;   // copy-back into non-contiguous outputs, on success
  double timeout_s_;
  uint64_t seq_;
  std::atomic<bool> done_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made on first getFuture()
  // p2p only
  bool p2p_ = false;
  bool callback_set_ = false;
  int peer_ = -1;
  int source_ = -1;  // written by the engine (recv from any source) before the Request completes
  tensorwire::Request request_;
  std::vector<c10::intrusive_ptr<WorkTensorwire>> children_;  // endCoalescing's Work: the ops it covers
};

class ProcessGroupTensorwire : public c10d::Backend {
 public:
  // Every rank of the group constructs it with the same store (torch's
  // per-group prefix store) and group id; returns once every peer is reached.
  ProcessGroupTensorwire(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         std::chrono::milliseconds timeout, const std::string& group_id);
  ~ProcessGroupTensorwire() override;

  const std::string getBackendName() const override { return "tensorwire"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  // Sparse COO tensors, SUM (gloo's): torch sends a sparse all_reduce to allreduce(), which hands it here.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions(),
                        bool wait_all_ranks = false) override;

  bool supportsCoalescing() const override { return false; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // FSDP2's set_allocate_memory_from_process_group: buffers from the Device's
  // registered pool (groups of 2+ ranks), freed back to it when torch drops them.
  bool supportsTensorAlloc(c10::DeviceIndex device_index) override { return device_ != nullptr; }
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;

  void setSequenceNumberForGroup() override {}  // every rank starts at 0 (gloo's)
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;

  // Waits (at most timeout_s) until the group's threads are idle and hold no Work, tensor or
  // future: what was queued has run. Called at interpreter exit (tensorwire.torch.backend), so that
  // no thread of the group drops a tensor (a decref that needs the GIL) while Python finalizes.
  // True once idle (or shut down).
  bool quiesce(double timeout_s);
  // quiesce() of every live group, within timeout_s in all.
  static bool quiesce_all(double timeout_s);

  double timeout_s() const { return timeout_s_.load(); }
  // What the group runs on, for tests and `tensorwire info`: transport, progress mode, address.
  std::string describe() const;
  // Engine counters (MessengerStats) and collective calls.
  std::vector<std::pair<std::string, uint64_t>> stats() const;

 private:
  friend class WorkTensorwire;
  using Job = std::function<void()>;

  c10::intrusive_ptr<WorkTensorwire> make_work(c10d::OpType type, const char* what, std::vector<at::Tensor> outputs,
                                               std::chrono::milliseconds timeout, bool collective);
  // Queues `job` (run on the worker; the Work completes when it returns or throws).
  c10::intrusive_ptr<c10d::Work> enqueue(c10::intrusive_ptr<WorkTensorwire> work, Job job);
  c10::intrusive_ptr<c10d::Work> post_p2p(bool is_send, at::Tensor& tensor, int peer, int tag, bool any_source);
  double op_timeout(std::chrono::milliseconds timeout) const;
  void check_open(const char* what) const;
  void run_worker();
  void run_completer();
  void close(bool graceful);
  void defer_completion(c10::intrusive_ptr<WorkTensorwire> work);  // from an engine callback: never blocks
  // allreduce_sparse's job (worker thread): every rank's tensors summed, coalesced.
  at::Tensor sparse_sum(const std::vector<at::Tensor>& tensors, double timeout_s);
  std::exception_ptr as_backend_error(const char* what, std::exception_ptr e) const;

  std::atomic<double> timeout_s_;
  std::string group_id_;
  std::unique_ptr<tensorwire::Device> device_;
  std::unique_ptr<tensorwire::Messenger> messenger_;
  std::unique_ptr<tensorwire::Collectives> coll_;
  std::string progress_, transport_;

  std::atomic<uint64_t> seq_{0};
  uint64_t monitor_round_ = 0;  // monitoredBarrier calls (worker thread only)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<c10::intrusive_ptr<WorkTensorwire>, Job>> queue_;
  std::deque<c10::intrusive_ptr<WorkTensorwire>> completions_;
  std::condition_variable idle_cv_;  // the worker finished a job
  bool running_ = false;             // the worker is running a job
  bool completing_ = false;          // the completion thread is completing a Work
  bool stopping_ = false;            // no more jobs: the worker ends once the queue is empty
  bool completer_stop_ = false;
  std::atomic<bool> closed_{false};  // shut down: queued jobs fail instead of running
  std::thread worker_, completer_;

  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<WorkTensorwire>> coalesced_;
};

}  // namespace tensorwire::torch_backend
