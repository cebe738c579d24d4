// Copyright tensorwire authors.
//
// Notifications: a small message that reaches the target after data written
// before it on the same channel is visible there. Not an RPC: each sending
// device has its own static slot at the target (kNotifyDepth entries of
// kNotifyEntry bytes: u32 length + message), made on demand by the target's
// "tw.notify" call; a notification is a static-slot send (entry, fence,
// sequence word), so the fence orders it after the data (contracts §1).
//
// The slot is the target's bounded queue for that sender: it fills whether or
// not the target reads, and holds at most kNotifyDepth unread notifications
// of at most kNotifyMaxMessage bytes each (kNotifyDepth * kNotifyEntry bytes
// of the target's pool per sending device). A sender that finds it full waits
// up to kNotifyFullWaitS for the target to read one, then fails with
// PoolExhausted naming the bound; nothing queued earlier is lost.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensorwire/channel.h"
#include "tensorwire/device.h"

namespace tensorwire {

constexpr std::size_t kNotifyEntry = 256;
constexpr std::size_t kNotifyMaxMessage = kNotifyEntry - 4;
constexpr int kNotifyDepth = 64;          // unread notifications a sender may have at the target
constexpr double kNotifyFullWaitS = 1.0;  // how long a sender waits for room in a full queue

struct Notification {
  std::uint64_t sender = 0;  // the sending device's id (proven when it connected)
  std::string message;
};

// The target side: opens `device` to notifications while it lives. Make it
// with the device, before its address is handed out, and it takes every
// notification from the first connection on (a Python Device has one from
// its start). One per device: a second replaces the first's call handler.
class NotifyInbox {
 public:
  explicit NotifyInbox(Device& device);
  ~NotifyInbox();
  NotifyInbox(const NotifyInbox&) = delete;
  NotifyInbox& operator=(const NotifyInbox&) = delete;
  // Everything that has arrived, in order per sender; never blocks.
  // ConnectionError once the device is closed.
  std::vector<Notification> take();
  // At least one notification, waiting up to `timeout_s` (< 0: forever):
  // Timeout; ConnectionError once the device is closed.
  std::vector<Notification> wait(double timeout_s);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// The sending side of one channel (attaches to the target's slot for this
// device on construction: NotFound when the target has no inbox).
class NotifySender {
 public:
  explicit NotifySender(Channel channel, double timeout_s = 10.0);
  ~NotifySender();
  // Returns once the target's queue for this sender has room, waiting up to
  // `wait_s` for the target to read; PoolExhausted (naming the bound) if it
  // still holds kNotifyDepth unread notifications of this sender.
  void wait_room(double wait_s = kNotifyFullWaitS);
  // Sends `message` (at most kNotifyMaxMessage bytes: InvalidArgument) after
  // every operation posted on the channel before it: wait_room(at most
  // kNotifyFullWaitS), then the send, bounded by `timeout_s`.
  void send(const std::string& message, double timeout_s = 10.0);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorwire
