// Shared helpers of the CPU kernels (kernels/cpu): dtype conversion, a vectorisable exp, GCC vector
// types, argument checks and dtype dispatch. Header-only; each .cpp includes it.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace tandem_cpu {

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) {
  uint16_t bits;
  std::memcpy(&bits, &x, 2);
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

template <typename T> inline T from_f32(float x) { return static_cast<T>(x); }  // round to nearest even

// exp(x) for x <= 0 (softmax after the max is subtracted; SiLU's exp(-|x|)). Cody-Waite range
// reduction and a degree-6 polynomial: relative error < 2e-7 over [-87, 0], 0 below.
#pragma omp declare simd notinbranch
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}


typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16f load16(const c10::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline float hsum(v16f v) {
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Attention is not bit-compared with the torch code (it sums in another order anyway), so it may fuse
// multiply-adds; the file's -ffp-contract=off keeps RoPE and the norm bit-identical.

// ---- checks and dispatch ---------------------------------------------------------------------------

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

template <typename Fn>
inline void dispatch(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
}


}  // namespace tandem_cpu
