// Copyright tensorwire authors.
//
// The reduction kernels of the collectives. One switch on (dtype, op) picks a
// loop; each loop is branch-free over elements so that -O2/-O3 vectorises
// the common ones (sum, min, max of float32 and the integers).
#include "protocol/reduce.h"

#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "tensorwire/error.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace tensorwire {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kBand: return "band";
    case ReduceOp::kBor: return "bor";
    case ReduceOp::kBxor: return "bxor";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kPremulSum: return "premul_sum";
  }
  return "unknown";
}

namespace detail {

namespace {

enum class Kind { kHalf, kBfloat, kF32, kF64, kI8, kI16, kI32, kI64, kU8, kU16, kU32, kU64, kBool, kC64, kC128, kNone };

Kind kind_of(DType d) {
  switch (d.code) {
    case 0:
      return d.bits == 8    ? Kind::kI8
             : d.bits == 16 ? Kind::kI16
             : d.bits == 32 ? Kind::kI32
             : d.bits == 64 ? Kind::kI64
                            : Kind::kNone;
    case 1:
      return d.bits == 8    ? Kind::kU8
             : d.bits == 16 ? Kind::kU16
             : d.bits == 32 ? Kind::kU32
             : d.bits == 64 ? Kind::kU64
                            : Kind::kNone;
    case 2: return d.bits == 16 ? Kind::kHalf : d.bits == 32 ? Kind::kF32 : d.bits == 64 ? Kind::kF64 : Kind::kNone;
    case 4: return d.bits == 16 ? Kind::kBfloat : Kind::kNone;
    case 5: return d.bits == 64 ? Kind::kC64 : d.bits == 128 ? Kind::kC128 : Kind::kNone;
    case 6: return d.bits == 8 ? Kind::kBool : Kind::kNone;
    default: return Kind::kNone;
  }
}

bool floating(Kind k) { return k == Kind::kHalf || k == Kind::kBfloat || k == Kind::kF32 || k == Kind::kF64; }
bool complex(Kind k) { return k == Kind::kC64 || k == Kind::kC128; }

bool supports(Kind k, ReduceOp op) {
  if (k == Kind::kNone) return false;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kProduct: return true;
    case ReduceOp::kMin:
    case ReduceOp::kMax: return !complex(k);  // no order on complex numbers
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor: return !floating(k) && !complex(k);
    case ReduceOp::kAvg:
    case ReduceOp::kPremulSum: return floating(k) || complex(k);  // an integer mean would truncate
  }
  return false;
}

// ---- loops (the switch on the op stays outside them) ----

template <typename T, typename F>
void each(void* dst, const void* src, std::size_t n, F f) {
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  for (std::size_t i = 0; i < n; ++i) d[i] = f(d[i], s[i]);
}

// min/max that keep a NaN from either side (torch.minimum's rule), as selects.
template <typename T>
inline T nan_min(T a, T b) {
  return (b < a || b != b) ? b : a;
}
template <typename T>
inline T nan_max(T a, T b) {
  return (b > a || b != b) ? b : a;
}

template <typename T>
void reduce_float(void* d, const void* s, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kProduct: each<T>(d, s, n, [](T a, T b) { return a * b; }); break;
    case ReduceOp::kMin: each<T>(d, s, n, [](T a, T b) { return nan_min(a, b); }); break;
    case ReduceOp::kMax: each<T>(d, s, n, [](T a, T b) { return nan_max(a, b); }); break;
    default: each<T>(d, s, n, [](T a, T b) { return a + b; }); break;  // sum, avg, premul_sum
  }
}

// float16/bfloat16: each element through float, rounded once on the way
// back. In blocks, one simple loop per stage (widen, combine, narrow): the
// vectoriser takes each of them, where it gave up on the fused loop; and the
// float16 stages can be the CPU's own conversions (F16C).
using WidenBlock = void (*)(const std::uint16_t*, float*, std::size_t);
using NarrowBlock = void (*)(const float*, std::uint16_t*, std::size_t);

