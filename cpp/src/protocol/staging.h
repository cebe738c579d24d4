// Copyright tensorwire authors.
//
// How a slot sender moves a tensor that lives outside the pool (slot.h,
// OutsideTensor and SendPath): copied into one staging block per sender, in
// the tensor's memory, reused and grown; or registered in place and held
// registered, with the caller's `keep`, until its send completes.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/device_port.h"
#include "core/request_state.h"
#include "tensorwire/slot.h"

namespace tensorwire::detail {

class SenderStaging {
 public:
  // The region to send from, and what sent() records once the send is made.
  struct Staged {
    LocalRegion local;
    SendPath path = SendPath::kCopy;
    Registration registration;         // kRegister: held until the send completes
    std::shared_ptr<const void> keep;  // kRegister: the caller's object, held as long
    double timeout_left = -1.0;        // what the staging wait left of the caller's timeout
  };

  // Stages `nbytes` of `t` by `path`. With kCopy it first waits (within
  // timeout_s; < 0: forever) until the previous send stops reading the
  // staging block, then copies. Nothing is recorded until sent(), so a send
  // refused after staging changes no state.
  Staged stage(const DevicePort& dev, const OutsideTensor& t, std::size_t nbytes, SendPath path, double timeout_s);
  // Records the send made from `staged` and counts it in `stats`.
  void sent(Staged&& staged, const Request& request, SlotStats& stats);

 private:
  struct Pinned {
    RequestRef request;  // the send that still reads the registered memory
    Registration registration;
    std::shared_ptr<const void> keep;
  };
  Block block_;      // the staging block of kCopy
  RequestRef last_;  // the send that still reads block_
  std::vector<Pinned> pinned_;
};

}  // namespace tensorwire::detail
