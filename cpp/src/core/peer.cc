// Copyright tensorwire authors.
//
// Peer (core/channel_impl.h): one connected device, its channels by lane, the
// ranges it exported to us (checked before any descriptor of it is used) and
// the ranges of ours it may reach by message (contracts §11).
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "common/log.h"
#include "core/device_impl.h"

namespace tensorwire::detail {

Peer::Peer(std::weak_ptr<DeviceImpl> dev, control::Hello h, std::shared_ptr<net::Conn> cep, bool same_host)
    : device(std::move(dev)), hello(std::move(h)), control_conn(std::move(cep)) {
  info.device_id = hello.device_id;
  info.address = hello.address;
  info.hostname = hello.hostname;
  info.pid = hello.pid;
  info.same_host = same_host;
  info.workers = static_cast<int>(hello.workers.size());
}

std::string Peer::describe() const {
  std::ostringstream os;
  os << "peer " << (hello.address.empty() ? hello.hostname : hello.address) << " (pid " << hello.pid << ")";
  return os.str();
}

std::shared_ptr<ChannelImpl> Peer::channel(int lane) {
  if (lane < 0) throw InvalidArgument("lane must be >= 0, got " + std::to_string(lane));
  auto dev = device.lock();
  if (!dev) throw ConnectionError("device is closed");
  dev->check_open();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed()) throw PeerFailed(describe() + " has failed");
    auto it = channels_.find(lane);
    if (it != channels_.end()) return it->second;
  }
  // Fix: the endpoint is created outside mu_. ucp_ep_create takes the UCX
  // worker lock, and a progress thread holding that lock may call fail()
  // (on_data_ep_error of another lane), which takes mu_: a lock-order
  // inversion (deadlock) that ThreadSanitizer reported.
  // One thread makes a lane, others wait for it (lane_mu_): a second
  // connection made meanwhile and dropped would end its socket, and the
  // peer, seeing its tcp lane close, would fail us.
  std::lock_guard<std::mutex> making(lane_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed()) throw PeerFailed(describe() + " has failed");
    auto it = channels_.find(lane);
    if (it != channels_.end()) return it->second;
  }
  // Lanes spread round-robin over our workers and over the peer's workers.
  auto worker = dev->workers[lane % dev->workers.size()];
  auto ch = std::make_shared<ChannelImpl>(shared_from_this(), lane, worker);
  ch->connect(hello.workers[lane % hello.workers.size()]);
  // Registered under the lock fail() takes: a channel made here is either
  // refused or seen by fail()'s fan-out. (`ch`, declared before the lock, is
  // destroyed after it is released when refused.)
  std::lock_guard<std::mutex> lock(mu_);
  if (failed()) throw PeerFailed(describe() + " has failed");
  return channels_.emplace(lane, ch).first->second;
}

void Peer::add_inbound_lane(std::uint32_t lane, int worker, const std::shared_ptr<net::Conn>& conn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (inbound_lanes_.size() >= kMaxInboundLanes) {  // drop the closed ones; past the bound, dial our own
    for (auto it = inbound_lanes_.begin(); it != inbound_lanes_.end();) {
      auto c = it->second.second.lock();
      it = (!c || c->closed()) ? inbound_lanes_.erase(it) : std::next(it);
    }
    if (inbound_lanes_.size() >= kMaxInboundLanes) return;
  }
  inbound_lanes_[lane] = {worker, conn};
  lane_cv_.notify_all();
}

std::shared_ptr<net::Conn> Peer::lane_from_dialer(int lane, int worker, double timeout_s) {
  if (auto open = inbound_lane(lane, worker)) return open;
  auto dev = device.lock();
  if (!dev) return nullptr;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_s));
  ByteWriter arg;
  arg.put<std::uint32_t>(static_cast<std::uint32_t>(lane));
  ByteWriter body;
  body.put_bytes16(control::kLaneCall);
  body.put_bytes32(arg.str());
  try {
    dev->control_call(shared_from_this(), control::MsgType::kCall, body.str(), timeout_s);
  } catch (const Error& e) {
    TW_LOG_DEBUG("%s did not dial lane %d for us (%s): dialling our own", describe().c_str(), lane, e.what());
    return nullptr;
  }
  // The dialer answered before its lane's introduction reached us on a socket of its own.
  std::unique_lock<std::mutex> lock(mu_);
  std::shared_ptr<net::Conn> found;
  lane_cv_.wait_until(lock, deadline, [&] { return (found = inbound_lane_locked(lane, worker)) || failed(); });
  if (!found && !failed()) {
    TW_LOG_WARN("%s did not open lane %d within %g s: dialling our own", describe().c_str(), lane, timeout_s);
  }
  return found;
}

std::shared_ptr<net::Conn> Peer::inbound_lane(int lane, int worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  return inbound_lane_locked(lane, worker);
}

std::shared_ptr<net::Conn> Peer::inbound_lane_locked(int lane, int worker) const {
  auto it = inbound_lanes_.find(static_cast<std::uint32_t>(lane));
  if (it == inbound_lanes_.end() || it->second.first != worker) return nullptr;
  auto c = it->second.second.lock();
  return c && !c->closed() ? c : nullptr;
}

