// Paged decode attention for the CPU path (see kernels/cpu/__init__.py): each decode row reads its
// keys and values straight from the KV pages. Compiled with -ffp-contract=fast: attention is not
// bit-compared with the torch code (it sums in another order anyway), so it may fuse multiply-adds.

#include "common.h"

namespace tandem_cpu {

namespace {

// ---- paged decode attention ---------------------------------------------------------------------

// What both kernels read off their arguments (checked by the binding).
template <typename T>
struct Decode {
  int64_t rows, heads, dim, page_size, kv_heads, group, q_row, q_head, out_row, out_head, slot, page_stride,
      table_stride;
  const T *q, *k, *v;
  const int32_t* tables;
  const int64_t* kv_lens;
  T* out;
  float scale;
  int threads;

  explicit Decode(const DecodeArgs& a)
      : rows(a.rows), heads(a.heads), dim(a.cache.dim), page_size(a.cache.page_size), kv_heads(a.cache.kv_heads),
        group(heads / kv_heads), q_row(a.q_row), q_head(a.q_head), out_row(a.out_row), out_head(a.out_head),
        slot(kv_heads * dim), page_stride(a.cache.page_stride), table_stride(a.table_stride),
        q(static_cast<const T*>(a.q)), k(static_cast<const T*>(a.cache.k)), v(static_cast<const T*>(a.cache.v)),
        tables(a.tables), kv_lens(a.kv_lens), out(static_cast<T*>(a.out)), scale(a.scale), threads(a.threads) {}

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
  parallel_for(a.rows, 1, a.threads, [&](int64_t begin, int64_t end) {
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

// bf16/fp32 caches with head dim NV * W, written with the native-width vector type (common.h): each
// key's head vector is loaded once and dotted with every query head of its group, and the value pass
// accumulates every head's output in vectors. With the head dim a compile-time constant the short
// loops unroll; ~3x the loop version's speed at decode shapes.
template <typename T, int NV>
void decode_attention_vec(const Decode<T>& a) {
  constexpr int64_t dim = NV * W;
  const int64_t group = a.group;
  parallel_for(a.rows, 1, a.threads, [&](int64_t begin, int64_t end) {
    std::vector<vec> qv(a.heads * NV), acc(a.heads * NV);
    std::vector<float> scores, inv_sum(a.heads);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = a.kv_lens[r];
      scores.resize(a.heads * len);
      for (int64_t hh = 0; hh < a.heads; ++hh)
        for (int c = 0; c < NV; ++c) qv[hh * NV + c] = loadv(a.q + r * a.q_row + hh * a.q_head + W * c) * a.scale;
      a.for_each_slot(a.k, r, len, [&](const T* slot, int64_t j) {
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          vec key[NV];
          for (int c = 0; c < NV; ++c) key[c] = loadv(slot + h * dim + W * c);
          for (int64_t hh = h * group; hh < (h + 1) * group; ++hh) {
            vec t = qv[hh * NV] * key[0];
            for (int c = 1; c < NV; ++c) t += qv[hh * NV + c] * key[c];
            scores[hh * len + j] = hsum(t);
          }
        }
      });
      softmax_rows(scores.data(), a.heads, len, inv_sum.data());
      for (auto& x : acc) x = vec{};
      a.for_each_slot(a.v, r, len, [&](const T* slot, int64_t j) {
        for (int64_t h = 0; h < a.kv_heads; ++h) {
          vec value[NV];
          for (int c = 0; c < NV; ++c) value[c] = loadv(slot + h * dim + W * c);
          for (int64_t hh = h * group; hh < (h + 1) * group; ++hh) {
            const vec p = splat(scores[hh * len + j]);
            for (int c = 0; c < NV; ++c) acc[hh * NV + c] += p * value[c];
          }
        }
      });
      for (int64_t hh = 0; hh < a.heads; ++hh) {
        T* dst = a.out + r * a.out_row + hh * a.out_head;
        for (int c = 0; c < NV; ++c) {
          const vec o = acc[hh * NV + c] * inv_sum[hh];
          for (int i = 0; i < W; ++i) dst[W * c + i] = from_f32<T>(o[i]);
        }
      }
    }
  });
}

}  // namespace

void decode_attention(const DecodeArgs& args) {
  dispatch(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Decode<T> a(args);
    if constexpr (!std::is_same_v<T, f16_t>) {
      if (a.dim == 64) return decode_attention_vec<T, 64 / W>(a);
      if (a.dim == 128) return decode_attention_vec<T, 128 / W>(a);
    }
    decode_attention_loop<T>(a);
  });
}

}  // namespace tandem_cpu
