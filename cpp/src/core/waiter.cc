// Copyright tensorwire authors.
#include "core/waiter.h"

#include "tensorwire/wait.h"

#include <poll.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

namespace tensorwire::detail {

void Drivers::add(WorkerCtl* w) {
  if (!w || std::find(workers_, workers_ + n_, w) != workers_ + n_) return;
  if (n_ == kMax) throw InvalidArgument("a wait may drive at most " + std::to_string(kMax) + " workers");
  workers_[n_] = w;
  callers_[n_].emplace(w);
  ++n_;
}

void Drivers::nap(double seconds) {
  if (seconds < 0) seconds = 0;
  if (n_ == 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return;
  }
  if (n_ == 1) {
    workers_[0]->wait_event(seconds);
    return;
  }
  // Several workers: arm each (a busy one has events pending: progress
  // instead of sleeping), then sleep on all their fds at once.
  struct pollfd fds[kMax];
  for (std::size_t i = 0; i < n_; ++i) {
    if (ucp_worker_arm(workers_[i]->get()) != UCS_OK) return;
    fds[i] = {workers_[i]->worker()->event_fd(), POLLIN, 0};
  }
  struct timespec ts{static_cast<time_t>(seconds),
                     static_cast<long>((seconds - static_cast<double>(static_cast<time_t>(seconds))) * 1e9)};
  ::ppoll(fds, n_, &ts, nullptr);
}

std::size_t wait_any(const std::vector<std::shared_ptr<WaitSource>>& sources, double timeout_s) {
  if (sources.empty()) throw InvalidArgument("wait_any: nothing to wait for");
  Drivers drivers;
  // The shortest spin any source asks for, evented only if all are.
  WaitPolicy policy;
  policy.evented = true;
  bool first = true;
  for (auto& s : sources) {
    if (!s) throw InvalidArgument("wait_any: a source is empty");
    WaitPolicy p;
    s->prepare(drivers, p);
    policy.spin = first ? p.spin : std::min(policy.spin, p.spin);
    policy.spin_from_events = policy.spin_from_events && p.spin_from_events;
    policy.evented = policy.evented && p.evented;
    first = false;
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

}  // namespace tensorwire::detail

namespace tensorwire {

std::size_t wait_any(const std::vector<Awaitable>& items, double timeout_s) {
  std::vector<std::shared_ptr<detail::WaitSource>> sources;
  sources.reserve(items.size());
  for (const auto& item : items) sources.push_back(item.source_);
  return detail::wait_any(sources, timeout_s);
}

}  // namespace tensorwire
