// Copyright tensorwire authors.
#include "core/waiter.h"

#include "core/channel_impl.h"
#include "tensorwire/wait.h"

#include <poll.h>
#include <sys/prctl.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>

namespace tensorwire::detail {

void Drivers::add(WorkerCtl* w, bool standby) {
  if (!w) return;
  const std::size_t i = static_cast<std::size_t>(std::find(workers_, workers_ + n_, w) - workers_);
  if (i < n_) {
    if (standby_[i] && !standby) {
      standby_[i] = false;
      ++every_round_;
    }
    return;
  }
  if (n_ == kMax) throw InvalidArgument("a wait may drive at most " + std::to_string(kMax) + " workers");
  workers_[n_] = w;
  standby_[n_] = standby;
  callers_[n_].emplace(w);
  ++n_;
  if (!standby) ++every_round_;
}

namespace {
// The calling thread's timer slack set to 1 us while in scope (restored
// after: it is the caller's thread).
class PreciseTimers {
 public:
  explicit PreciseTimers(bool on) {
    if (!on) return;
    const int old = ::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (old > 1000 && ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0) old_ = old;
  }
  ~PreciseTimers() {
    if (old_ > 0) ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_), 0, 0, 0);
  }
  PreciseTimers(const PreciseTimers&) = delete;
  PreciseTimers& operator=(const PreciseTimers&) = delete;

 private:
  int old_ = 0;
};
}  // namespace

void Drivers::nap(double seconds, bool precise) {
  if (seconds < 0) seconds = 0;
  PreciseTimers timers(precise);
  if (n_ == 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return;
  }
  if (n_ == 1) {
    workers_[0]->wait_event(seconds);
    return;
  }
  // Several workers: arm each (a busy one has events pending: progress
  // instead of sleeping), then sleep on all their fds at once, their
  // sockets' included.
  struct pollfd fds[2 * kMax];
  nfds_t n = 0;
  for (std::size_t i = 0; i < n_; ++i) {
    if (ucp_worker_arm(workers_[i]->get()) != UCS_OK) return;
    fds[n++] = {workers_[i]->worker()->event_fd(), POLLIN, 0};
    if (!workers_[i]->sockets().empty()) fds[n++] = {workers_[i]->sockets().fd(), POLLIN, 0};
  }
  struct timespec ts{static_cast<time_t>(seconds),
                     static_cast<long>((seconds - static_cast<double>(static_cast<time_t>(seconds))) * 1e9)};
  ::ppoll(fds, n, &ts, nullptr);
}

std::size_t wait_any(const std::vector<std::shared_ptr<WaitSource>>& sources, double timeout_s) {
  if (sources.empty()) throw InvalidArgument("wait_any: nothing to wait for");
  Drivers drivers;
  // The shortest spin any source asks for, evented only if all are
  // (liveness watches have no say; alone, they get the defaults).
  WaitPolicy policy;
  bool shaped = false;
  for (auto& s : sources) {
    if (!s) throw InvalidArgument("wait_any: a source is empty");
    WaitPolicy p;
    if (!s->prepare(drivers, p)) continue;
    policy.spin = shaped ? std::min(policy.spin, p.spin) : p.spin;
    policy.spin_from_events = shaped ? policy.spin_from_events && p.spin_from_events : p.spin_from_events;
    policy.evented = shaped ? policy.evented && p.evented : p.evented;
    shaped = true;
  }
  // A napping wait asks each source's peer to ring, as each source's own wait would.
  if (std::any_of(sources.begin(), sources.end(), [](const auto& s) { return s->announces(); })) {
    policy.announce = [](void* ctx, bool napping, Drivers* d) {
      for (auto& s : *static_cast<const std::vector<std::shared_ptr<WaitSource>>*>(ctx)) s->announce(napping, d);
    };
    policy.announce_ctx = const_cast<std::vector<std::shared_ptr<WaitSource>>*>(&sources);
  }
  // The index of the first source that is ready (failed), or sources.size().
  auto first_where = [&](bool (WaitSource::*pred)()) {
    std::size_t i = 0;
    while (i < sources.size() && !((*sources[i]).*pred)()) ++i;
    return i;
  };
  std::size_t which = sources.size(), broken = sources.size();
  auto ready = [&] { return (which = first_where(&WaitSource::ready)) < sources.size(); };
  auto failed = [&] { return (broken = first_where(&WaitSource::failed)) < sources.size(); };
  switch (wait_for(drivers, ready, failed, deadline_after(timeout_s), policy)) {
    case WaitEnd::kReady: return which;
    case WaitEnd::kFailed: sources[broken]->throw_failure();
    case WaitEnd::kTimeout: break;
  }
  std::string what;
  for (std::size_t i = 0; i < sources.size() && i < 4; ++i) what += (i ? ", " : "") + sources[i]->describe();
  if (sources.size() > 4) what += " and " + std::to_string(sources.size() - 4) + " more";
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", timeout_s);
  throw Timeout(std::string("wait_any: none became ready within ") + secs + " s (" + what + ")");
}

