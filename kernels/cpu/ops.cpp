// Fused CPU kernels for the decode hot path (see kernels/cpu/__init__.py for why and how they load).
//
// Every kernel reads the model dtype (fp32, bf16 or fp16), computes in fp32 and rounds once where
// the torch code it replaces rounds. Loops are written so that the compiler vectorises them
// (`omp simd`, contiguous inner loops over the head or hidden dimension); `exp` is a polynomial
// that vectorises (fast_exp below). Threads: at::parallel_for, i.e. the worker's torch threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

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

// ---- paged decode attention ---------------------------------------------------------------------

// DIM > 0: the head dimension as a compile-time constant (the short dot and axpy loops then unroll
// fully: with a run-time trip count of 64 their loop control cost more than their arithmetic);
// DIM == 0: any head dimension.
template <typename T, int64_t DIM>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& tables, const at::Tensor& kv_lens, at::Tensor& out, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = DIM > 0 ? DIM : q.size(2);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t slot = kv_heads * dim, page_stride = page_size * slot;
  const int64_t table_stride = tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* lp = kv_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // One task per query row, all of its heads: each key/value slot (`kv_heads * dim` contiguous values)
  // is read once, converted to fp32 once, and used by every query head.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim), acc(heads * dim), row(slot), scores, inv_sum(heads);
    std::vector<int64_t> head_kv(heads);
    for (int64_t hh = 0; hh < heads; ++hh) head_kv[hh] = hh / group;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = lp[r];
      const int64_t pages = (len + page_size - 1) / page_size;
      const int32_t* table = tp + r * table_stride;
      scores.resize(heads * len);
      for (int64_t hh = 0; hh < heads; ++hh) {
        const T* src = qp + r * q_row + hh * q_head;
        for (int64_t d = 0; d < dim; ++d) qf[hh * dim + d] = to_f32(src[d]) * fscale;
      }
      for (int64_t pi = 0; pi < pages; ++pi) {
        const T* base = kp + table[pi] * page_stride;
        const int64_t first = pi * page_size, count = std::min(page_size, len - first);
        for (int64_t o = 0; o < count; ++o) {
          const T* key = base + o * slot;
#pragma omp simd
          for (int64_t i = 0; i < slot; ++i) row[i] = to_f32(key[i]);
          for (int64_t hh = 0; hh < heads; ++hh) {   // hh / group without a division per head
            const float* qh = qf.data() + hh * dim;
            const float* kh = row.data() + head_kv[hh] * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qh[d] * kh[d];
            scores[hh * len + first + o] = s;
          }
        }
      }
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* sh = scores.data() + hh * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < len; ++i) m = sh[i] > m ? sh[i] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < len; ++i) {
          sh[i] = fast_exp(sh[i] - m);
          sum += sh[i];
        }
        inv_sum[hh] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pi = 0; pi < pages; ++pi) {
        const T* base = vp + table[pi] * page_stride;
        const int64_t first = pi * page_size, count = std::min(page_size, len - first);
        for (int64_t o = 0; o < count; ++o) {
          const T* value = base + o * slot;
#pragma omp simd
          for (int64_t i = 0; i < slot; ++i) row[i] = to_f32(value[i]);
          for (int64_t hh = 0; hh < heads; ++hh) {
            const float p = scores[hh * len + first + o];
            const float* vh = row.data() + head_kv[hh] * dim;
            float* ah = acc.data() + hh * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ah[d] += p * vh[d];
          }
        }
      }
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* dst = op + r * out.stride(0) + hh * out.stride(1);
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_f32<T>(acc[hh * dim + d] * inv_sum[hh]);
      }
    }
  });
}

