// Copyright tensorwire authors.
#include "protocol/staging.h"

#include <chrono>

#include "core/bulk_copy.h"
#include "cuda/driver.h"
#include "tensorwire/error.h"

namespace tensorwire::detail {

namespace {

constexpr std::size_t kStagingAlignment = 4096;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

SenderStaging::Staged SenderStaging::stage(const DevicePort& dev, const OutsideTensor& t, std::size_t nbytes,
                                           SendPath path, double timeout_s) {
  if (!t.data && nbytes > 0) throw InvalidArgument("send: the tensor has no data pointer");
  if (t.memory != MemoryType::kHost && t.memory != MemoryType::kCuda) {
    throw InvalidArgument("send: a tensor must be in host or GPU memory");
  }
  // Registrations whose sends completed go now, on the caller's thread (the
  // keeps may be a binding's objects: never dropped in a completion callback).
  std::erase_if(pinned_, [](Pinned& p) { return p.request.test(); });
  Staged out;
  out.path = nbytes == 0 ? SendPath::kCopy : path;  // nothing to register: an empty send of the staging block
  out.timeout_left = timeout_s;
  const std::size_t n = nbytes > 0 ? nbytes : 1;
  if (out.path == SendPath::kRegister) {
    out.registration = dev.pool().register_memory(const_cast<void*>(t.data), n, t.memory);
    out.local = out.registration.region();
    out.keep = t.keep;
    return out;
  }
  // The previous send may still read the staging block (a dynamic send until
  // the receiver took the tensor): bounded by this send's timeout, whose rest
  // is left for the send itself.
  if (!last_.test()) {
    const auto start = std::chrono::steady_clock::now();
    if (!last_.wait(timeout_s)) {
      throw Timeout(
          "send: the previous send has not finished reading the staging buffer (path='copy') within "
          "the timeout; a dynamic slot's receiver has not taken that tensor yet");
    }
    if (!no_deadline(timeout_s)) out.timeout_left = std::max(0.0, timeout_s - seconds_since(start));
  }
  last_ = RequestRef();
  const bool gpu = t.memory == MemoryType::kCuda;
  if (!block_ || block_.size() < n || block_.memory_type() != t.memory || (gpu && block_.gpu() != t.gpu)) {
    block_ = Block();  // the old one goes back first: the pool may reuse it
    block_ = dev.pool(t.memory, t.gpu).allocate(n, kStagingAlignment);
  }
  if (nbytes > 0) {
    if (gpu || block_.memory_type() == MemoryType::kCuda) {
      cuda::copy(block_.data(), t.data, nbytes);  // synchronous: done before the send reads it
    } else {
      bulk_copy(block_.data(), t.data, nbytes);
    }
  }
  out.local = block_.region();
  return out;
}

void SenderStaging::sent(Staged&& staged, const Request& request, SlotStats& stats) {
  if (staged.path == SendPath::kCopy) {
    ++stats.copies;
    last_ = RequestRef(request);
    return;
  }
  ++stats.registrations;
  pinned_.push_back(Pinned{RequestRef(request), std::move(staged.registration), std::move(staged.keep)});
}

}  // namespace tensorwire::detail