template <typename F>
void each_narrow(void* dst, const void* src, std::size_t n, WidenBlock widen, NarrowBlock narrow, F f) {
  constexpr std::size_t kBlock = 512;
  alignas(64) float a[kBlock], b[kBlock];
  std::uint16_t* d = static_cast<std::uint16_t*>(dst);
  const std::uint16_t* s = static_cast<const std::uint16_t*>(src);
  for (std::size_t i0 = 0; i0 < n; i0 += kBlock) {
    const std::size_t m = n - i0 < kBlock ? n - i0 : kBlock;
    widen(d + i0, a, m);
    widen(s + i0, b, m);
    for (std::size_t j = 0; j < m; ++j) a[j] = f(a[j], b[j]);
    narrow(a, d + i0, m);
  }
}

void reduce_narrow(void* d, const void* s, std::size_t n, ReduceOp op, WidenBlock w, NarrowBlock r) {
  switch (op) {
    case ReduceOp::kProduct: each_narrow(d, s, n, w, r, [](float a, float b) { return a * b; }); break;
    case ReduceOp::kMin: each_narrow(d, s, n, w, r, [](float a, float b) { return nan_min(a, b); }); break;
    case ReduceOp::kMax: each_narrow(d, s, n, w, r, [](float a, float b) { return nan_max(a, b); }); break;
    default: each_narrow(d, s, n, w, r, [](float a, float b) { return a + b; }); break;
  }
}

void widen_bfloat16(const std::uint16_t* s, float* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) d[i] = bfloat16_to_float(s[i]);
}
void narrow_bfloat16(const float* s, std::uint16_t* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) d[i] = float_to_bfloat16(s[i]);
}
void widen_half_portable(const std::uint16_t* s, float* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) d[i] = half_to_float(s[i]);
}
void narrow_half_portable(const float* s, std::uint16_t* d, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) d[i] = float_to_half(s[i]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// vcvtph2ps is exact; vcvtps2ph with imm 0 rounds to nearest even whatever
// MXCSR says, overflows to infinity and keeps NaNs NaN: the portable rules.
__attribute__((target("avx,f16c"))) void widen_half_f16c(const std::uint16_t* s, float* d, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  }
  for (; i < n; ++i) d[i] = half_to_float(s[i]);
}
__attribute__((target("avx,f16c"))) void narrow_half_f16c(const float* s, std::uint16_t* d, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = float_to_half(s[i]);
}
bool cpu_has_f16c() {
  // CPUID leaf 1, ECX: AVX is bit 28, F16C bit 29 (clang's __builtin_cpu_supports knows no "f16c").
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 28)) && (c & (1u << 29));
  }();
  return yes;
}
#else
void widen_half_f16c(const std::uint16_t* s, float* d, std::size_t n) { widen_half_portable(s, d, n); }
void narrow_half_f16c(const float* s, std::uint16_t* d, std::size_t n) { narrow_half_portable(s, d, n); }
bool cpu_has_f16c() { return false; }
#endif

template <typename T>
void reduce_int(void* d, const void* s, std::size_t n, ReduceOp op) {
  // Sums and products wrap (two's complement, as torch's): computed unsigned,
  // at least as wide as unsigned int so that promotion cannot overflow an int.
  using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
  switch (op) {
    case ReduceOp::kSum: each<T>(d, s, n, [](T a, T b) { return static_cast<T>(U(a) + U(b)); }); break;
    case ReduceOp::kProduct: each<T>(d, s, n, [](T a, T b) { return static_cast<T>(U(a) * U(b)); }); break;
    case ReduceOp::kMin: each<T>(d, s, n, [](T a, T b) { return b < a ? b : a; }); break;
    case ReduceOp::kMax: each<T>(d, s, n, [](T a, T b) { return b > a ? b : a; }); break;
    case ReduceOp::kBand: each<T>(d, s, n, [](T a, T b) { return static_cast<T>(a & b); }); break;
    case ReduceOp::kBor: each<T>(d, s, n, [](T a, T b) { return static_cast<T>(a | b); }); break;
    case ReduceOp::kBxor: each<T>(d, s, n, [](T a, T b) { return static_cast<T>(a ^ b); }); break;
    default: break;  // refused by check_reduce
  }
}

