// Copyright tensorwire authors. The extension module tensorwire._core.
#include "bindings.h"

#include <cstddef>
#include <cstdint>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "tensorwire/device.h"
#include "tensorwire/memory.h"

NB_MODULE(_core, m) {
  m.doc() = "tensorwire core: devices, registered memory, channels and one-sided transfers over UCX";
  nb::set_leak_warnings(false);  // interpreter teardown order is arbitrary
  tensorwire::py::bind_errors(m);
  tensorwire::py::bind_memory(m);
  tensorwire::py::bind_device(m);
  tensorwire::py::bind_bench(m);
  tensorwire::py::bind_slots(m);
  tensorwire::py::bind_messenger(m);
  tensorwire::py::bind_collectives(m);
  m.def("ucx_version", &tensorwire::ucx_version, "Version of the UCX library loaded at run time.");
  m.def("ucx_library_path", &tensorwire::ucx_library_path, "File the UCX library was loaded from.");
  m.def("ucx_header_version", &tensorwire::ucx_header_version, "UCX API version tensorwire was compiled against.");
  m.def("ucx_limits", &tensorwire::ucx_limits,
        "What the UCX tensorwire was compiled against cannot do that a newer UCX can (empty from 1.14 on).");
  m.def(
      "copy",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes) {
        nb::gil_scoped_release released;
        tensorwire::copy_memory(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
      },
      nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"),
      "Copies nbytes from address src to address dst, without the GIL, as the direct path copies "
      "(`rep movsb` from 64 KiB, streaming stores for the largest copies). The ranges must not overlap.");
  m.def("protocol_version", &tensorwire::protocol_version, "tensorwire control-protocol version.");
  m.attr("ucx_source") = TW_UCX_SOURCE;
}
