// Copyright tensorwire authors. Shared declarations of the nanobind module.
#pragma once

#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace tensorwire::py {
void bind_errors(nb::module_& m);
void bind_memory(nb::module_& m);
void bind_device(nb::module_& m);
void bind_bench(nb::module_& m);  // bench_* kernels and UcxBaseline
void bind_slots(nb::module_& m);
void bind_messenger(nb::module_& m);    // the tagged-message engine
void bind_collectives(nb::module_& m);  // the collectives layer on it
}  // namespace tensorwire::py