namespace {

// A liveness watch: never ready, failed once the channel's peer failed.
class ChannelSource : public WaitSource {
 public:
  explicit ChannelSource(Channel channel) : ch_(std::move(channel)) {}
  bool ready() override { return false; }
  bool failed() override { return ch_.impl()->failed(); }
  void throw_failure() override {
    ch_.impl()->check_usable();
    throw ConnectionError("the channel to " + ch_.impl()->peer->describe() + " failed");
  }
  bool prepare(Drivers&, WaitPolicy&) override { return false; }
  std::string describe() override { return "the channel to " + ch_.impl()->peer->describe(); }

 private:
  Channel ch_;
};

// A flag word a peer writes one-sidedly.
class WordSource : public WaitSource {
 public:
  WordSource(LocalRegion local, std::size_t offset, std::uint64_t value, std::optional<Channel> channel)
      : local_(std::move(local)), offset_(offset), value_(value), ch_(std::move(channel)) {}
  bool ready() override {
    const auto* p =
        static_cast<const std::uint64_t*>(static_cast<const void*>(static_cast<const char*>(local_.address) + offset_));
    return std::atomic_ref<const std::uint64_t>(*p).load(std::memory_order_acquire) == value_;
  }
  bool failed() override { return ch_ && ch_->impl()->failed(); }
  void throw_failure() override {
    ch_->impl()->check_usable();
    throw ConnectionError("the channel to " + ch_->impl()->peer->describe() + " failed");
  }
  bool prepare(Drivers& drivers, WaitPolicy& policy) override {
    if (!ch_) return true;  // lands by itself: spin, then watch naps
    ChannelImpl* c = ch_->impl();
    if (c->lane().waiter_drives()) drivers.add(c->worker.get());  // tcp: the target progresses for a put to land
    policy.spin = std::chrono::microseconds(c->worker->spin_us() ? c->worker->spin_us() : 50);
    return true;
  }
  std::string describe() override {
    return "the word at offset " + std::to_string(offset_) + " to become " + std::to_string(value_);
  }

 private:
  LocalRegion local_;
  std::size_t offset_;
  std::uint64_t value_;
  std::optional<Channel> ch_;
};

}  // namespace

}  // namespace tensorwire::detail

namespace tensorwire {

Awaitable::Awaitable(const Channel& channel) : source_(std::make_shared<detail::ChannelSource>(channel)) {
  if (!channel.impl()) throw InvalidArgument("wait_any: an empty channel");
}

Awaitable Awaitable::word(const LocalRegion& local, std::size_t offset, std::uint64_t value, const Channel* channel) {
  if (!local.address) throw InvalidArgument("wait_any: the word's memory is empty");
  if (offset % 8 != 0 || offset > local.length || local.length - offset < 8) {
    throw InvalidArgument("wait_any: a word at offset " + std::to_string(offset) + " of a region of " +
                          std::to_string(local.length) + " bytes (it must be 8-byte aligned and inside)");
  }
  if (reinterpret_cast<std::uintptr_t>(local.address) % 8 != 0) {
    throw InvalidArgument("wait_any: the word's memory is not 8-byte aligned");
  }
  std::optional<Channel> ch;
  if (channel) ch = *channel;
  return Awaitable(std::make_shared<detail::WordSource>(local, offset, value, std::move(ch)));
}

std::size_t wait_any(const std::vector<Awaitable>& items, double timeout_s) {
  std::vector<std::shared_ptr<detail::WaitSource>> sources;
  sources.reserve(items.size());
  for (const auto& item : items) sources.push_back(item.source_);
  return detail::wait_any(sources, timeout_s);
}

}  // namespace tensorwire
