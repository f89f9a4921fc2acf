// Shared helpers of the CPU kernels (kernels/cpu): model-dtype storage types and their conversions,
// a vectorisable exp, GCC vector types, and a parallel loop on torch's OpenMP runtime. Torch-free:
// the kernel sources include this and kernels.h only, so that each ISA variant compiles in seconds.
#pragma once

#include "kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace tandem_cpu {

// ---- storage types: the kernels read and write the model dtype, compute in fp32 -------------------

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
// Round to nearest even, NaN to the quiet NaN: bit for bit what c10::BFloat16(float) does.
template <> inline bf16_t from_f32<bf16_t>(float x) {
  if (std::isnan(x)) return {0x7FC0};
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return {static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFF) >> 16)};
}

// fp16 through the compiler's _Float16 (exact widening, round-to-nearest-even narrowing, as c10::Half).
#ifdef __FLT16_MAX__
inline float to_f32(f16_t x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}
template <> inline f16_t from_f32<f16_t>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  f16_t out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}
#else
#error "the CPU kernels need a compiler with _Float16 (GCC 12+, Clang 15+)"
#endif

// Calls fn(T{}) with the storage type of `dtype`.
template <typename Fn>
inline void dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: fn(float{}); break;
    case DType::bf16: fn(bf16_t{}); break;
    case DType::f16: fn(f16_t{}); break;
  }
}

// exp(x) for x <= 0 (softmax after the max is subtracted), on a float or a GCC vector of floats (I:
// the matching int32 type). Cody-Waite range reduction and a degree-6 polynomial: relative error
// < 2e-7 over [-87, 0]; exactly 0 below, so that masked scores (-inf) weigh nothing. n is rounded with
// the 1.5 * 2^23 trick rather than nearbyint so that it vectorises without SSE4.1 (generic x86).
template <typename V, typename I = int32_t>
inline V exp_nonpositive(V x) {
  const V xc = x < -87.0f ? V{} - 87.0f : x;
  const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I bits;
  if constexpr (std::is_same_v<V, float>) bits = (static_cast<int32_t>(n) + 127) << 23;
  else bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? V{} : p * scale;
}

#pragma omp declare simd notinbranch
inline float fast_exp(float x) { return exp_nonpositive(x); }

// ---- GCC vector types of the target's native width: one source for every ISA --------------------
// (A wider type than the registers, e.g. 64 bytes under AVX2, is lowered piecewise and builds its
// scalar broadcasts through the stack: decode ran 6x slower than with the native 32 bytes.)

#if defined(__AVX512F__)
constexpr int W = 16;   // floats per vector: a zmm
#elif defined(__AVX__)
constexpr int W = 8;    // a ymm
#else
constexpr int W = 4;    // an xmm (SSE2) or a NEON q register
#endif

typedef float vec __attribute__((vector_size(W * 4)));
typedef int32_t ivec __attribute__((vector_size(W * 4)));
typedef uint32_t uvec __attribute__((vector_size(W * 4)));
typedef uint16_t hvec __attribute__((vector_size(W * 2)));

inline vec splat(float x) { return vec{} + x; }
inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vec loadv(const bf16_t* p) {
  hvec h;
  std::memcpy(&h, p, sizeof h);
  const uvec u = __builtin_convertvector(h, uvec) << 16;
  vec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline vec loadv(const f16_t* p) {
  vec v;
  for (int i = 0; i < W; ++i) v[i] = to_f32(p[i]);
  return v;
}
inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
inline float hsum(v4f v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float hsum(v8f v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
#if defined(__AVX512F__)
inline float hsum(vec v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
#endif

// Converts n model-dtype values to fp32 (vectorised for every storage type).
template <typename T>
inline void to_f32(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// ---- threads ---------------------------------------------------------------------------------------

// fn(begin, end) over [0, n) in at most `threads` contiguous ranges of at least `grain` items, as
// at::parallel_for does: an OpenMP team on the runtime torch loaded (the kernels link libgomp.so.1,
// the soname of torch's own copy), sized by the torch thread count the binding passes in; inline when
// one range does or when already inside a parallel region.
template <typename Fn>
inline void parallel_for(int64_t n, int64_t grain, int threads, const Fn& fn) {
  if (n <= 0) return;
  const int64_t team = std::min<int64_t>(threads, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (team <= 1 || omp_in_parallel()) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(team))
  {
    const int64_t size = omp_get_num_threads(), chunk = (n + size - 1) / size;
    const int64_t begin = omp_get_thread_num() * chunk, end = std::min(n, begin + chunk);
    if (begin < end) fn(begin, end);
  }
}

}  // namespace tandem_cpu
