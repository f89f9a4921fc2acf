// Paged decode attention for the CPU path (see kernels/cpu/__init__.py): each decode row reads its
// keys and values straight from the KV pages.

#include "common.h"

using namespace tandem_cpu;

namespace {

// ---- paged decode attention ---------------------------------------------------------------------

// What both kernels read off their arguments (checked by paged_decode_attention).
template <typename T>
struct Decode {
  int64_t rows, heads, dim, page_size, kv_heads, group, q_row, q_head, out_row, out_head, slot, page_stride,
      table_stride;
  const T *q, *k, *v;
  const int32_t* tables;
  const int64_t* kv_lens;
  T* out;
  float scale;

  Decode(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables_,
         const at::Tensor& kv_lens_, at::Tensor& out_, double scale_)
      : rows(q_.size(0)), heads(q_.size(1)), dim(q_.size(2)), page_size(k_cache.size(1)),
        kv_heads(k_cache.size(2)), group(heads / kv_heads), q_row(q_.stride(0)), q_head(q_.stride(1)),
        out_row(out_.stride(0)), out_head(out_.stride(1)), slot(kv_heads * dim), page_stride(page_size * slot),
        table_stride(tables_.stride(0)), q(q_.data_ptr<T>()), k(k_cache.data_ptr<T>()), v(v_cache.data_ptr<T>()),
        tables(tables_.data_ptr<int32_t>()), kv_lens(kv_lens_.data_ptr<int64_t>()), out(out_.data_ptr<T>()),
        scale(static_cast<float>(scale_)) {}

  // fn(slot, j) for each key j < len of row r, in order; `slot` points at its kv_heads * dim values
  // in `cache` (the K or the V pages).
  template <typename Fn>
  void for_each_slot(const T* cache, int64_t r, int64_t len, Fn&& fn) const {
    const int32_t* table = tables + r * table_stride;
    for (int64_t first = 0; first < len; first += page_size) {
      const T* base = cache + table[first / page_size] * page_stride;
      const int64_t count = std::min(page_size, len - first);
      for (int64_t o = 0; o < count; ++o) fn(base + o * slot, first + o);
    }
  }
};

// scores[h * len + i] <- exp(score - max over i) for each head h; inv_sum[h] <- 1 / their sum.
inline void softmax_rows(float* scores, int64_t heads, int64_t len, float* inv_sum) {
  for (int64_t hh = 0; hh < heads; ++hh) {
    float* sh = scores + hh * len;
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
}

// Any dtype and head dimension (fp16 caches, head dims that are not 64 or 128). One task per query
// row, all of its heads: each key/value slot (`kv_heads * dim` contiguous values) is read once,
// converted to fp32 once, and used by every query head.
template <typename T>
void decode_attention_loop(const Decode<T>& a) {
  const int64_t dim = a.dim, group = a.group;
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(a.heads * dim), acc(a.heads * dim), row(a.slot), scores, inv_sum(a.heads);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = a.kv_lens[r];
      scores.resize(a.heads * len);
      for (int64_t hh = 0; hh < a.heads; ++hh) {
        const T* src = a.q + r * a.q_row + hh * a.q_head;
        for (int64_t d = 0; d < dim; ++d) qf[hh * dim + d] = to_f32(src[d]) * a.scale;
      }
      a.for_each_slot(a.k, r, len, [&](const T* key, int64_t j) {
#pragma omp simd
        for (int64_t i = 0; i < a.slot; ++i) row[i] = to_f32(key[i]);
        for (int64_t hh = 0; hh < a.heads; ++hh) {
          const float* qh = qf.data() + hh * dim;
          const float* kh = row.data() + (hh / group) * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qh[d] * kh[d];
          scores[hh * len + j] = s;
        }
      });
      softmax_rows(scores.data(), a.heads, len, inv_sum.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      a.for_each_slot(a.v, r, len, [&](const T* value, int64_t j) {
#pragma omp simd
        for (int64_t i = 0; i < a.slot; ++i) row[i] = to_f32(value[i]);
        for (int64_t hh = 0; hh < a.heads; ++hh) {
          const float p = scores[hh * len + j];
          const float* vh = row.data() + (hh / group) * dim;
          float* ah = acc.data() + hh * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ah[d] += p * vh[d];
        }
      });
      for (int64_t hh = 0; hh < a.heads; ++hh) {
        T* dst = a.out + r * a.out_row + hh * a.out_head;
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_f32<T>(acc[hh * dim + d] * inv_sum[hh]);
      }
    }
  });
}

// bf16/fp32 caches with head dim 16 * C, written with GCC vector types (one 16-float vector: a zmm
// register with AVX-512, two ymm with AVX2): each key's head vector is loaded once and dotted with
// every query head of its group, and the value pass accumulates every head's output in vectors.
// With the head dim a compile-time constant the short loops unroll; ~3x the loop version's speed at
// decode shapes. Attention is not bit-compared with the torch code (it sums in another order anyway),
// so it may fuse multiply-adds; the file's -ffp-contract=off keeps RoPE and the norm bit-identical.
template <typename T, int C>
__attribute__((optimize("fp-contract=fast"))) void decode_attention_vec(const Decode<T>& a) {
  constexpr int64_t dim = 16 * C;
  const int64_t group = a.group;
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<v16f> qv(a.heads * C), acc(a.heads * C);
    std::vector<float> scores, inv_sum(a.heads);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = a.kv_lens[r];
      scores.resize(a.heads * len);
      for (int64_t hh = 0; hh < a.heads; ++hh)
        for (int c = 0; c < C; ++c) qv[hh * C + c] = load16(a.q + r * a.q_row + hh * a.q_head + 16 * c) * a.scale;
      a.for_each_slot(a.k, r, len, [&](const T* slot, int64_t j) {
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          v16f key[C];
          for (int c = 0; c < C; ++c) key[c] = load16(slot + h * dim + 16 * c);
          for (int64_t hh = h * group; hh < (h + 1) * group; ++hh) {
            v16f t = qv[hh * C] * key[0];
            for (int c = 1; c < C; ++c) t += qv[hh * C + c] * key[c];
            scores[hh * len + j] = hsum(t);
          }
        }
      });
      softmax_rows(scores.data(), a.heads, len, inv_sum.data());
      for (auto& x : acc) x = v16f{};
      a.for_each_slot(a.v, r, len, [&](const T* slot, int64_t j) {
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          v16f value[C];
          for (int c = 0; c < C; ++c) value[c] = load16(slot + h * dim + 16 * c);
          for (int64_t hh = h * group; hh < (h + 1) * group; ++hh) {
            const float p = scores[hh * len + j];
            for (int c = 0; c < C; ++c) acc[hh * C + c] += p * value[c];
          }
        }
      });
      for (int64_t hh = 0; hh < a.heads; ++hh) {
        T* dst = a.out + r * a.out_row + hh * a.out_head;
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
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const Decode<T> args(q, k_cache, v_cache, tables, kv_lens, out, scale);
    if constexpr (!std::is_same_v<T, c10::Half>) {
      if (q.size(2) == 64) return decode_attention_vec<T, 4>(args);
      if (q.size(2) == 128) return decode_attention_vec<T, 8>(args);
    }
    decode_attention_loop<T>(args);
  });
  return out;
}
