// Copyright tensorwire authors.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "bindings.h"
#include "py_types.h"

namespace tensorwire::py {

namespace {

PyBlock& live(PyBlock& b) {
  if (!b.block) throw InvalidArgument("this block was released");
  return b;
}

int block_getbuffer(PyObject* exporter, Py_buffer* view, int flags) {
  PyBlock* b = nb::inst_ptr<PyBlock>(exporter);
  if (!b->block) {
    PyErr_SetString(PyExc_BufferError, "tensorwire block was released");
    view->obj = nullptr;
    return -1;
  }
  if (b->block.memory_type() != MemoryType::kHost) {
    // The CPU must not dereference GPU memory: view it through DLPack (torch.from_dlpack).
    PyErr_SetString(PyExc_BufferError, "this tensorwire block is GPU memory: view it with torch.from_dlpack(block)");
    view->obj = nullptr;
    return -1;
  }
  view->buf = b->block.data();
  view->obj = exporter;
  Py_INCREF(exporter);
  view->len = static_cast<Py_ssize_t>(b->nbytes);
  view->readonly = 0;
  view->itemsize = static_cast<Py_ssize_t>(b->itemsize);
  view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>(b->format.c_str()) : nullptr;
  if ((flags & PyBUF_ND) == PyBUF_ND) {
    view->ndim = static_cast<int>(b->buffer_shape.size());
    view->shape = b->buffer_shape.data();
  } else {
    // Without ND the consumer reads plain bytes.
    view->ndim = 1;
    view->shape = nullptr;
    view->itemsize = 1;
  }
  view->strides = nullptr;  // C-contiguous
  view->suboffsets = nullptr;
  view->internal = nullptr;
  return 0;
}

void block_releasebuffer(PyObject*, Py_buffer*) {}

PyType_Slot block_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(block_getbuffer)},
    {Py_bf_releasebuffer, reinterpret_cast<void*>(block_releasebuffer)},
    {0, nullptr},
};

nb::ndarray<> make_array(nb::handle self, PyBlock& b, bool as_numpy = false) {
  live(b);
  const nb::dlpack::dtype dtype = as_numpy ? numpy_dtype(b.dtype.code, b.dtype.bits) : b.dtype;
  const bool gpu = b.block.memory_type() == MemoryType::kCuda;
  if (gpu && as_numpy) throw InvalidArgument("this block is GPU memory: view it with torch.from_dlpack(block)");
  return nb::ndarray<>(b.block.data(), b.shape.size(), reinterpret_cast<const std::size_t*>(b.shape.data()), self,
                       nullptr, dtype, gpu ? nb::device::cuda::value : nb::device::cpu::value, gpu ? b.block.gpu() : 0);
}

}  // namespace

std::string memory_name(MemoryType type, int gpu) {
  return type == MemoryType::kCuda ? "cuda:" + std::to_string(gpu) : std::string("host");
}

nb::dlpack::dtype numpy_dtype(std::uint8_t code, std::uint8_t bits) {
  if (code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat)) return nb::dtype<std::uint16_t>();
  return nb::dlpack::dtype{code, bits, 1};
}

PyBlock fill_view(PyBlock b, const TensorSpec& spec) {
  // The spec comes off the wire: its size is checked (TensorSpec::nbytes) and
  // must fit the block, or numpy/DLPack views would reach past the lease.
  const std::size_t nbytes = spec.nbytes();
  if (b.block && nbytes > b.block.size()) {
    throw ProtocolMismatch("a received tensor " + spec.describe() + " of " + std::to_string(nbytes) +
                           " bytes does not fit its block of " + std::to_string(b.block.size()) + " bytes");
  }
  b.shape = spec.shape;
  b.buffer_shape.assign(spec.shape.begin(), spec.shape.end());
  b.dtype = nb::dlpack::dtype{spec.dtype.code, spec.dtype.bits, 1};
  b.itemsize = spec.dtype.itemsize();
  b.nbytes = nbytes;
  b.format = spec.dtype.format();  // the dtype table (protocol/dtype.cc); valid: nbytes() checked it
  return b;
}

LocalRegion local_region_of(nb::handle obj) {
  if (nb::isinstance<PyBlock>(obj)) {
    // The tensor view, not the (rounded-up) lease: a write of a Block moves
    // exactly the bytes numpy/torch see.
    PyBlock& b = live(nb::cast<PyBlock&>(obj));
    LocalRegion r = b.block.region();
    r.length = b.nbytes;
    return r;
  }
  if (nb::isinstance<Registration>(obj)) return nb::cast<Registration&>(obj).region();
  throw InvalidArgument(
      "local memory must be a tensorwire Block (device.alloc/empty) or a Registration "
      "(device.register)");
}

