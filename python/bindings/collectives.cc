// Copyright tensorwire authors.
//
// tensorwire._core.Collectives: the C++ collectives layer
// (tensorwire/collectives.h) on a _core.Messenger, for Python. Calls take
// contiguous caller memory by address (with the object that holds it, kept
// while the engine may touch it: after a failed call a request can outlive
// the call) and block with the GIL released. Errors are the core's: a failed
// peer is PeerFailed naming the rank, a peer that does not answer in time
// Timeout naming it. World's tensor collectives and the torch backend run on
// this one layer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bindings.h"
#include "py_messenger.h"
#include "tensorwire/collectives.h"

namespace tensorwire::py {
namespace {

ReduceOp op_of(const std::string& name) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kBand,
                      ReduceOp::kBor, ReduceOp::kBxor, ReduceOp::kAvg, ReduceOp::kPremulSum}) {
    if (name == reduce_op_name(op)) return op;
  }
  throw InvalidArgument("unknown reduce op '" + name +
                        "'; known: sum, product, min, max, band, bor, bxor, avg, premul_sum");
}

AllreduceAlgorithm algorithm_of(const std::string& name) {
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::kAuto, AllreduceAlgorithm::kDoubling, AllreduceAlgorithm::kRing}) {
    if (name == allreduce_algorithm_name(a)) return a;
  }
  throw InvalidArgument("unknown allreduce algorithm '" + name + "'; known: auto, doubling, ring");
}

struct PyCollectives {
  // The layer holds a reference to the engine: this keeps the object alive even after
  // Messenger.close() (which ends it: later calls raise ConnectionError).
  std::shared_ptr<Messenger> messenger;
  PyMessenger* owner = nullptr;  // its Python object (kept alive by keep_alive): closed or not
  std::unique_ptr<Collectives> coll;
  std::mutex busy;  // one call at a time (the tags are counted per object)

  // The layer, once the messenger is known open (a one-rank call would not touch it).
  Collectives& get() {
    owner->get();
    return *coll;
  }
  ~PyCollectives() {
    nb::gil_scoped_release release;  // the last reference may end the engine, whose thread may need the GIL
    coll.reset();
    messenger.reset();
  }
};

}  // namespace

