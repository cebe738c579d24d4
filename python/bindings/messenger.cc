// Copyright tensorwire authors.
//
// tensorwire._core.Messenger: the C++ tagged-message engine
// (tensorwire/messenger.h) for Python: isend/irecv of a contiguous buffer
// (address, size and the object that holds it) return Requests, which
// wait() and wait_any() take. The rendezvous is two Python callables
// (set(key, value), get(key, timeout) -> value), e.g. a torch store's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <functional>
#include <memory>

#include "bindings.h"
#include "checked.h"
#include "py_messenger.h"
#include "py_types.h"
#include "tensorwire/messenger.h"

namespace tensorwire::py {
namespace {

// Calls into Python for the engine's set-up (the caller's thread, GIL released around it).
class CallableRendezvous : public Rendezvous {
 public:
  CallableRendezvous(nb::object set, nb::object get) : set_(std::move(set)), get_(std::move(get)) {}
  ~CallableRendezvous() override {
    nb::gil_scoped_acquire gil;
    set_.reset();
    get_.reset();
  }
  void set(const std::string& key, const std::string& value) override {
    nb::gil_scoped_acquire gil;
    set_(key, nb::bytes(value.data(), value.size()));
  }
  std::string get(const std::string& key, double timeout_s) override {
    nb::gil_scoped_acquire gil;
    nb::object v = get_(key, timeout_s);
    if (nb::isinstance<nb::bytes>(v)) {
      nb::bytes b = nb::borrow<nb::bytes>(v);
      return std::string(b.c_str(), b.size());
    }
    return nb::cast<std::string>(v);
  }

 private:
  nb::object set_, get_;
};

// An irecv: its request, and the sender's rank once it completed.
struct PyReceive {
  Request request;
  std::shared_ptr<int> source = std::make_shared<int>(-1);
};

}  // namespace

std::shared_ptr<const void> hold(nb::handle obj, std::shared_ptr<int> also) {
  if ((!obj.is_valid() || obj.is_none()) && !also) return nullptr;
  auto* held = new nb::object(obj.is_valid() ? nb::borrow(obj) : nb::none());
  return std::shared_ptr<const void>(held, [also](const void* p) {
    nb::gil_scoped_acquire gil;
    delete static_cast<const nb::object*>(p);
  });
}

Buffer buffer_of(std::uintptr_t ptr, std::size_t nbytes, nb::handle keep, std::uintptr_t base, std::size_t base_bytes,
                 std::shared_ptr<int> source) {
  Buffer b;
  b.data = reinterpret_cast<void*>(ptr);
  b.nbytes = nbytes;
  b.base = reinterpret_cast<void*>(base);
  b.base_bytes = base_bytes;
  b.keep = hold(keep, std::move(source));
  return b;
}

void bind_messenger(nb::module_& m) {
  nb::class_<PyReceive>(m, "Receive", "A posted receive: its request, and the sender's rank once complete.")
      .def_prop_ro(
          "request", [](PyReceive& r) -> Request& { return r.request; }, nb::rv_policy::reference_internal)
      .def_prop_ro(
          "source", [](PyReceive& r) { return *r.source; },
          "The sender's rank once the request completed (-1 before).");

  nb::class_<PyMessenger>(m, "Messenger",
                          "Tagged messages between the ranks of a group (the C++ engine, tensorwire/messenger.h).")
      .def(
          "__init__",
          [](PyMessenger* self, PyDevice& device, int rank, int size, nb::object store_set, nb::object store_get,
             const std::string& name, double timeout, std::size_t eager_bytes, bool progress_thread) {
            if (!device.device) throw ConnectionError("device is closed");
            MessengerConfig cfg;
            cfg.name = name;
            cfg.timeout_s = timeout;
            cfg.eager_bytes = eager_bytes;
            cfg.progress_thread = progress_thread;
            auto rv = std::make_unique<CallableRendezvous>(std::move(store_set), std::move(store_get));
            std::shared_ptr<Messenger> made;
            {
              nb::gil_scoped_release release;
              made = make_messenger(*device.device, rank, size, *rv, cfg);
              nb::gil_scoped_acquire gil;  // (the rendezvous' callables go with the GIL)
              rv.reset();
            }
            new (self) PyMessenger{std::move(made)};
          },
          nb::arg("device"), nb::arg("rank"), nb::arg("size"), nb::arg("store_set"), nb::arg("store_get"),
          nb::arg("name") = "msg", nb::arg("timeout") = 300.0, nb::arg("eager_bytes") = 128 << 10,
          nb::arg("progress_thread") = true,
          "Connects to every rank of the group, meeting them through store_set(key, value) and "
          "store_get(key, timeout) -> bytes (e.g. a torch.distributed store's set and get).")
      .def_prop_ro("rank", [](PyMessenger& s) { return s.get().rank(); })
      .def_prop_ro("size", [](PyMessenger& s) { return s.get().size(); })
      .def(
          "isend",
          [](PyMessenger& s, std::uintptr_t ptr, std::size_t nbytes, int peer, std::int64_t tag, nb::handle keep,
             std::uintptr_t base, std::size_t base_bytes) {
            Buffer b = buffer_of(ptr, nbytes, keep, base, base_bytes);
            Messenger& m = s.get();
            nb::gil_scoped_release release;
            return m.isend(b, peer, tag);
          },
          nb::arg("ptr"), nb::arg("nbytes"), nb::arg("peer"), nb::arg("tag") = 0, nb::arg("keep") = nb::none(),
          nb::arg("base") = 0, nb::arg("base_bytes") = 0,
          "Posts a send of the nbytes at address ptr (held alive by `keep`, inside the allocation [base, "
          "base + base_bytes) if given) to rank `peer`; the bytes may change once the Request completes.")
      .def(
          "irecv",
          [](PyMessenger& s, std::uintptr_t ptr, std::size_t nbytes, int peer, std::int64_t tag, nb::handle keep,
             std::uintptr_t base, std::size_t base_bytes) {
            auto r = std::make_unique<PyReceive>();
            Buffer b = buffer_of(ptr, nbytes, keep, base, base_bytes, r->source);  // (the engine writes the source)
            Messenger& m = s.get();
            {
              nb::gil_scoped_release release;
              r->request = m.irecv(b, peer, tag, r->source.get());
            }
            return r;
          },
          nb::arg("ptr"), nb::arg("nbytes"), nb::arg("peer"), nb::arg("tag") = 0, nb::arg("keep") = nb::none(),
          nb::arg("base") = 0, nb::arg("base_bytes") = 0,
          "Posts a receive into the nbytes at ptr from rank `peer` (-1: any rank); returns a Receive.")
      .def_prop_ro("timeout", [](PyMessenger& s) { return s.get().timeout(); })
      .def("stats",
           [](PyMessenger& s) {
             MessengerStats st = s.get().stats();
             nb::dict d;
             d["eager_sends"] = st.eager_sends;
             d["placed_sends"] = st.placed_sends;
             d["unexpected"] = st.unexpected;
             return d;
           })
      .def("close", &PyMessenger::close, "Fails what is pending (ConnectionError) and stops. Idempotent.");
  m.attr("ANY_SOURCE") = kAnySource;
}

}  // namespace tensorwire::py