void bind_memory(nb::module_& m) {
  nb::class_<PyBlock>(m, "Block", nb::type_slots(block_slots),
                      "Registered pool memory. numpy/torch view it zero-copy (DLPack, buffer protocol).")
      .def_prop_ro(
          "nbytes", [](PyBlock& b) { return live(b).nbytes; }, "Bytes of the tensor view.")
      .def_prop_ro(
          "capacity", [](PyBlock& b) { return live(b).block.size(); }, "Bytes leased from the pool.")
      .def_prop_ro("ptr", [](PyBlock& b) { return reinterpret_cast<std::uintptr_t>(live(b).block.data()); })
      .def_prop_ro("shape", [](PyBlock& b) { return live(b).shape; })
      .def_prop_ro("format", [](PyBlock& b) { return b.format; })
      .def_prop_ro("released", [](PyBlock& b) { return !b.block; })
      .def_prop_ro(
          "memory", [](PyBlock& b) { return memory_name(live(b).block.memory_type(), b.block.gpu()); },
          "Where the bytes live: 'host' or 'cuda:<gpu>'.")
      .def(
          "descriptor",
          [](PyBlock& b) {
            RegionDescriptor d = live(b).block.descriptor();
            if (b.nbytes) d.length = b.nbytes;  // the view, as publish() advertises it
            std::string s = d.to_bytes();
            return nb::bytes(s.data(), s.size());
          },
          "The region descriptor a peer needs to reach this block (bytes).")
      .def(
          "numpy",
          [](nb::handle self) {
            return nb::ndarray<nb::numpy>(make_array(self, nb::cast<PyBlock&>(self), /*as_numpy=*/true));
          },
          "A numpy array viewing this block (zero copy; keeps the block alive).")
      .def("__dlpack__",
           [](nb::handle self, nb::kwargs kwargs) {
             // Fix: an ndarray<> without a framework casts to a bare DLPack capsule, which
             // has no __dlpack__ (np.from_dlpack(block) failed). nb::array_api casts to
             // nanobind's nb_ndarray, whose __dlpack__ takes the standard kwargs
             // (max_version, dl_device, copy, stream).
             nb::object arr = nb::cast(nb::ndarray<nb::array_api>(make_array(self, nb::cast<PyBlock&>(self))));
             return arr.attr("__dlpack__")(**kwargs);
           })
      .def("__dlpack_device__",
           [](PyBlock& b) {
             // kDLCUDA (2) with the GPU's ordinal for GPU memory, kDLCPU (1) otherwise.
             if (live(b).block.memory_type() == MemoryType::kCuda) return nb::make_tuple(2, b.block.gpu());
             return nb::make_tuple(1, 0);
           })
      .def(
          "release", [](PyBlock& b) { b.block = Block(); },
          "Returns the memory to the pool now. Views taken earlier must not be used afterwards.")
      .def("__len__", [](PyBlock& b) { return live(b).nbytes; })
      .def("__repr__", [](PyBlock& b) {
        if (!b.block) return std::string("<tensorwire.Block released>");
        return "<tensorwire.Block " + std::to_string(b.nbytes) + " bytes format=" + b.format +
               " memory=" + memory_name(b.block.memory_type(), b.block.gpu()) + ">";
      });

  nb::class_<Registration>(m, "Registration", nb::dynamic_attr(), "Outside memory registered with a device.")
      .def_prop_ro("nbytes", &Registration::size)
      .def_prop_ro("ptr", [](Registration& r) { return reinterpret_cast<std::uintptr_t>(r.data()); })
      .def_prop_ro(
          "memory", [](Registration& r) { return memory_name(r.memory_type(), r.gpu()); },
          "Where the bytes live: 'host' or 'cuda:<gpu>'.")
      .def("descriptor", [](Registration& r) {
        std::string s = r.descriptor().to_bytes();
        return nb::bytes(s.data(), s.size());
      });

  nb::class_<RemoteRegion>(m, "RemoteRegion", "A peer's region, as returned by channel.lookup().")
      .def_prop_ro("address", &RemoteRegion::address)
      .def_prop_ro("nbytes", &RemoteRegion::length)
      .def_prop_ro("device_id", [](RemoteRegion& r) { return r.descriptor().device_id; })
      .def_prop_ro(
          "memory",
          [](RemoteRegion& r) {
            return r.descriptor().memory_type == MemoryType::kCuda ? std::string("cuda") : std::string("host");
          },
          "Where the peer's bytes live: 'host' or 'cuda' (the peer's GPU ordinal is not sent).")
      .def("descriptor",
           [](RemoteRegion& r) {
             std::string s = r.descriptor().to_bytes();
             return nb::bytes(s.data(), s.size());
           })
      .def("__repr__",
           [](RemoteRegion& r) { return "<tensorwire.RemoteRegion " + std::to_string(r.length()) + " bytes>"; });

  m.def(
      "cuda_info",
      [] {
        const CudaInfo info = cuda_info();
        nb::dict out;
        out["available"] = info.available;
        out["reason"] = info.reason;
        out["driver_version"] = info.driver_version;
        nb::list names;
        for (const auto& name : info.devices) names.append(name);
        out["devices"] = names;
        return out;
      },
      "What the CUDA driver offers: available, reason (when not), driver_version, devices (names).");

  m.def(
      "parse_descriptor",
      [](nb::bytes b) {
        RegionDescriptor d = RegionDescriptor::from_bytes(b.c_str(), b.size());
        nb::dict out;
        out["version"] = RegionDescriptor::kVersion;
        out["device_id"] = d.device_id;
        out["address"] = d.address;
        out["nbytes"] = d.length;
        out["memory_type"] = static_cast<int>(d.memory_type);
        out["rkey_bytes"] = d.rkey.size();
        return out;
      },
      "Decodes a region descriptor (raises on malformed input).");
}

}  // namespace tensorwire::py
