// Fused CPU kernels for the hot path (see kernels/cpu/__init__.py for why and how they load).
//
// Every kernel reads the model dtype (fp32, bf16 or fp16), computes in fp32 and rounds once where
// the torch code it replaces rounds. Loops are written so that the compiler vectorises them
// (`omp simd`, contiguous inner loops over the head or hidden dimension, GCC vector types);
// `exp` is a polynomial (common.h). Attention lives in attention.cpp (decode) and extend.cpp
// (prefill, bf16 pairs rather than fp32). Threads: at::parallel_for, i.e. the worker's torch threads.

#include "common.h"

using namespace tandem_cpu;

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& kv_lens, double scale);
at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& table, int64_t kv_len, double scale);
bool extend_attention_supported(int64_t dim);

namespace {

// ---- RMSNorm, optionally with the residual add ---------------------------------------------------

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                     at::Tensor& out, double eps) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const int64_t x_stride = x.stride(0), r_stride = rp ? residual->stride(0) : 0;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t t = begin; t < end; ++t) {
      const T* src = xp + t * x_stride;
      double sq = 0.;   // exact enough that the mean is (almost always) correctly rounded
      if (rp) {
        float* res = rp + t * r_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          res[i] = res[i] + to_f32(src[i]);
          h[i] = res[i];
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) h[i] = to_f32(src[i]);
      }
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += static_cast<double>(h[i]) * h[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(sq / static_cast<double>(hidden)) + static_cast<float>(eps));
      T* dst = op + t * hidden;
      // As the torch code: normalise in fp32, round to the weight's dtype, then multiply by the weight
      // (a product of two model-dtype values, rounded once).
      for (int64_t i = 0; i < hidden; ++i) dst[i] = from_f32<T>(to_f32(wp[i]) * to_f32(from_f32<T>(h[i] * inv)));
    }
  });
}

// ---- rotary embedding (rotate-half), in place on q and k -----------------------------------------

template <typename T>
void rope_rows(at::Tensor& x, const float* cp, const float* sp, int64_t cs_stride) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.data_ptr<T>();
  const int64_t row = x.stride(0), head = x.stride(1);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * cs_stride;
      const float* s = sp + t * cs_stride;
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* v = xp + t * row + hh * head;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(v[i]), x2 = to_f32(v[i + half]);
          const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
          v[i] = from_f32<T>(a - b);
          v[i + half] = from_f32<T>(e + f);
        }
      }
    }
  });
}


}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, hidden] with unit stride in hidden");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [hidden] in x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->sizes() == x.sizes() &&
                    residual->stride(1) == 1,
                "residual must be fp32 with x's shape");
  }
  auto out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), [&](auto tag) { rms_norm_kernel<decltype(tag)>(x, residual, weight, out, eps); });
  return out;
}

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&q), static_cast<const at::Tensor*>(&k), &cos, &sin})
    check_cpu(*t, "every argument");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "q and k must be [tokens, heads, dim] with an even dim of unit stride");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) / 2 &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0),
              "cos and sin must be fp32 [tokens, dim / 2]");
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rope_rows<T>(q, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
    rope_rows<T>(k, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query row per sequence over its KV pages (GQA), fp32 softmax; returns [rows, heads, dim]");
  m.def("paged_extend_attention", &paged_extend_attention,
        "causal attention of one sequence's n new tokens over its KV pages, bf16 (AVX512-BF16); [n, heads, dim]");
  m.def("extend_attention_supported", &extend_attention_supported,
        "whether paged_extend_attention was built for this CPU and takes this head dim");
  m.def("rms_norm", &rms_norm, "RMSNorm in fp32, optionally adding x into the fp32 residual in place first");
  m.def("rope_", &rope_, "rotate-half RoPE applied to q and k in place");
}
