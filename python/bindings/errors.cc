// Copyright tensorwire authors.
//
// The one table from tensorwire::Error kinds to Python exception types. The
// types themselves live in tensorwire/errors.py (so they can also derive from
// the matching built-in: TimeoutError, ConnectionError, ...).
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "tensorwire/error.h"

namespace tensorwire::py {

namespace {
const char* python_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "InvalidArgument";
    case ErrorKind::kTimeout: return "Timeout";
    case ErrorKind::kConnection: return "ConnectionError";
    case ErrorKind::kPeerFailed: return "PeerFailed";
    case ErrorKind::kPoolExhausted: return "PoolExhausted";
    case ErrorKind::kProtocolMismatch: return "ProtocolMismatch";
    case ErrorKind::kNotFound: return "NotFound";
    case ErrorKind::kGeneric: break;
  }
  return "Error";
}
}  // namespace

void bind_errors(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      nb::object errors = nb::module_::import_("tensorwire.errors");
      nb::object cls = errors.attr(python_name(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
}

}  // namespace tensorwire::py
