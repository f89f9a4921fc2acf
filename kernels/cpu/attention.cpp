// Paged decode attention for the CPU path (see kernels/cpu/__init__.py): each decode row reads its
// keys and values straight from the KV pages.

#include "common.h"

using namespace tandem_cpu;

namespace {

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
#pragma omp simd reduction(max : m)
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
#pragma omp simd reduction(max : m)
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