void bind_collectives(nb::module_& m) {
  nb::class_<PyCollectives>(m, "Collectives",
                            "Collective operations on a Messenger (the C++ layer, tensorwire/collectives.h): "
                            "blocking calls every rank makes in the same order with matching sizes.")
      .def(
          "__init__",
          [](PyCollectives* self, PyMessenger& messenger) {
            std::shared_ptr<Messenger> engine = messenger.m;
            if (!engine) throw ConnectionError("messenger: closed");
            new (self) PyCollectives();
            self->messenger = engine;
            self->owner = &messenger;
            self->coll = std::make_unique<Collectives>(*engine);
          },
          nb::arg("messenger"), nb::keep_alive<1, 2>(),  // (its Python object closes the engine when it goes)
          "The collectives of the messenger's group. One per Messenger: two would take each other's messages.")
      .def_prop_ro("rank", [](PyCollectives& c) { return c.get().rank(); })
      .def_prop_ro("size", [](PyCollectives& c) { return c.get().size(); })
      .def_prop_ro(
          "calls", [](PyCollectives& c) { return c.get().calls(); }, "Calls made so far.")
      .def_prop_ro(
          "small_allreduce_limit", [](PyCollectives& c) { return c.get().small_allreduce_limit(); },
          "allreduce up to this many bytes takes recursive doubling, larger the ring "
          "(64 KiB, or TENSORWIRE_COLL_SMALL_BYTES when this object was made).")
      .def(
          "allreduce_algorithm",
          [](PyCollectives& c, std::size_t count, const std::string& dtype) {
            return std::string(allreduce_algorithm_name(c.get().allreduce_algorithm(count, DType::from_name(dtype))));
          },
          nb::arg("count"), nb::arg("dtype"), "What allreduce's 'auto' takes for count elements: 'doubling' or 'ring'.")
      .def(
          "allreduce",
          [](PyCollectives& c, std::uintptr_t ptr, std::size_t count, const std::string& dtype, const std::string& op,
             nb::handle keep, std::uintptr_t base, std::size_t base_bytes, double timeout, const std::string& algorithm,
             double factor) {
            const DType dt = DType::from_name(dtype);
            const ReduceOp rop = op_of(op);
            const AllreduceAlgorithm alg = algorithm_of(algorithm);
            Buffer b = buffer_of(ptr, count * dt.itemsize(), keep, base, base_bytes);
            Collectives& layer = c.get();
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(c.busy);
            layer.allreduce(b, count, dt, rop, factor, timeout, alg);
          },
          nb::arg("ptr"), nb::arg("count"), nb::arg("dtype"), nb::arg("op") = "sum", nb::arg("keep") = nb::none(),
          nb::arg("base") = 0, nb::arg("base_bytes") = 0, nb::arg("timeout") = -1.0, nb::arg("algorithm") = "auto",
          nb::arg("factor") = 1.0,
          "In place: the count elements of `dtype` at ptr become op over every rank's (op: sum, product, min, "
          "max, band, bor, bxor, avg, premul_sum; what a dtype supports: docs/collectives.md). algorithm: "
          "'auto' (by size), 'doubling' or 'ring', the same on every rank. timeout < 0: the messenger's.")
      .def(
          "alltoall",
          [](PyCollectives& c, std::uintptr_t in_ptr, std::uintptr_t out_ptr, std::size_t block_bytes,
             nb::handle in_keep, nb::handle out_keep, double timeout) {
            Collectives& layer = c.get();
            const int p = layer.size();
            const std::size_t total = block_bytes * static_cast<std::size_t>(p);
            if (p && total / static_cast<std::size_t>(p) != block_bytes)
              throw InvalidArgument("alltoall: size overflows");
            Buffer in = buffer_of(in_ptr, total, in_keep, 0, 0);
            Buffer out = buffer_of(out_ptr, total, out_keep, 0, 0);
            std::vector<std::size_t> offsets(p), bytes(p, block_bytes);
            for (int i = 0; i < p; ++i) offsets[i] = block_bytes * static_cast<std::size_t>(i);
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(c.busy);
            layer.alltoall(in, offsets, bytes, out, offsets, bytes, timeout);
          },
          nb::arg("in_ptr"), nb::arg("out_ptr"), nb::arg("block_bytes"), nb::arg("in_keep") = nb::none(),
          nb::arg("out_keep") = nb::none(), nb::arg("timeout") = -1.0,
          "Block r (block_bytes at in_ptr + r * block_bytes) goes to rank r; block s of out comes from rank s. "
          "in and out must not overlap.")
      .def(
          "broadcast",
          [](PyCollectives& c, std::uintptr_t ptr, std::size_t nbytes, int root, nb::handle keep, std::uintptr_t base,
             std::size_t base_bytes, double timeout) {
            Buffer b = buffer_of(ptr, nbytes, keep, base, base_bytes);
            Collectives& layer = c.get();
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(c.busy);
            layer.broadcast(b, root, timeout);
          },
          nb::arg("ptr"), nb::arg("nbytes"), nb::arg("root"), nb::arg("keep") = nb::none(), nb::arg("base") = 0,
          nb::arg("base_bytes") = 0, nb::arg("timeout") = -1.0, "In place: root's nbytes at ptr on every rank.")
      .def(
          "barrier",
          [](PyCollectives& c, double timeout) {
            Collectives& layer = c.get();
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(c.busy);
            layer.barrier(timeout);
          },
          nb::arg("timeout") = -1.0, "Returns once every rank has entered it (a dissemination barrier).");
}

}  // namespace tensorwire::py
