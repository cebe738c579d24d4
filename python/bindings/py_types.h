// Copyright tensorwire authors.
//
// Python-side holders. A Block carries an optional tensor view (shape and
// dtype) so device.empty(shape, dtype) exports a shaped array through DLPack
// and the buffer protocol.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <string>
#include <vector>

#include "tensorwire/device.h"
#include "tensorwire/notify.h"
#include "tensorwire/slot.h"

namespace nb = nanobind;

namespace tensorwire::py {

struct PyBlock {
  Block block;
  std::vector<std::int64_t> shape;       // DLPack shape
  std::vector<Py_ssize_t> buffer_shape;  // the same, for the buffer protocol
  nb::dlpack::dtype dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt), 8, 1};
  std::string format = "B";  // struct-module format of one element
  std::size_t itemsize = 1;
  std::size_t nbytes = 0;  // bytes of the view (<= block.size())
};

// A local memory operand of write/read: a pool Block or a Registration.
LocalRegion local_region_of(nb::handle obj);

// The dtype a numpy view shows: the tensor's own, but bfloat16 (which numpy
// lacks: nanobind's numpy export of one made a 0-d object array) as its raw
// 16-bit words, as the buffer protocol does. DLPack keeps the true dtype.
nb::dlpack::dtype numpy_dtype(std::uint8_t code, std::uint8_t bits);

// "host" or "cuda:<ordinal>", as Device.empty(memory=...) takes it.
std::string memory_name(MemoryType type, int gpu);

// Gives `b` the tensor view of `spec` (shape, dtype, format, nbytes).
PyBlock fill_view(PyBlock b, const TensorSpec& spec);

struct PyDevice {
  std::unique_ptr<Device> device;
  // Its notifications, open from its start (contracts §1): a waiter holds a
  // reference, so close() may drop it while one waits.
  std::shared_ptr<NotifyInbox> inbox;
  ~PyDevice();
};

}  // namespace tensorwire::py
