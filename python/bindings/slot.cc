// Copyright tensorwire authors. Bindings of the tensor slots (static and
// dynamic). tensorwire/slots.py finds where a Python tensor's bytes are
// (numpy, torch, GPU streams) and the asyncio wait; the core stages them.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "checked.h"
#include "py_types.h"
#include "tensorwire/notify.h"
#include "tensorwire/slot.h"
#include "tensorwire/wait.h"

namespace tensorwire::py {

namespace {

using nb::gil_scoped_release;

TensorSpec make_spec(const std::vector<std::int64_t>& shape, int code, int bits) {
  TensorSpec s;
  s.shape = shape;
  s.dtype.code = static_cast<std::uint8_t>(code);
  s.dtype.bits = static_cast<std::uint8_t>(bits);
  if (!s.dtype.valid()) throw InvalidArgument("unsupported dtype " + s.dtype.name());
  s.nbytes();
  return s;
}

TensorSpec spec_of(const PyBlock& b) { return make_spec(b.shape, b.dtype.code, b.dtype.bits); }

nb::dict stats_dict(const SlotStats& s) {
  nb::dict d;
  d["sent"] = s.sent;
  d["received"] = s.received;
  d["bytes"] = s.bytes;
  d["copies"] = s.copies;
  d["registrations"] = s.registrations;
  d["zero_copy"] = s.zero_copy;
  d["waits_for_ack"] = s.waits_for_ack;
  d["shared"] = s.shared;
  d["rejected"] = s.rejected;
  d["doorbells"] = s.doorbells;
  d["placed"] = s.placed;
  return d;
}

Device& device_of(PyDevice& d) {
  if (!d.device) throw ConnectionError("device is closed");
  return *d.device;
}

// A view of a static slot's buffer, kept alive by the slot: numpy for host
// memory (see numpy_dtype); for GPU memory a DLPack array on that GPU
// (torch.from_dlpack(view)), with the tensor's true dtype.
nb::object slot_view(nb::handle slot_obj, const StaticSlot& slot, int index) {
  // A host buffer's view is the same array every time it comes round: made
  // once per buffer (a numpy array cost a third of a small tensor's one-way
  // time through Python). The views own the buffers' memory, not the slot
  // object that caches them: no reference cycle, and a view outlives its slot
  // safely.
  nb::object cached;
  if (slot.memory_type() != MemoryType::kCuda) {
    cached = nb::getattr(slot_obj, "_views", nb::none());
    if (!PyList_CheckExact(cached.ptr()) || PyList_GET_SIZE(cached.ptr()) != slot.depth()) {
      cached = nb::none();  // (none yet, or something else was stored under the name: made anew)
    } else {
      nb::handle v = PyList_GET_ITEM(cached.ptr(), index);
      if (!v.is_none()) return nb::borrow(v);
    }
  }
  const TensorSpec& spec = slot.spec();
  std::vector<std::size_t> shape(spec.shape.begin(), spec.shape.end());
  void* data = slot.buffer(index);
  if (slot.memory_type() == MemoryType::kCuda) {
    const nb::dlpack::dtype dt{spec.dtype.code, spec.dtype.bits, 1};
    return nb::cast(nb::ndarray<nb::array_api>(data, shape.size(), shape.data(), slot_obj, nullptr, dt,
                                               nb::device::cuda::value, slot.gpu()));
  }
  const nb::dlpack::dtype dt = numpy_dtype(spec.dtype.code, spec.dtype.bits);
  auto* owner = new std::shared_ptr<const void>(slot.buffers_owner());
  nb::capsule keep(owner, [](void* p) noexcept { delete static_cast<std::shared_ptr<const void>*>(p); });
  nb::object view = nb::cast(nb::ndarray<nb::numpy>(data, shape.size(), shape.data(), keep, nullptr, dt));
  if (cached.is_none()) {
    nb::list views;
    for (int i = 0; i < slot.depth(); ++i) views.append(nb::none());
    nb::setattr(slot_obj, "_views", views);
    cached = views;
  }
  PyList_SetItem(cached.ptr(), index, view.inc_ref().ptr());  // (steals the reference)
  return view;
}

struct PyStaticSender {
  std::unique_ptr<StaticSender> sender;
};

struct PyDynamicSender {
  std::unique_ptr<DynamicSender> sender;
};

// A sender's timeout: seconds >= 0, or None for no bound.
double sender_timeout(nb::handle t) { return to_timeout(t, "timeout"); }

// The two senders' shared entry points (PyStaticSender, PyDynamicSender).
template <typename PySender>
Request send_block(PySender& s, PyBlock& b, nb::handle timeout_arg) {
  if (!b.block) throw InvalidArgument("this block was released");
  const double timeout = sender_timeout(timeout_arg);
  TensorSpec spec = spec_of(b);
  LocalRegion local = b.block.region();
  gil_scoped_release r;
  return s.sender->send(local, 0, spec, timeout);
}

// Holds a Python object for the core (OutsideTensor::keep): dropped with the
// GIL taken, on a thread that called into the sender (never a UCX callback).
std::shared_ptr<const void> hold(nb::object obj) {
  return std::shared_ptr<const void>(new nb::object(std::move(obj)), [](const void* p) {
    nb::gil_scoped_acquire gil;
    delete static_cast<const nb::object*>(p);
  });
}

// A contiguous tensor outside the pool, at `address` in host memory (gpu < 0)
// or GPU `gpu`'s memory, kept alive by `owner` while a send reads it.
template <typename PySender>
Request send_outside(PySender& s, std::uintptr_t address, int gpu, nb::handle shape, int code, int bits,
                     const std::string& path, nb::handle timeout_arg, nb::object owner) {
  if (path != "copy" && path != "register") {
    throw InvalidArgument("path must be one of ('copy', 'register'), got '" + path + "'");
  }
  OutsideTensor t;
  t.data = reinterpret_cast<const void*>(address);
  t.memory = gpu < 0 ? MemoryType::kHost : MemoryType::kCuda;
  t.gpu = gpu < 0 ? 0 : gpu;
  // Only a registered tensor is read after send() returns: the copy path needs no keep.
  if (path == "register") t.keep = hold(std::move(owner));
  TensorSpec spec = make_spec(to_shape(shape), code, bits);
  const double timeout = sender_timeout(timeout_arg);
  gil_scoped_release r;
  return s.sender->send(t, spec, path == "copy" ? SendPath::kCopy : SendPath::kRegister, timeout);
}

constexpr const char* kSendOutsideDoc =
    "Sends the contiguous tensor at `address` (host memory when gpu < 0, else that GPU's), of `shape` and "
    "DLPack dtype (code, bits), by `path`: 'copy' into the sender's staging block, or 'register' in place "
    "(held registered, and `owner` alive, until the send completes).";

// A flag word for wait_any (tw.Word): checked when made, kept with its memory.
struct PyWord {
  LocalRegion local;
  std::size_t offset = 0;
  std::uint64_t value = 0;
  std::optional<Channel> channel;
  nb::object memory;  // the Block or Registration: alive while the word is
  Awaitable awaitable() const { return Awaitable::word(local, offset, value, channel ? &*channel : nullptr); }
};

// A slot's recv_async: the coroutine of tensorwire.slots (waits with
// wait_any on an executor thread, takes the tensor on the loop's thread).
nb::object recv_async(nb::handle slot, nb::handle timeout) {
  return nb::module_::import_("tensorwire.slots").attr("_recv_async")(slot, timeout);
}

}  // namespace

void bind_slots(nb::module_& m) {
  nb::class_<StaticSlot>(m, "StaticSlot",
                         "Receiver side of static placement: depth pre-allocated buffers of one shape and dtype.",
                         nb::dynamic_attr())
      .def(
          "__init__",
          [](StaticSlot* self, PyDevice& d, const std::string& name, nb::handle shape_arg, int code, int bits,
             nb::handle depth_arg, nb::handle first_seq_arg, int gpu) {
            TensorSpec spec = make_spec(to_shape(shape_arg), code, bits);
            const int depth = static_cast<int>(to_int(depth_arg, "depth", 1, 1024));
            const std::uint64_t first_seq = to_u64(first_seq_arg, "first_seq");
            // The core leases depth x (payload rounded to 64 B + a 64 B sequence
            // word) unchecked: a product that wraps would lease a short block.
            const std::uint64_t stride = ((spec.nbytes() + 63) & ~std::uint64_t(63)) + 64;
            if (stride > kMaxBytes / static_cast<std::uint64_t>(depth)) {
              throw InvalidArgument("a static slot of depth " + std::to_string(depth) + " for " + spec.describe() +
                                    " is too large (at most 2^62 bytes in all)");
            }
            gil_scoped_release r;  // a GPU slot may initialise CUDA
            new (self) StaticSlot(device_of(d), name, spec, depth, first_seq,
                                  gpu < 0 ? MemoryType::kHost : MemoryType::kCuda, gpu < 0 ? 0 : gpu);
          },
          nb::arg("device"), nb::arg("name"), nb::arg("shape"), nb::arg("code"), nb::arg("bits"), nb::arg("depth") = 2,
          nb::arg("first_seq") = 1, nb::arg("gpu") = -1, nb::keep_alive<1, 2>())
      .def(
          "recv",
          [](nb::handle self, nb::handle timeout) {
            auto& slot = nb::cast<StaticSlot&>(self);
            double t = to_timeout(timeout, "timeout", /*negative_is_forever=*/true);
            int idx;
            {
              gil_scoped_release r;
              idx = slot.recv(t);
            }
            return slot_view(self, slot, idx);
          },
          nb::arg("timeout").none() = nb::none(),
          nb::sig("def recv(self, timeout: float | None = None) -> numpy.typing.NDArray[typing.Any]"),
          "Waits for the next tensor; returns a zero-copy view of it (valid until release()): a numpy array (the "
          "same array each time its buffer comes round), or "
          "for a slot in GPU memory a DLPack array on the GPU (torch.from_dlpack(view)).")
      .def("recv_async", &recv_async, nb::arg("timeout").none() = nb::none(),
           nb::sig("def recv_async(self, timeout: float | None = None) -> "
                   "collections.abc.Coroutine[typing.Any, typing.Any, numpy.typing.NDArray[typing.Any]]"),
           "Awaits the next tensor without blocking the event loop (a cancelled await loses no tensor).")
      .def(
          "poll",
          [](nb::handle self) -> nb::object {
            auto& slot = nb::cast<StaticSlot&>(self);
            int idx = slot.poll();
            if (idx < 0) return nb::none();
            return slot_view(self, slot, idx);
          },
          nb::sig("def poll(self) -> numpy.typing.NDArray[typing.Any] | None"),
          "Non-blocking recv(): the next tensor's view, or None if it has not arrived.")
      .def(
          "release",
          [](StaticSlot& slot, nb::object view) {
            gil_scoped_release r;
            slot.release();
          },
          nb::arg("view") = nb::none(),
          "Marks the oldest received tensor consumed (its view must not be used afterwards) and tells the sender.")
      .def_prop_ro("shape", [](StaticSlot& s) { return s.spec().shape; })
      .def_prop_ro("dtype", [](StaticSlot& s) { return s.spec().dtype.name(); })
      .def_prop_ro("depth", &StaticSlot::depth)
      .def_prop_ro(
          "memory", [](StaticSlot& s) { return memory_name(s.memory_type(), s.gpu()); },
          "Where the buffers live: 'host' or 'cuda:<gpu>' (the sequence words are always host memory).")
      .def_prop_ro("next_seq", &StaticSlot::next_seq)
      .def_prop_ro("has_sender", &StaticSlot::has_sender)
      .def("stats", [](StaticSlot& s) { return stats_dict(s.stats()); });

  nb::class_<PyStaticSender>(m, "StaticSender", "Sender side of a static slot (use channel.static_sender).")
      .def(
          "__init__",
          [](PyStaticSender* self, Channel& ch, const std::string& name, nb::handle timeout_arg) {
            const double timeout = sender_timeout(timeout_arg);  // before attaching: a bad one loses nothing
            new (self) PyStaticSender();
            gil_scoped_release r;
            self->sender = std::make_unique<StaticSender>(ch, name, timeout);
          },
          nb::arg("channel"), nb::arg("name"), nb::arg("timeout").none() = 10.0)
      .def(
          "send_block", [](PyStaticSender& s, PyBlock& b, nb::handle timeout) { return send_block(s, b, timeout); },
          nb::arg("block"), nb::arg("timeout").none() = 10.0, "Sends a pool block (zero copy).")
      .def("send_outside", &send_outside<PyStaticSender>, nb::arg("address"), nb::arg("gpu"), nb::arg("shape"),
           nb::arg("code"), nb::arg("bits"), nb::arg("path"), nb::arg("timeout").none(), nb::arg("owner").none(),
           kSendOutsideDoc)
      .def(
          "wait_consumed",
          [](PyStaticSender& s, nb::handle seq_arg, nb::handle timeout_arg) {
            const std::uint64_t seq = to_u64(seq_arg, "seq");
            const double timeout = sender_timeout(timeout_arg);
            gil_scoped_release r;
            s.sender->wait_consumed(seq, timeout);
          },
          nb::arg("seq"), nb::arg("timeout").none() = 10.0, "Blocks until the receiver released tensor `seq`.")
      .def_prop_ro("consumed", [](PyStaticSender& s) { return s.sender->consumed(); })
      .def_prop_ro(
          "region", [](PyStaticSender& s) { return s.sender->region(); },
          "The slot's memory at the receiver, as its attach reply exported it to this sender.")
      .def_prop_ro("sent", [](PyStaticSender& s) { return s.sender->last_sent(); })
      .def_prop_ro("shape", [](PyStaticSender& s) { return s.sender->spec().shape; })
      .def_prop_ro("dtype", [](PyStaticSender& s) { return s.sender->spec().dtype.name(); })
      .def("stats", [](PyStaticSender& s) { return stats_dict(s.sender->stats()); });

  nb::class_<DynamicSlot>(m, "DynamicSlot", "Receiver side of dynamic allocation: tensors of any shape.")
      .def(
          "__init__",
          [](DynamicSlot* self, PyDevice& d, const std::string& name, nb::handle max_ndim, nb::handle max_nbytes,
             int gpu) {
            const int ndim = static_cast<int>(to_int(max_ndim, "max_ndim", 0, 64));
            const std::uint64_t limit = to_u64(max_nbytes, "max_nbytes");
            gil_scoped_release r;  // a GPU slot may initialise CUDA
            new (self) DynamicSlot(device_of(d), name, ndim, limit, gpu < 0 ? MemoryType::kHost : MemoryType::kCuda,
                                   gpu < 0 ? 0 : gpu);
          },
          nb::arg("device"), nb::arg("name"), nb::arg("max_ndim") = 8, nb::arg("max_nbytes") = std::size_t(1) << 32,
          nb::arg("gpu") = -1, nb::keep_alive<1, 2>())
      .def(
          "recv",
          [](DynamicSlot& slot, nb::handle timeout) {
            double t = to_timeout(timeout, "timeout", /*negative_is_forever=*/true);
            TensorSpec spec;
            PyBlock b;
            {
              gil_scoped_release r;
              b.block = slot.recv(&spec, t);
            }
            return fill_view(std::move(b), spec);
          },
          nb::arg("timeout").none() = nb::none(),
          "Waits for the next tensor; returns a Block (registered memory) holding it, with its shape and dtype.")
      .def("recv_async", &recv_async, nb::arg("timeout").none() = nb::none(),
           nb::sig("def recv_async(self, timeout: float | None = None) -> "
                   "collections.abc.Coroutine[typing.Any, typing.Any, Block]"),
           "Awaits the next tensor without blocking the event loop (a cancelled await loses no tensor).")
      .def("poll",
           [](DynamicSlot& slot) -> nb::object {
             TensorSpec spec;
             PyBlock b;
             bool got;
             {
               gil_scoped_release r;  // a record that has arrived is read here: other threads run meanwhile
               got = slot.poll(&b.block, &spec);
             }
             if (!got) return nb::none();
             return nb::cast(fill_view(std::move(b), spec));
           })
      .def_prop_ro("record_size", &DynamicSlot::record_size)
      .def_prop_ro("next_seq", &DynamicSlot::next_seq)
      .def("stats", [](DynamicSlot& s) { return stats_dict(s.stats()); });

  nb::class_<PyDynamicSender>(m, "DynamicSender", "Sender side of a dynamic slot (use channel.dynamic_sender).")
      .def(
          "__init__",
          [](PyDynamicSender* self, Channel& ch, const std::string& name, nb::handle timeout_arg) {
            const double timeout = sender_timeout(timeout_arg);  // before attaching: a bad one loses nothing
            new (self) PyDynamicSender();
            gil_scoped_release r;
            self->sender = std::make_unique<DynamicSender>(ch, name, timeout);
          },
          nb::arg("channel"), nb::arg("name"), nb::arg("timeout").none() = 10.0)
      .def(
          "send_block", [](PyDynamicSender& s, PyBlock& b, nb::handle timeout) { return send_block(s, b, timeout); },
          nb::arg("block"), nb::arg("timeout").none() = 10.0)
      .def("send_outside", &send_outside<PyDynamicSender>, nb::arg("address"), nb::arg("gpu"), nb::arg("shape"),
           nb::arg("code"), nb::arg("bits"), nb::arg("path"), nb::arg("timeout").none(), nb::arg("owner").none(),
           kSendOutsideDoc)
      .def_prop_ro(
          "region", [](PyDynamicSender& s) { return s.sender->region(); },
          "The slot's record at the receiver, as its attach reply exported it to this sender.")
      .def("stats", [](PyDynamicSender& s) { return stats_dict(s.sender->stats()); });

  nb::class_<PyWord>(m, "Word",
                     "A flag a peer writes one-sidedly, for wait_any: ready once the 8-byte word at `offset` of "
                     "`local` (a Block or Registration) equals `value`. With `channel` (the one the peer writes "
                     "over), the wait drives its worker where the writes need it (tcp) and fails with its peer.")
      .def(
          "__init__",
          [](PyWord* self, nb::handle local, nb::handle offset, nb::handle value, std::optional<Channel> channel) {
            PyWord w;
            w.local = local_region_of(local);
            w.offset = static_cast<std::size_t>(to_u64(offset, "offset"));
            w.value = to_u64(value, "value");
            w.channel = std::move(channel);
            w.memory = nb::borrow(local);
            w.awaitable();  // a word outside the region, or unaligned, is refused now
            new (self) PyWord(std::move(w));
          },
          nb::arg("local"), nb::arg("offset"), nb::arg("value"), nb::arg("channel").none() = nb::none())
      .def_ro("offset", &PyWord::offset)
      .def_ro("value", &PyWord::value);

  nb::class_<NotifySender>(m, "NotifySender", "The notifying side of a channel (channel.write(..., notify=)).")
      .def(
          "__init__",
          [](NotifySender* self, Channel& ch, nb::handle timeout) {
            const double t = sender_timeout(timeout);
            gil_scoped_release r;
            new (self) NotifySender(ch, t);
          },
          nb::arg("channel"), nb::arg("timeout").none() = 10.0)
      .def(
          "send",
          [](NotifySender& s, nb::bytes message, nb::handle timeout) {
            const double t = sender_timeout(timeout);
            std::string m(message.c_str(), message.size());
            gil_scoped_release r;
            s.send(m, t);
          },
          nb::arg("message"), nb::arg("timeout").none() = 10.0);

  m.def(
      "dtypes",
      [] {
        nb::list out;
        for (const auto& d : dtypes()) out.append(nb::make_tuple(d.name, d.dtype.code, d.dtype.bits, d.format));
        return out;
      },
      nb::sig("def dtypes() -> list[tuple[str, int, int, str]]"),
      "The supported dtypes: (name, DLPack type code, bits, buffer-protocol format), the core's one table.");

  m.def(
      "wait_any",
      [](nb::handle items, nb::handle timeout) {
        const double t = to_timeout(timeout, "timeout", /*negative_is_forever=*/true);
        std::vector<Awaitable> awaitables;
        std::vector<nb::object> keep;  // the Python objects stay alive while the wait runs
        for (nb::handle item : nb::iter(items)) {
          if (nb::isinstance<StaticSlot>(item)) {
            awaitables.emplace_back(nb::cast<StaticSlot&>(item));
          } else if (nb::isinstance<DynamicSlot>(item)) {
            awaitables.emplace_back(nb::cast<DynamicSlot&>(item));
          } else if (nb::isinstance<Request>(item)) {
            awaitables.emplace_back(nb::cast<Request&>(item));
          } else if (nb::isinstance<Channel>(item)) {
            awaitables.emplace_back(nb::cast<Channel&>(item));
          } else if (nb::isinstance<PyWord>(item)) {
            awaitables.push_back(nb::cast<PyWord&>(item).awaitable());
          } else {
            throw InvalidArgument("wait_any takes static slots, dynamic slots, requests, words and channels, got " +
                                  std::string(nb::type_name(item.type()).c_str()));
          }
          keep.push_back(nb::borrow(item));
        }
        gil_scoped_release r;
        return wait_any(awaitables, t);
      },
      nb::arg("items"), nb::arg("timeout").none() = nb::none(),
      "Waits until one of `items` (static slots, dynamic slots, requests, words) is ready; returns its index.\n\n"
      "A slot is ready once its next tensor arrived (recv() returns at once), a request once it completed "
      "(wait() returns or raises at once), a Word once it holds its value. A channel in `items` is never "
      "ready: it is watched, and its peer's failure fails the wait. Raises PeerFailed (or ConnectionError) "
      "when the sender of a slot, or a watched channel's peer, fails; Timeout after `timeout` seconds (None: "
      "no bound). The GIL is released meanwhile.");
}

}  // namespace tensorwire::py
