// Copyright tensorwire authors.
//
// The element kernels of the collectives (protocol/reduce.cc): which op each
// dtype supports, the reduction itself (tensorwire::reduce_into), and the
// scaling that kAvg and kPremulSum add around a kSum. float16 and bfloat16 are
// computed in float and rounded to nearest even on the way back, once per op.
#pragma once

#include <bit>
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
// Inline and branch-free (every case computed, one selected), so that the
// reduction loops around them vectorise.

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t em = std::uint32_t(h & 0x7fffu) << 13;  // exponent and mantissa in float's place
  const std::uint32_t exp = em & 0x0f800000u;
  const std::uint32_t normal = em + ((127u - 15u) << 23);        // rebiased
  const std::uint32_t special = em + (2u * (127u - 15u) << 23);  // infinity, NaN: the exponent all ones
  // Zero or subnormal, m 2^-24: the normal float 2^-14 (1 + m/1024), less 2^-14 (exact).
  const std::uint32_t sub =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(em + (113u << 23)) - std::bit_cast<float>(113u << 23));
  // Selected by masks, not ?: (GCC leaves branches in a loop over a nested ?:).
  const std::uint32_t is_special = 0u - std::uint32_t(exp == 0x0f800000u), is_sub = 0u - std::uint32_t(exp == 0);
  const std::uint32_t bits = (special & is_special) | (sub & is_sub) | (normal & ~(is_special | is_sub));
  return std::bit_cast<float>(bits | sign);
}

inline std::uint16_t float_to_half(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = x & 0x80000000u;
  x ^= sign;
  // >= 65536, infinity or NaN.
  const std::uint32_t big = 0x7c00u | ((0u - std::uint32_t(x > 0x7f800000u)) & 0x0200u);
  // Below 2^-14 (a subnormal half or zero): adding 0.5, whose ulp 2^-24 is the
  // subnormal half's step, lets the FPU round to nearest even; the low bits
  // are then the half's.
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(std::bit_cast<float>(x) + 0.5f) - 0x3f000000u;
  // Normal: rebias, add half an ulp less one plus the kept lowest bit (ties to
  // even); a carry into the exponent is the right rounding, up to infinity
  // from 65520 on.
  const std::uint32_t normal = (x - ((127u - 15u) << 23) + 0xfffu + ((x >> 13) & 1u)) >> 13;
  const std::uint32_t is_big = 0u - std::uint32_t(x >= ((127u + 16u) << 23)),
                      is_sub = 0u - std::uint32_t(x < (113u << 23));
  const std::uint32_t out = (big & is_big) | (sub & is_sub) | (normal & ~(is_big | is_sub));
  return static_cast<std::uint16_t>(out | (sign >> 16));
}

inline float bfloat16_to_float(std::uint16_t b) { return std::bit_cast<float>(std::uint32_t(b) << 16); }

inline std::uint16_t float_to_bfloat16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t quiet = (x >> 16) | 0x40u;  // a NaN stays one (rounding could make it infinity)
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// Blocks of float16 to and from float: the CPU's F16C conversions where it has
// them (x86-64), the ones above otherwise; the same results either way
// (test_collectives checks every float16 and every tie). *_portable: always
// the ones above. f16c_enabled(): which reduce_into uses.
void widen_halves(const std::uint16_t* src, float* dst, std::size_t n);
void narrow_halves(const float* src, std::uint16_t* dst, std::size_t n);
void widen_halves_portable(const std::uint16_t* src, float* dst, std::size_t n);
void narrow_halves_portable(const float* src, std::uint16_t* dst, std::size_t n);
bool f16c_enabled();

}  // namespace tensorwire::detail