// bool: any nonzero byte is true; results are 0 or 1.
void reduce_bool(void* d, const void* s, std::size_t n, ReduceOp op) {
  using B = std::uint8_t;
  switch (op) {
    case ReduceOp::kSum:  // a sum of bools saturates: or
    case ReduceOp::kMax:
    case ReduceOp::kBor: each<B>(d, s, n, [](B a, B b) { return B((a | b) != 0); }); break;
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand: each<B>(d, s, n, [](B a, B b) { return B((a != 0) & (b != 0)); }); break;
    case ReduceOp::kBxor: each<B>(d, s, n, [](B a, B b) { return B((a != 0) ^ (b != 0)); }); break;
    default: break;
  }
}

// Complex as interleaved (re, im) pairs: the sum is a real sum over 2n
// values; the product is written out (std::complex's operator* calls a
// library routine for its inf/NaN special cases on every element).
template <typename R>
void reduce_complex(void* dst, const void* src, std::size_t n, ReduceOp op) {
  R* __restrict d = static_cast<R*>(dst);
  const R* __restrict s = static_cast<const R*>(src);
  if (op == ReduceOp::kProduct) {
    for (std::size_t i = 0; i < n; ++i) {
      const R a = d[2 * i], b = d[2 * i + 1], c = s[2 * i], e = s[2 * i + 1];
      d[2 * i] = a * c - b * e;
      d[2 * i + 1] = a * e + b * c;
    }
  } else {
    for (std::size_t i = 0; i < 2 * n; ++i) d[i] += s[i];
  }
}

template <typename T, typename F>
void map(void* dst, const void* src, std::size_t n, F f) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (std::size_t i = 0; i < n; ++i) d[i] = f(s[i]);
}

}  // namespace

bool f16c_enabled() {
  // TENSORWIRE_NO_F16C=1: the portable conversions (a check of one against the other).
  static const bool on = cpu_has_f16c() && !std::getenv("TENSORWIRE_NO_F16C");
  return on;
}
void widen_halves(const std::uint16_t* s, float* d, std::size_t n) {
  (f16c_enabled() ? widen_half_f16c : widen_half_portable)(s, d, n);
}
void narrow_halves(const float* s, std::uint16_t* d, std::size_t n) {
  (f16c_enabled() ? narrow_half_f16c : narrow_half_portable)(s, d, n);
}
void widen_halves_portable(const std::uint16_t* s, float* d, std::size_t n) { widen_half_portable(s, d, n); }
void narrow_halves_portable(const float* s, std::uint16_t* d, std::size_t n) { narrow_half_portable(s, d, n); }

void check_reduce(DType dtype, ReduceOp op) {
  const Kind k = dtype.valid() ? kind_of(dtype) : Kind::kNone;
  if (k == Kind::kNone) throw InvalidArgument("reduce: unsupported dtype " + dtype.name());
  if (supports(k, op)) return;
  std::string ok;
  for (ReduceOp o : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kBand,
                     ReduceOp::kBor, ReduceOp::kBxor, ReduceOp::kAvg, ReduceOp::kPremulSum}) {
    if (supports(k, o)) ok += (ok.empty() ? "" : ", ") + std::string(reduce_op_name(o));
  }
  throw InvalidArgument(std::string("reduce op ") + reduce_op_name(op) + " is not supported for dtype " + dtype.name() +
                        " (it supports " + ok + ")");
}

