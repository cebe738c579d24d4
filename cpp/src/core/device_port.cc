// Copyright tensorwire authors.
#include "core/device_port.h"

#include <cstdarg>

#include "core/device_impl.h"

namespace tensorwire::detail {

DevicePort::DevicePort(Device& device) : impl_(device.impl()->shared_from_this()) { impl_->check_open(); }

DevicePort::DevicePort(const Peer& peer) : impl_(peer.device.lock()) {}

DevicePort DevicePort::Weak::lock() const { return DevicePort(impl_.lock()); }

DevicePort::Weak DevicePort::weak() const {
  Weak w;
  w.impl_ = impl_;
  return w;
}

std::uint64_t DevicePort::id() const { return impl_->id; }

MemoryPool& DevicePort::pool(MemoryType type, int gpu) const {
  return type == MemoryType::kCuda ? impl_->cuda_pool(gpu) : *impl_->pool;
}

WorkerCtl* DevicePort::worker(int index) const {
  return index >= 0 && index < static_cast<int>(impl_->workers.size()) ? impl_->workers[index].get() : nullptr;
}

std::pair<std::uint64_t, std::uint64_t> DevicePort::place_window() const { return impl_->place_window(); }

RegionDescriptor DevicePort::export_for(RegionDescriptor d, Peer& to) const {
  return impl_->export_for(std::move(d), to);
}

void DevicePort::on_call(const std::string& name, CallFn handler) const { impl_->on_call(name, std::move(handler)); }

bool DevicePort::closed() const { return impl_->closed(); }

std::uint64_t DevicePort::add_sink(std::weak_ptr<MessageSink> sink) const { return impl_->add_sink(std::move(sink)); }

void DevicePort::remove_sink(std::uint64_t id) const { impl_->remove_sink(id); }

void DevicePort::refuse_message(const char* fmt, ...) const {
  va_list ap;
  va_start(ap, fmt);
  impl_->refuse_message_v(fmt, ap);
  va_end(ap);
}

}  // namespace tensorwire::detail
