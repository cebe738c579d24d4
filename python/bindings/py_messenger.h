// Copyright tensorwire authors.
//
// What the Messenger's and the Collectives' bindings share: the Python holder
// of the engine, and caller memory (address, size, the object that holds it)
// as the engine's Buffer.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tensorwire/error.h"
#include "tensorwire/messenger.h"

namespace nb = nanobind;

namespace tensorwire::py {

// Shared, so that a Collectives made on it keeps the engine object alive:
// close() ends the engine (what is pending fails, later calls raise
// ConnectionError) without leaving anyone a dangling reference.
struct PyMessenger {
  std::shared_ptr<Messenger> m;
  Messenger& get() {
    if (!m) throw ConnectionError("messenger: closed");
    return *m;
  }
  void close() {
    std::shared_ptr<Messenger> gone;
    gone.swap(m);
    nb::gil_scoped_release release;  // its progress thread may need the GIL to drop what it holds
    if (gone) gone->close();
    gone.reset();
  }
  ~PyMessenger() { close(); }
};

// A Python object held by the engine: released with the GIL, from whichever thread lets go.
// `also`: what else must live as long (a receive's source word).
std::shared_ptr<const void> hold(nb::handle obj, std::shared_ptr<int> also = nullptr);

// nbytes at ptr, held alive by `keep`, inside the allocation [base, +base_bytes) when base is given.
Buffer buffer_of(std::uintptr_t ptr, std::size_t nbytes, nb::handle keep, std::uintptr_t base, std::size_t base_bytes,
                 std::shared_ptr<int> source = nullptr);

}  // namespace tensorwire::py
