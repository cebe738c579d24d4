// Copyright tensorwire authors.
//
// tensorwire._c10d: the "tensorwire" c10d backend for Python. Built against
// one torch (TW_TORCH_VERSION); tensorwire.torch checks it at import.
// pybind11 is torch's own copy (holder c10::intrusive_ptr), so the class is
// a subclass of torch's Backend for torch's own bindings.
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "process_group.h"

namespace py = pybind11;
using tensorwire::torch_backend::ProcessGroupTensorwire;

PYBIND11_MODULE(_c10d, m) {
  m.doc() = "The tensorwire torch.distributed backend (a c10d::Backend).";
  py::module_::import("torch.distributed");  // registers c10d's Backend and Store types first
  py::class_<ProcessGroupTensorwire, c10d::Backend, c10::intrusive_ptr<ProcessGroupTensorwire>>(
      m, "ProcessGroupTensorwire")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_id) {
             return c10::make_intrusive<ProcessGroupTensorwire>(store, rank, size, timeout, group_id);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_id") = "",
           py::call_guard<py::gil_scoped_release>(),
           "Meets the group's other ranks through `store` (every rank passes the same store and group id).")
      .def("_set_default_timeout", &ProcessGroupTensorwire::setTimeout, py::arg("timeout"),
           "The group timeout (every op without its own), as ProcessGroupGloo's.")
      .def("_quiesce", &ProcessGroupTensorwire::quiesce, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Waits until the group's threads are idle (what was queued has run); True once they are.")
      .def_property_readonly("timeout_s", &ProcessGroupTensorwire::timeout_s, "The group timeout in seconds.")
      .def("describe", &ProcessGroupTensorwire::describe, "Transport, progress mode and address of this group.")
      .def(
          "stats",
          [](ProcessGroupTensorwire& pg) {
            py::dict d;
            for (const auto& [k, v] : pg.stats()) d[py::str(k)] = v;
            return d;
          },
          "The engine's counters (eager and placed sends, unexpected messages, collective calls).");
  m.def("_quiesce_all", &ProcessGroupTensorwire::quiesce_all, py::arg("timeout_s"),
        py::call_guard<py::gil_scoped_release>(),
        "Waits until every live group's threads are idle (interpreter exit); True once they are.");
  m.attr("torch_version") = TW_TORCH_VERSION;
}
