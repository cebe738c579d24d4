// Copyright tensorwire authors.
//
// RAII wrappers over ucp handles. Every wrapper is non-copyable and keeps its
// parent alive (a worker its context, an rkey its endpoint), so handles can be
// released in any order — Python's garbage collector picks the order.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tensorwire/error.h"

namespace tensorwire::ucx {

// UCX_TLS for a `transport` shortcut (auto: none, the environment decides).
std::vector<std::pair<std::string, std::string>> transport_overrides(const std::string& transport);

// Throws the Error that matches a failed UCX status.
void check(ucs_status_t status, const std::string& what);
ErrorKind error_kind(ucs_status_t status);
// The packed address of `worker` (ucp_worker_get_address), as bytes.
std::string worker_address(ucp_worker_h worker);

// The private area UCX reserves in every request (ucp_params.request_size):
// the completion race between the poster and the callback is settled here.
struct RequestSlot {
  std::atomic<std::uintptr_t> state;  // 0: nobody attached, kSlotDone, or a RequestState*
  ucs_status_t status;
};
constexpr std::uintptr_t kSlotDone = 1;

class Context {
 public:
  // `overrides` are UCX configuration pairs ("TLS", "tcp"), applied after the
  // environment is read.
  Context(const std::vector<std::pair<std::string, std::string>>& overrides, std::uint64_t features, const char* name);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ucp_context_h get() const { return handle_; }
  std::string transports() const;  // the TLS setting in force
  // Whether the TLS setting admits shared-memory transports (which can map
  // UCX-allocated memory of a same-host peer).
  bool has_shared_memory() const;
  // Whether a transport whose remote keys the hardware enforces (verbs RC,
  // DC, UD, SRD) is among this context's resources: only there does a key of
  // exactly the exported range keep a peer out of the rest (tcp's emulated
  // RMA ignores keys; shared memory maps by segment).
  bool has_hardware_keys() const;
  // The context's resources as "transport/device" ("tcp/lo", "rc_mlx5/mlx5_0:1").
  std::vector<std::string> resources() const;

 private:
  ucp_context_h handle_ = nullptr;
  std::string tls_;
};

class Worker {
 public:
  explicit Worker(std::shared_ptr<Context> context);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ucp_worker_h get() const { return handle_; }
  int event_fd() const { return event_fd_; }
  std::string address() const;  // packed worker address
  const std::shared_ptr<Context>& context() const { return context_; }
  // Keeps `arg` until the worker is destroyed. For callback arguments UCX may
  // use later than expected: it was seen to call an endpoint's error handler
  // after that endpoint's forced close had completed.
  void keep_until_destroyed(std::shared_ptr<const void> arg);

 private:
  std::shared_ptr<Context> context_;
  ucp_worker_h handle_ = nullptr;
  int event_fd_ = -1;
  std::mutex keep_mu_;
  std::vector<std::shared_ptr<const void>> keep_;  // released after ucp_worker_destroy
};

class MemHandle {
 public:
  enum class Backing {
    kUcx,       // UCX allocates (ucp_mem_map ALLOCATE): shared-memory transports map it
    kRegister,  // register the caller's [address, address+length)
    kHugeAnon,  // we mmap anonymous memory with transparent huge pages, then register
  };
  // `cuda`: the range is GPU memory (registered with that memory type, so
  // UCX need not detect it); `on_unmap` runs after the unmap (frees memory
  // allocated for this handle).
  MemHandle(std::shared_ptr<Context> context, void* address, std::size_t length, Backing backing, bool cuda = false,
            std::function<void()> on_unmap = {});
  ~MemHandle();
  MemHandle(const MemHandle&) = delete;
  MemHandle& operator=(const MemHandle&) = delete;
  ucp_mem_h get() const { return handle_; }
  void* address() const { return address_; }
  std::size_t length() const { return length_; }
  const std::string& packed_rkey() const { return rkey_; }
  bool cuda() const { return cuda_; }

 private:
  std::shared_ptr<Context> context_;
  ucp_mem_h handle_ = nullptr;
  bool cuda_ = false;
  std::function<void()> on_unmap_;
  void* address_ = nullptr;
  std::size_t length_ = 0;
  std::string rkey_;
  void* mapped_ = nullptr;  // memory we mmap'ed ourselves (munmap after unmap)
};

// Whether `packed` has the layout of a UCP packed remote key (md map, memory
// type, one sized entry per md, optional distances) within its length.
bool packed_rkey_well_formed(const std::string& packed);
// Keys this process packs are checked against that layout; if one does not
// fit (another UCX version's format), peers' keys are not checked either.
void note_own_rkey(const std::string& packed);
bool rkey_format_known();

class Endpoint;

class Rkey {
 public:
  Rkey(std::shared_ptr<Endpoint> endpoint, const std::string& packed);
  ~Rkey();
  Rkey(const Rkey&) = delete;
  Rkey& operator=(const Rkey&) = delete;
  ucp_rkey_h get() const { return handle_; }

 private:
  std::shared_ptr<Endpoint> endpoint_;
  ucp_rkey_h handle_ = nullptr;
};

class Endpoint {
 public:
  // Takes ownership of an endpoint created on `worker`.
  Endpoint(std::shared_ptr<Worker> worker, ucp_ep_h handle) : worker_(std::move(worker)), handle_(handle) {}
  // Closes with UCP_EP_CLOSE_FLAG_FORCE: outstanding operations are canceled.
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ucp_ep_h get() const { return handle_; }
  const std::shared_ptr<Worker>& worker() const { return worker_; }
  // Closes now (idempotent); later posts see a null handle.
  void close(bool force);

 private:
  std::shared_ptr<Worker> worker_;
  ucp_ep_h handle_ = nullptr;
};

}  // namespace tensorwire::ucx
