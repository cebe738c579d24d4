// Copyright tensorwire authors.
#include "tensorwire/notify.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "protocol/slot_common.h"
#include "tensorwire/slot.h"
#include "tensorwire/wait.h"

namespace tensorwire {

namespace {
constexpr const char* kCall = "tw.notify";
constexpr double kSliceS = 0.05;  // a wait looks again for new senders' slots this often

TensorSpec entry_spec() {
  TensorSpec spec;
  spec.shape = {static_cast<std::int64_t>(kNotifyEntry)};
  spec.dtype = DType{1, 8};  // uint8
  return spec;
}
}  // namespace

struct NotifyInbox::Impl {
  Device* device = nullptr;
  std::mutex mu;
  std::map<std::uint64_t, std::unique_ptr<StaticSlot>> slots;  // by sender
};

NotifyInbox::NotifyInbox(Device& device) : impl_(std::make_shared<Impl>()) {
  impl_->device = &device;
  std::weak_ptr<Impl> weak = impl_;
  device.on_peer_call(kCall, [weak](std::uint64_t caller, const std::string&) -> std::string {
    auto in = weak.lock();
    if (!in) throw NotFound("this device takes no notifications");
    char name[64];
    std::snprintf(name, sizeof(name), "%s/%llx", kCall, static_cast<unsigned long long>(caller));
    std::lock_guard<std::mutex> lock(in->mu);
    auto& slot = in->slots[caller];
    if (!slot) slot = std::make_unique<StaticSlot>(*in->device, name, entry_spec(), kNotifyDepth);
    return name;
  });
}

NotifyInbox::~NotifyInbox() {
  try {
    if (!impl_->device->closed()) impl_->device->on_peer_call(kCall, nullptr);
  } catch (const Error&) {  // closing: nothing to stop serving
  }
}

std::vector<Notification> NotifyInbox::take() {
  std::vector<Notification> out;
  if (impl_->device->closed()) throw ConnectionError("device is closed");
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (auto& [sender, slot] : impl_->slots) {
    for (int idx; (idx = slot->poll()) >= 0;) {
      const char* entry = static_cast<const char*>(slot->buffer(idx));
      std::uint32_t n = 0;
      std::memcpy(&n, entry, 4);
      out.push_back({sender, std::string(entry + 4, std::min<std::size_t>(n, kNotifyMaxMessage))});
      slot->release();
    }
  }
  return out;
}

std::vector<Notification> NotifyInbox::wait(double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  while (true) {
    std::vector<Notification> got = take();
    if (!got.empty()) return got;
    const double spent = std::chrono::duration<double>(clock::now() - start).count();
    if (timeout_s >= 0 && spent >= timeout_s) {
      throw Timeout("no notification within " + std::to_string(timeout_s) + " s");
    }
    const double slice = timeout_s < 0 ? kSliceS : std::min(kSliceS, timeout_s - spent);
    std::vector<Awaitable> items;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      for (auto& [sender, slot] : impl_->slots) items.emplace_back(*slot);
    }
    if (items.empty()) {  // no sender yet: nothing to wait on but time (take() sees a close)
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(slice, 0.001)));
      continue;
    }
    try {
      wait_any(items, slice);
    } catch (const Timeout&) {
    }
  }
}

struct NotifySender::Impl {
  std::unique_ptr<StaticSender> sender;
  Block ring;  // one staging entry per slot entry
  std::vector<Request> pending;
  std::uint64_t next = 0;
};

NotifySender::NotifySender(Channel channel, double timeout_s) : impl_(std::make_unique<Impl>()) {
  std::string name;
  try {
    name = channel.call(kCall, "", timeout_s);
  } catch (const NotFound&) {
    throw NotFound(
        "the target takes no notifications: it has no NotifyInbox (a Python Device has one from "
        "its start; a C++ program makes one with its Device)");
  }
  impl_->sender = std::make_unique<StaticSender>(channel, name, timeout_s);
  impl_->ring = detail::open_port(channel).pool().allocate(kNotifyEntry * kNotifyDepth, 64);
  impl_->pending.resize(kNotifyDepth);
}

NotifySender::~NotifySender() = default;

void NotifySender::wait_room(double wait_s) {
  StaticSender& sender = *impl_->sender;
  const std::uint64_t sent = sender.last_sent();
  if (sent < static_cast<std::uint64_t>(kNotifyDepth)) return;
  const std::uint64_t need = sent + 1 - kNotifyDepth;  // its entry is the one the next send reuses
  if (sender.consumed() >= need) return;
  try {
    sender.wait_consumed(need, wait_s);
  } catch (const Timeout&) {
    char waited[32];
    std::snprintf(waited, sizeof(waited), "%g", wait_s);
    throw PoolExhausted("the target's notification queue for this device is full: " + std::to_string(kNotifyDepth) +
                        " unread notifications, the bound per sending device (each " + "at most " +
                        std::to_string(kNotifyMaxMessage) + " bytes), and the target read none within " + waited +
                        " s; this notification was not sent (a write(..., notify=) moved no data either) " +
                        "and the queued ones stay (the target reads them with device.notifications() or " +
                        "next_notification())");
  }
}

void NotifySender::send(const std::string& message, double timeout_s) {
  if (message.size() > kNotifyMaxMessage) {
    throw InvalidArgument("a notification takes at most " + std::to_string(kNotifyMaxMessage) + " bytes, got " +
                          std::to_string(message.size()));
  }
  wait_room(timeout_s < 0 ? kNotifyFullWaitS : std::min(timeout_s, kNotifyFullWaitS));
  auto& s = *impl_;
  const std::size_t k = s.next % kNotifyDepth;
  if (s.pending[k].state() == 0) s.pending[k].wait(timeout_s);  // its last send still reads the entry
  char* entry = static_cast<char*>(s.ring.data()) + k * kNotifyEntry;
  const auto n = static_cast<std::uint32_t>(message.size());
  std::memcpy(entry, &n, 4);
  std::memcpy(entry + 4, message.data(), message.size());
  s.pending[k] = s.sender->send(s.ring.region(), k * kNotifyEntry, entry_spec(), timeout_s);
  ++s.next;
}

}  // namespace tensorwire
