// RMSNorm (+ residual) and RoPE for the CPU path (see kernels/cpu/__init__.py for why and how they load).
//
// Each reads the model dtype (fp32, bf16 or fp16), computes in fp32 and rounds once where the torch
// code it replaces rounds: bit-identical to it, which is why this file is compiled with
// -ffp-contract=off (no fused multiply-adds) at every ISA level.

#include "common.h"

#ifndef TANDEM_CPU_LEVEL
#error "compile with -DTANDEM_CPU_LEVEL=\"<level>\" (kernels/cpu/__init__.py does)"
#endif

namespace tandem_cpu {

const char* level() { return TANDEM_CPU_LEVEL; }

namespace {

template <typename T>
void rms_norm_rows(const NormArgs& a) {
  const T* xp = static_cast<const T*>(a.x);
  const T* wp = static_cast<const T*>(a.weight);
  T* op = static_cast<T*>(a.out);
  const int64_t hidden = a.hidden;
  parallel_for(a.tokens, 16, a.threads, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t t = begin; t < end; ++t) {
      const T* src = xp + t * a.x_row;
      double sq = 0.;   // exact enough that the mean is (almost always) correctly rounded
      if (a.residual) {
        float* res = a.residual + t * a.residual_row;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          res[i] = res[i] + to_f32(src[i]);
          h[i] = res[i];
        }
      } else {
        to_f32(src, h.data(), hidden);
      }
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += static_cast<double>(h[i]) * h[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(sq / static_cast<double>(hidden)) + a.eps);
      T* dst = op + t * hidden;
      // As the torch code: normalise in fp32, round to the weight's dtype, then multiply by the weight
      // (a product of two model-dtype values, rounded once).
      for (int64_t i = 0; i < hidden; ++i) dst[i] = from_f32<T>(to_f32(wp[i]) * to_f32(from_f32<T>(h[i] * inv)));
    }
  });
}

template <typename T>
void rope_rows(const RopeArgs& a) {
  T* xp = static_cast<T*>(a.x);
  const int64_t half = a.dim / 2;
  parallel_for(a.tokens, 16, a.threads, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = a.cos + t * a.cs_row;
      const float* s = a.sin + t * a.cs_row;
      for (int64_t hh = 0; hh < a.heads; ++hh) {
        T* v = xp + t * a.row + hh * a.head;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(v[i]), x2 = to_f32(v[i + half]);
          const float p = x1 * c[i], q = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
          v[i] = from_f32<T>(p - q);
          v[i + half] = from_f32<T>(e + f);
        }
      }
    }
  });
}

}  // namespace

void rms_norm(const NormArgs& a) {
  dispatch(a.dtype, [&](auto tag) { rms_norm_rows<decltype(tag)>(a); });
}

void rope(const RopeArgs& a) {
  dispatch(a.dtype, [&](auto tag) { rope_rows<decltype(tag)>(a); });
}

}  // namespace tandem_cpu