void scale_into(void* dst, const void* src, std::size_t count, DType dtype, double factor) {
  const float ff = static_cast<float>(factor);
  switch (kind_of(dtype)) {
    case Kind::kHalf:
      map<std::uint16_t>(dst, src, count, [ff](std::uint16_t a) { return float_to_half(half_to_float(a) * ff); });
      return;
    case Kind::kBfloat:
      map<std::uint16_t>(dst, src, count,
                         [ff](std::uint16_t a) { return float_to_bfloat16(bfloat16_to_float(a) * ff); });
      return;
    case Kind::kF32: map<float>(dst, src, count, [ff](float a) { return a * ff; }); return;
    case Kind::kC64: map<float>(dst, src, 2 * count, [ff](float a) { return a * ff; }); return;
    case Kind::kF64: map<double>(dst, src, count, [factor](double a) { return a * factor; }); return;
    case Kind::kC128: map<double>(dst, src, 2 * count, [factor](double a) { return a * factor; }); return;
    default: throw InvalidArgument("premul_sum: dtype " + dtype.name() + " is not floating or complex");
  }
}

void divide_in_place(void* data, std::size_t count, DType dtype, double divisor) {
  const float fd = static_cast<float>(divisor);
  switch (kind_of(dtype)) {
    case Kind::kHalf:
      map<std::uint16_t>(data, data, count, [fd](std::uint16_t a) { return float_to_half(half_to_float(a) / fd); });
      return;
    case Kind::kBfloat:
      map<std::uint16_t>(data, data, count,
                         [fd](std::uint16_t a) { return float_to_bfloat16(bfloat16_to_float(a) / fd); });
      return;
    case Kind::kF32: map<float>(data, data, count, [fd](float a) { return a / fd; }); return;
    case Kind::kC64: map<float>(data, data, 2 * count, [fd](float a) { return a / fd; }); return;
    case Kind::kF64: map<double>(data, data, count, [divisor](double a) { return a / divisor; }); return;
    case Kind::kC128: map<double>(data, data, 2 * count, [divisor](double a) { return a / divisor; }); return;
    default: throw InvalidArgument("avg: dtype " + dtype.name() + " is not floating or complex");
  }
}

}  // namespace detail

void reduce_into(void* dst, const void* src, std::size_t count, DType dtype, ReduceOp op) {
  detail::check_reduce(dtype, op);
  if (count == 0) return;
  using namespace detail;
  switch (kind_of(dtype)) {
    case Kind::kHalf: reduce_narrow(dst, src, count, op, widen_halves, narrow_halves); return;
    case Kind::kBfloat: reduce_narrow(dst, src, count, op, widen_bfloat16, narrow_bfloat16); return;
    case Kind::kF32: reduce_float<float>(dst, src, count, op); return;
    case Kind::kF64: reduce_float<double>(dst, src, count, op); return;
    case Kind::kI8: reduce_int<std::int8_t>(dst, src, count, op); return;
    case Kind::kI16: reduce_int<std::int16_t>(dst, src, count, op); return;
    case Kind::kI32: reduce_int<std::int32_t>(dst, src, count, op); return;
    case Kind::kI64: reduce_int<std::int64_t>(dst, src, count, op); return;
    case Kind::kU8: reduce_int<std::uint8_t>(dst, src, count, op); return;
    case Kind::kU16: reduce_int<std::uint16_t>(dst, src, count, op); return;
    case Kind::kU32: reduce_int<std::uint32_t>(dst, src, count, op); return;
    case Kind::kU64: reduce_int<std::uint64_t>(dst, src, count, op); return;
    case Kind::kBool: reduce_bool(dst, src, count, op); return;
    case Kind::kC64: reduce_complex<float>(dst, src, count, op); return;
    case Kind::kC128: reduce_complex<double>(dst, src, count, op); return;
    case Kind::kNone: break;
  }
}

}  // namespace tensorwire
