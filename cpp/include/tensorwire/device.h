// Copyright tensorwire authors.
//
// Device: a local endpoint of the fabric (the paper's "device"). It owns a
// UCP context for data, `workers` UCP workers (each with a progress thread
// unless progress is inline), a registered memory pool, a listener on
// host:port and the control plane (HELLO, PUBLISH/LOOKUP, call).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire/channel.h"
#include "tensorwire/memory.h"
#include "tensorwire/region.h"

namespace tensorwire {

enum class ProgressMode {
  kPolling,   // progress threads spin (lowest latency, burns one core per worker)
  kBlocking,  // progress threads sleep on the event fd once idle; waiters spin spin_us first
  kInline,    // no threads: whoever waits drives progress (tests, benchmarks)
};

struct DeviceConfig {
  std::string host = "127.0.0.1";  // listen address; "0.0.0.0" for all
  std::uint16_t port = 0;          // 0 = pick a free port
  int workers = 1;
  ProgressMode progress = ProgressMode::kBlocking;
  unsigned spin_us = 100;          // how long a waiting thread polls before it sleeps
  std::string transport = "auto";  // auto (UCX_TLS as set) | tcp | shm | rdma
  // Transport families the device must offer besides `transport` (a comma
  // list of tcp, shm, rdma, cuda). A named transport or a required family
  // that UCX does not offer here fails the Device with InvalidArgument naming
  // what is missing: a request is never silently served by another transport.
  std::string require;
  std::string net_devices = "auto";  // auto: "lo" when host is loopback
  std::string token;                 // shared secret peers must present in HELLO
  std::size_t slab_size = std::size_t(64) << 20;
  std::size_t pool_limit = std::size_t(16) << 30;
  double connect_timeout_s = 10.0;
  double keepalive_s = 1.0;  // control-plane liveness probe interval
  // A peer that answers no control-plane ping for this long (a stopped or
  // hung process, whose kernel still keeps its sockets open) is declared
  // failed: its pending work fails with PeerFailed.
  double liveness_s = 5.0;
  // Same-host peers: when a shared-memory transport maps the remote region
  // (ucp_rkey_ptr), write/read are a memcpy in the calling thread instead of
  // an operation posted to UCX. Large pool blocks are then allocated as
  // shared memory too, so they can be mapped. The environment variable
  // TENSORWIRE_MAP_SHARED_MEMORY=0|1 overrides it.
  bool map_shared_memory = true;
  std::uint16_t protocol_version = 0;  // 0 = ours; tests set another to check refusal
};

namespace detail {
class DeviceImpl;
}

using CallHandler = std::function<std::string(const std::string& payload)>;
// A call handler that learns who called: the device id the caller claimed in
// its HELLO on the connection the call arrived on (never a payload field).
// No two live connections hold one id unless the first one's device vouched
// for the second (docs/contracts.md §11); an id nobody holds is not proven.
using PeerCallHandler = std::function<std::string(std::uint64_t caller, const std::string& payload)>;

class Device {
 public:
  explicit Device(const DeviceConfig& config = {});
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "host:port" that peers pass to connect().
  std::string address() const;
  std::uint64_t id() const;
  const DeviceConfig& config() const;

  // The host pool, or GPU `gpu`'s CUDA arena (made on first use;
  // InvalidArgument without CUDA or for a GPU that does not exist).
  MemoryPool& pool(MemoryType type = MemoryType::kHost, int gpu = 0);
  Block allocate(std::size_t nbytes, std::size_t alignment = 64, MemoryType type = MemoryType::kHost, int gpu = 0) {
    return pool(type, gpu).allocate(nbytes, alignment);
  }

  // Makes `region` findable by peers under `name` (replacing an earlier one).
  void publish(const std::string& name, const RegionDescriptor& region);
  void unpublish(const std::string& name);
  // Registers a handler for Channel::call(name, ...). It runs on a dispatcher
  // thread, never on a progress thread.
  void on_call(const std::string& name, CallHandler handler);
  void on_peer_call(const std::string& name, PeerCallHandler handler);

  // A channel to the device listening at `address` on `lane`. The first call
  // to an address connects (HELLO); later calls reuse the connection.
  Channel connect(const std::string& address, int lane = 0);
  // A channel back to a peer that connected to us, by its device id.
  Channel channel_to(std::uint64_t peer_device_id, int lane = 0);
  std::vector<PeerInfo> peers() const;
  // Blocks until a peer has connected (or timeout: Timeout).
  PeerInfo wait_for_peer(double timeout_s = 10.0);

  // Drives progress on every worker once (for inline mode); returns events.
  unsigned progress();
  // Fails pending work, closes every connection and stops the threads.
  // Blocks, registrations and requests stay safe to touch afterwards (they
  // raise instead of crashing). Idempotent.
  void close();
  bool closed() const;

  // Connections refused (version or token mismatch) since the device started.
  std::uint64_t refusals() const;
  // Text for `tensorwire info`: UCX version, library path, transports.
  std::string describe() const;
  // UCX's data resources here, "transport/device" ("tcp/lo", "posix/memory").
  std::vector<std::string> resources() const;
  detail::DeviceImpl* impl() const noexcept { return impl_.get(); }

 private:
  std::shared_ptr<detail::DeviceImpl> impl_;
};

// The version of the UCX library loaded at run time and where it was loaded
// from (never guess: two UCX builds may be on one machine).
std::string ucx_version();
std::string ucx_library_path();
std::string ucx_header_version();
// What the UCX compiled against cannot do that a newer one can, one sentence
// each (empty from UCX 1.14 on; see ucx/features.h).
std::vector<std::string> ucx_limits();
std::uint16_t protocol_version();
// "tcp", "shm", "rdma", "cuda", "self", or "" for a UCX transport name
// ("rc_mlx5" -> "rdma", "posix" -> "shm", "cuda_ipc" -> "cuda").
std::string transport_family(const std::string& ucx_transport);
// Why transport family `family` is not usable with these UCX resources
// ("transport/device"), or "" when it is.
std::string unusable_reason(const std::vector<std::string>& resources, const std::string& family);

}  // namespace tensorwire