std::shared_ptr<RemoteRegionImpl> Peer::accept_export(const RegionDescriptor& d) {
  if (d.device_id != hello.device_id) {
    throw InvalidArgument("a region exported by " + describe() + " belongs to another device");
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto& ranges = exports_[d.rkey];
  export_types_[d.rkey] = d.memory_type;
  const std::pair<std::uint64_t, std::uint64_t> range{d.address, d.address + d.length};
  if (std::find(ranges.begin(), ranges.end(), range) == ranges.end()) {
    if (ranges.empty()) export_order_.push_back(d.rkey);
    if (ranges.size() >= kMaxExports) {  // one key for everything (tcp): forget its oldest range
      ranges.erase(ranges.begin());
      --export_count_;
    }
    ranges.push_back(range);
    if (++export_count_ > kMaxExports && export_order_.size() > 1) {
      export_count_ -= exports_[export_order_.front()].size();
      exports_.erase(export_order_.front());
      export_types_.erase(export_order_.front());
      export_order_.pop_front();
    }
  }
  return region_locked(d);
}

bool Peer::exported(const RegionDescriptor& d) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = exports_.find(d.rkey);
  if (it == exports_.end()) return false;
  for (auto [start, end] : it->second) {
    if (d.address >= start && d.address <= end && d.length <= end - d.address) return true;
  }
  return false;
}

void Peer::grant(std::uint64_t address, std::uint64_t length) {
  if (length == 0 || address + length < address) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, fresh] = grants_.emplace(address, Grant{address + length, {}});
  if (!fresh) {
    it->second.end = std::max(it->second.end, address + length);
    return;
  }
  it->second.order = grant_order_.insert(grant_order_.end(), address);
  if (grants_.size() > kMaxExports) {  // bounded: the oldest range is forgotten
    grants_.erase(grant_order_.front());
    grant_order_.pop_front();
  }
}

bool Peer::granted(std::uint64_t address, std::uint64_t length) const {
  if (address + length < address) return false;
  std::lock_guard<std::mutex> lock(mu_);
  // Ranges may nest or overlap: look at every one that starts at or before
  // the address (few: a peer is granted slots and blocks, not bytes).
  for (auto it = grants_.upper_bound(address); it != grants_.begin();) {
    --it;
    if (address + length <= it->second.end) return true;
  }
  return false;
}

void Peer::revoke(std::uint64_t start, std::uint64_t end) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto first = grants_.lower_bound(start), last = grants_.lower_bound(end);
  for (auto it = first; it != last; ++it) grant_order_.erase(it->second.order);
  grants_.erase(first, last);
}

std::shared_ptr<RemoteRegionImpl> Peer::remote_region(const RegionDescriptor& d) {
  if (!exported(d)) {
    char range[64];
    std::snprintf(range, sizeof(range), "[0x%llx, +%llu)", static_cast<unsigned long long>(d.address),
                  static_cast<unsigned long long>(d.length));
    throw InvalidArgument(std::string("the region ") + range + " with this key was not exported by " + describe());
  }
  std::lock_guard<std::mutex> lock(mu_);
  // The memory type the peer declared when it exported the key (a dynamic
  // record carries only address and key).
  RegionDescriptor typed = d;
  if (auto t = export_types_.find(d.rkey); t != export_types_.end()) typed.memory_type = t->second;
  return region_locked(typed);
}

std::shared_ptr<RemoteRegionImpl> Peer::region_locked(const RegionDescriptor& d) {
  std::string key = d.to_bytes();
  auto& slot = regions_[key];
  auto r = slot.lock();
  if (!r) {
    r = std::make_shared<RemoteRegionImpl>(d);
    slot = r;
    if (regions_.size() > sweep_at_) {  // drop dead names, amortized O(1) per insertion
      std::erase_if(regions_, [](const auto& kv) { return kv.second.expired(); });
      sweep_at_ = std::max(2 * kRecentRegions, 2 * regions_.size());
    }
  }
  // Keep the last few alive even when the caller drops them: a sender that
  // sends from the same buffer again then finds its rkey unpacked and, over
  // shared memory, its mapping made and its pages faulted in.
  if (std::find(recent_.begin(), recent_.end(), r) == recent_.end()) {
    recent_.push_back(r);
    if (recent_.size() > kRecentRegions) {
      defer_release(std::move(recent_.front()));  // may run in a UCX callback: no rkey destroy here
      recent_.pop_front();
    }
  }
  return r;
}

void Peer::fail(ErrorKind kind, const std::string& why, bool calls_too) {
  std::vector<std::shared_ptr<ChannelImpl>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.exchange(true)) return;
    for (auto& [lane, ch] : channels_) live.push_back(std::move(ch));
    channels_.clear();
    for (auto& r : recent_) defer_release(std::move(r));  // may run in a UCX callback
    recent_.clear();
  }
  TW_LOG_INFO("%s", why.c_str());
  for (auto& ch : live) {
    ch->fail(kind, why);
    defer_release(std::move(ch));  // often the last reference now, and fail() may run in a UCX callback
  }
  if (auto dev = device.lock()) {
    if (calls_too) dev->fail_pending_control(control_conn.get(), kind, why);
    dev->drop_message_ops(this, why);
  }
}

}  // namespace tensorwire::detail
