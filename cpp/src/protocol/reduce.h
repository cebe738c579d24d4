// Copyright tensorwire authors.
//
// The element kernels of the collectives (protocol/reduce.cc): which op each
// dtype supports, the reduction itself (tensorwire::reduce_into), and the
// scaling that kAvg and kPremulSum add around a kSum. float16 and bfloat16 are
// computed in float and rounded to nearest even on the way back, once per op.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensorwire/collectives.h"
#include "tensorwire/slot.h"

namespace tensorwire::detail {

// Throws InvalidArgument naming the dtype and the op unless `dtype` is in the
// dtype table and supports `op` (docs/collectives.md has the table).
void check_reduce(DType dtype, ReduceOp op);

// dst[i] = src[i] * factor (dst may equal src): kPremulSum's own input.
// Floating and complex dtypes only (check_reduce refuses the others).
void scale_into(void* dst, const void* src, std::size_t count, DType dtype, double factor);

// data[i] = data[i] / divisor: kAvg's last step. Floating and complex dtypes.
void divide_in_place(void* data, std::size_t count, DType dtype, double divisor);

// IEEE binary16 and bfloat16 <-> float. Widening is exact; narrowing rounds
// to nearest, ties to even; overflow gives infinity; NaN stays a (quiet) NaN.
float half_to_float(std::uint16_t h);
std::uint16_t float_to_half(float f);
float bfloat16_to_float(std::uint16_t b);
std::uint16_t float_to_bfloat16(float f);

}  // namespace tensorwire::detail
