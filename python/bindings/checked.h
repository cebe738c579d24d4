// Copyright tensorwire authors.
//
// Checked conversion of Python arguments that size memory (shapes, byte
// counts, offsets, alignments, timeouts). nanobind's own casters turn a
// negative or >64-bit int into TypeError (or std::bad_cast via nb::cast),
// and unchecked products wrap; these raise InvalidArgument naming the
// argument and its value instead, before anything is allocated or posted.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tensorwire/error.h"

namespace tensorwire::py {

namespace nb = nanobind;

// The largest tensor/region size accepted: the bound TensorSpec::nbytes uses,
// so a size accepted here never overflows later rounding (64 B, huge pages).
inline constexpr std::uint64_t kMaxBytes = std::uint64_t(1) << 62;

// Timeouts beyond this (a century) mean no bound.
inline constexpr double kForeverS = 100.0 * 365 * 24 * 3600;

inline std::string describe_value(nb::handle v) {
  nb::str r = nb::repr(v);
  std::string s = r.c_str();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s + " (" + nb::type_name(v.type()).c_str() + ")";
}

// `v` as an integer in [0, max]. Accepts anything with __index__ (Python and
// numpy integers); refuses floats, negatives and values above max.
// `v` as a Python int (through __index__), or InvalidArgument naming `what`.
inline nb::object index_of(nb::handle v, const std::string& what) {
  PyObject* idx = PyNumber_Index(v.ptr());
  if (!idx) {
    PyErr_Clear();
    throw InvalidArgument(what + " must be an integer, got " + describe_value(v));
  }
  return nb::steal(idx);
}

inline std::uint64_t to_u64(nb::handle v, const std::string& what,
                            std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) {
  nb::object i = index_of(v, what);
  PyObject* idx = i.ptr();
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(idx, &overflow);
  if (overflow < 0 || (overflow == 0 && x < 0)) {
    throw InvalidArgument(what + " must be >= 0, got " + nb::str(i).c_str());
  }
  std::uint64_t u = static_cast<std::uint64_t>(x);
  if (overflow > 0) {
    u = PyLong_AsUnsignedLongLong(idx);
    if (u == static_cast<std::uint64_t>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      throw InvalidArgument(what + " " + nb::str(i).c_str() + " does not fit in 64 bits");
    }
  }
  if (u > max) {
    throw InvalidArgument(what + " " + std::to_string(u) + " is too large (at most " + std::to_string(max) + ")");
  }
  return u;
}

// `v` as an integer in [lo, hi] (a count, a depth).
inline std::int64_t to_int(nb::handle v, const std::string& what, std::int64_t lo, std::int64_t hi) {
  nb::object i = index_of(v, what);
  PyObject* idx = i.ptr();
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(idx, &overflow);
  if (overflow != 0 || x < lo || x > hi) {
    throw InvalidArgument(what + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) + ", got " +
                          nb::str(i).c_str());
  }
  return x;
}

// A tensor shape: an integer n (meaning (n,)) or an iterable of integers,
// each in [0, 2^63).
inline std::vector<std::int64_t> to_shape(nb::handle shape, const std::string& what = "shape") {
  std::vector<std::int64_t> out;
  const std::int64_t dim_max = std::numeric_limits<std::int64_t>::max();
  if (!PySequence_Check(shape.ptr()) && PyIndex_Check(shape.ptr())) {
    out.push_back(static_cast<std::int64_t>(to_u64(shape, what, dim_max)));
    return out;
  }
  PyObject* fast = PyUnicode_Check(shape.ptr()) || PyBytes_Check(shape.ptr())
                       ? nullptr
                       : PySequence_Fast(shape.ptr(), "not iterable");
  if (!fast) {
    PyErr_Clear();
    throw InvalidArgument(what + " must be an integer or a sequence of integers, got " + describe_value(shape));
  }
  nb::object seq = nb::steal(fast);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  if (n > 64) throw InvalidArgument(what + " has " + std::to_string(n) + " dimensions (at most 64)");
  for (Py_ssize_t k = 0; k < n; ++k) {
    out.push_back(static_cast<std::int64_t>(
        to_u64(PySequence_Fast_GET_ITEM(fast, k), what + "[" + std::to_string(k) + "]", dim_max)));
  }
  return out;
}

// product(shape) * itemsize, refused (not wrapped) above kMaxBytes.
inline std::uint64_t checked_nbytes(const std::vector<std::int64_t>& shape, std::uint64_t itemsize,
                                    const std::string& what = "shape") {
  std::uint64_t n = itemsize;
  for (auto d : shape) {
    if (d < 0) throw InvalidArgument("negative dimension in " + what);
    std::uint64_t next;
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &next) || next > kMaxBytes) {
      std::string dims;
      for (std::size_t k = 0; k < shape.size(); ++k) dims += (k ? ", " : "") + std::to_string(shape[k]);
      throw InvalidArgument("a tensor of " + what + " (" + dims + ") with " + std::to_string(itemsize) +
                            "-byte elements is too large (at most 2^62 bytes)");
    }
    n = next;
  }
  return n;
}

// A timeout in seconds: None means forever (-1 for the core). NaN is refused
// (the core's deadline arithmetic is undefined for it); a negative value is
// refused unless `negative_is_forever` keeps the core's old reading of it.
inline double to_timeout(nb::handle v, const std::string& what = "timeout", bool negative_is_forever = false) {
  if (v.is_none()) return -1.0;
  double t = PyFloat_AsDouble(v.ptr());
  if (t == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw InvalidArgument(what + " must be a number of seconds or None, got " + describe_value(v));
  }
  if (std::isnan(t)) throw InvalidArgument(what + " must be a number of seconds or None, got nan");
  if (t < 0 && !negative_is_forever) {
    throw InvalidArgument(what + " must be >= 0 seconds or None (forever), got " + nb::str(v).c_str());
  }
  // inf, or past what a steady_clock deadline holds (int64 ns: 292 years),
  // would overflow the core's deadline arithmetic: wait forever instead.
  if (t > kForeverS) return -1.0;
  return t;
}

}  // namespace tensorwire::py
