// Copyright tensorwire authors.
// TEMPORARY: stands in for the message engine and collectives layer until
// they land (issue 48 items 1-2); built only while cpp/src/protocol/messenger.cc
// is absent. Groups of one rank need neither.
#include "tensorwire/collectives.h"
#include "tensorwire/messenger.h"

namespace tensorwire {

std::unique_ptr<Messenger> make_messenger(Device&, int, int, Rendezvous&, const MessengerConfig&) {
  throw ConnectionError("this build has no message engine yet (issue 48 item 1): groups of one rank only");
}
const char* reduce_op_name(ReduceOp) { return "?"; }
void reduce_into(void*, const void*, std::size_t, DType, ReduceOp) { throw InvalidArgument("no collectives yet"); }
#define TW_PENDING throw ConnectionError("this build has no collectives layer yet (issue 48 item 2)")
void Collectives::allreduce(const Buffer&, std::size_t, DType, ReduceOp, double, double) { TW_PENDING; }
void Collectives::reduce(const Buffer&, std::size_t, DType, ReduceOp, int, double, double) { TW_PENDING; }
void Collectives::broadcast(const Buffer&, int, double) { TW_PENDING; }
void Collectives::allgather(const Buffer&, const Buffer&, double) { TW_PENDING; }
void Collectives::reduce_scatter(const Buffer&, const Buffer&, std::size_t, DType, ReduceOp, double, double) { TW_PENDING; }
void Collectives::gather(const Buffer&, const Buffer&, int, double) { TW_PENDING; }
void Collectives::scatter(const Buffer&, const Buffer&, int, double) { TW_PENDING; }
void Collectives::alltoall(const Buffer&, const std::vector<std::size_t>&, const std::vector<std::size_t>&,
                           const Buffer&, const std::vector<std::size_t>&, const std::vector<std::size_t>&, double) {
  TW_PENDING;
}
void Collectives::barrier(double) { TW_PENDING; }

}  // namespace tensorwire
