// Copyright tensorwire authors.
//
// DevicePort: the part of a device the protocols may use (its pools, its
// data workers, exports, call handlers, message sinks and refusals). It holds
// the device alive like a shared_ptr; slots that must not keep it alive hold
// a DevicePort::Weak. DeviceImpl stays incomplete here: nothing else of it is
// reachable from the protocols.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "core/channel_impl.h"  // CallFn, Peer, MessageSink, WorkerCtl
#include "tensorwire/device.h"
#include "tensorwire/memory.h"
#include "tensorwire/region.h"

namespace tensorwire::detail {

class DeviceImpl;

class DevicePort {
 public:
  DevicePort() = default;  // empty
  // An open device (ConnectionError when it is closed).
  explicit DevicePort(Device& device);
  // The device `peer` belongs to; empty once that device is gone.
  explicit DevicePort(const Peer& peer);

  // A handle that does not keep the device alive.
  class Weak {
   public:
    Weak() = default;
    DevicePort lock() const;  // empty once the device is gone

   private:
    friend class DevicePort;
    std::weak_ptr<DeviceImpl> impl_;
  };

  explicit operator bool() const { return impl_ != nullptr; }
  Weak weak() const;

  // The operations below need a non-empty port.
  std::uint64_t id() const;
  // The host pool, or GPU `gpu`'s CUDA arena (InvalidArgument without CUDA).
  MemoryPool& pool(MemoryType type = MemoryType::kHost, int gpu = 0) const;
  // Data worker `index`; nullptr when there is none of that index.
  WorkerCtl* worker(int index) const;
  // `d` as exported to `to` (DeviceImpl::export_for).
  RegionDescriptor export_for(RegionDescriptor d, Peer& to) const;
  // Which static tensors this device's slots ask to be placed (DeviceImpl::place_window).
  std::pair<std::uint64_t, std::uint64_t> place_window() const;
  // Sets the handler of call `name`, or removes it (null); ConnectionError once closed.
  void on_call(const std::string& name, CallFn handler) const;
  bool closed() const;
  std::uint64_t add_sink(std::weak_ptr<MessageSink> sink) const;
  void remove_sink(std::uint64_t id) const;
  // Logs (rate-limited) and counts a data message refused by its target.
  void refuse_message(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));

 private:
  explicit DevicePort(std::shared_ptr<DeviceImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<DeviceImpl> impl_;
};

}  // namespace tensorwire::detail