// The same for bf16/fp32 caches whose head dim is a multiple of 16, written with GCC vector types
// (one 16-float vector: a zmm register with AVX-512, two ymm with AVX2): each key's head vector is
// loaded once and dotted with every query head of its group, and the value pass accumulates every
// head's output in vectors. Measured:
// about 3x faster than the loop version above at decode shapes (docs/benchmarks.md).
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
template <typename T, int C>   // C: the head dim in 16-float vectors
__attribute__((optimize("fp-contract=fast"))) void decode_attention_vec(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& tables, const at::Tensor& kv_lens, at::Tensor& out, double scale) {
  constexpr int64_t dim = 16 * C;
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t slot = kv_heads * dim, page_stride = page_size * slot;
  const int64_t table_stride = tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* lp = kv_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // One task per query row: its pages are read front to back, whole slots (every KV head) at a time.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<v16f> qv(heads * C), acc(heads * C);
    std::vector<float> scores, inv_sum(heads);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = lp[r], pages = (len + page_size - 1) / page_size;
      const int32_t* table = tp + r * table_stride;
      scores.resize(heads * len);
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int c = 0; c < C; ++c) qv[hh * C + c] = load16(qp + r * q_row + hh * q_head + 16 * c) * fscale;
      for (int64_t pi = 0; pi < pages; ++pi) {
        const T* base = kp + table[pi] * page_stride;
        const int64_t first = pi * page_size, count = std::min(page_size, len - first);
        for (int64_t o = 0; o < count; ++o) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            v16f key[C];
            for (int c = 0; c < C; ++c) key[c] = load16(base + o * slot + h * dim + 16 * c);
            for (int64_t hh = h * group; hh < (h + 1) * group; ++hh) {
              v16f t = qv[hh * C] * key[0];
              for (int c = 1; c < C; ++c) t += qv[hh * C + c] * key[c];
              scores[hh * len + first + o] = hsum(t);
            }
          }
        }
      }
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* sg = scores.data() + hh * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < len; ++i) m = sg[i] > m ? sg[i] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < len; ++i) {
          sg[i] = fast_exp(sg[i] - m);
          sum += sg[i];
        }
        inv_sum[hh] = 1.f / sum;
      }
      for (auto& a : acc) a = v16f{};
      for (int64_t pi = 0; pi < pages; ++pi) {
        const T* base = vp + table[pi] * page_stride;
        const int64_t first = pi * page_size, count = std::min(page_size, len - first);
        for (int64_t o = 0; o < count; ++o) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            v16f value[C];
            for (int c = 0; c < C; ++c) value[c] = load16(base + o * slot + h * dim + 16 * c);
            for (int64_t hh = h * group; hh < (h + 1) * group; ++hh) {
              const float p = scores[hh * len + first + o];
              for (int c = 0; c < C; ++c) acc[hh * C + c] += p * value[c];
            }
          }
        }
      }
      for (int64_t hh = 0; hh < heads; ++hh) {
        T* dst = op + r * out.stride(0) + hh * out.stride(1);
        for (int c = 0; c < C; ++c) {
          const v16f o = acc[hh * C + c] * inv_sum[hh];
          for (int i = 0; i < 16; ++i) dst[16 * c + i] = from_f32<T>(o[i]);
        }
      }
    }
  });
}

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

// ---- checks and dispatch ---------------------------------------------------------------------------

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

template <typename Fn>
void dispatch(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& kv_lens, double scale) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &tables, &kv_lens}) check_cpu(*t, "every argument");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, dim] with unit stride in dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [pages, page_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "q's heads must be a multiple of the cache's kv heads, with the same head dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.stride(1) == 1 &&
                  tables.size(0) == q.size(0),
              "tables must be int32 [rows, max_pages]");
  TORCH_CHECK(kv_lens.scalar_type() == at::kLong && kv_lens.dim() == 1 && kv_lens.size(0) == q.size(0) &&
                  kv_lens.is_contiguous(),
              "kv_lens must be int64 [rows]");
  const int64_t max_len = tables.size(1) * k_cache.size(1);
  const int64_t* lp = kv_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < kv_lens.size(0); ++r)
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= max_len, "kv_lens[", r, "] = ", lp[r], " outside [1, ", max_len, "]");
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < tables.size(0); ++r)
    for (int64_t p = 0; p < (lp[r] + k_cache.size(1) - 1) / k_cache.size(1); ++p) {
      const int32_t page = tp[r * tables.stride(0) + p];
      TORCH_CHECK(page >= 0 && page < k_cache.size(0), "page ", page, " outside the cache");
    }
  auto out = at::empty(q.sizes(), q.options());
  const bool vec = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16;
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, c10::Half>) {
      if (vec && q.size(2) == 64) return decode_attention_vec<T, 4>(q, k_cache, v_cache, tables, kv_lens, out, scale);
      if (vec && q.size(2) == 128) return decode_attention_vec<T, 8>(q, k_cache, v_cache, tables, kv_lens, out, scale);
    }
    switch (q.size(2)) {
      case 64: decode_attention_kernel<T, 64>(q, k_cache, v_cache, tables, kv_lens, out, scale); break;
      case 128: decode_attention_kernel<T, 128>(q, k_cache, v_cache, tables, kv_lens, out, scale); break;
      default: decode_attention_kernel<T, 0>(q, k_cache, v_cache, tables, kv_lens, out, scale);
    }
  });
  return out;
}

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
  m.def("rms_norm", &rms_norm, "RMSNorm in fp32, optionally adding x into the fp32 residual in place first");
  m.def("rope_", &rope_, "rotate-half RoPE applied to q and k in place");
}
