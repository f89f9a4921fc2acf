// Paged causal attention for a prefill/extend chunk of one sequence on the CPU (see kernels/cpu/__init__.py).
// Causal: token t of an n-token chunk over kv_len keys sees keys [0, kv_len - n + t]; query heads of a
// group (GQA) share every key. Compiled with -ffp-contract=fast (not bit-compared with the torch code).
//
// bf16 caches in the avx512_bf16 variant (the only one with this kernel; elsewhere the engine runs SDPA):
// `vdpbf16ps` multiplies bf16 pairs into fp32 sums at twice the rate of fp32 FMAs; each probability is
// split into two bf16 parts (~16 significant bits) for the P.V products. Keys are packed as [16-key
// block][dim / 2][16] pairs and values as [key pair][dim]; scores are row-major and the online softmax
// (flash-attention style) runs over 256-key chunks, per block of 32 query tokens.

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_EXTEND_BF16 1
#endif

namespace tandem_cpu {

namespace {

// ---- bf16 pairs, AVX512-BF16 ------------------------------------------------------------------------

#ifdef TANDEM_EXTEND_BF16

constexpr int64_t kTokens = 32;   // query tokens per block
constexpr int64_t kChunk = 256;   // keys per softmax chunk (a multiple of 64)

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

struct Bf16Extend {
  int64_t n, heads, kv_heads, group, dim, words, page_size, slot, page_stride, q_row, q_head, out_row, out_head,
      kv_len, padded;
  const uint16_t *q, *k, *v;
  const int32_t* table;
  uint16_t* out;
  float scale;
  int threads;

  explicit Bf16Extend(const ExtendArgs& a)
      : n(a.n), heads(a.heads), kv_heads(a.cache.kv_heads), group(heads / kv_heads), dim(a.cache.dim),
        words(dim / 2), page_size(a.cache.page_size), slot(kv_heads * dim), page_stride(page_size * slot),
        q_row(a.q_row), q_head(a.q_head), out_row(a.out_row), out_head(a.out_head), kv_len(a.kv_len),
        padded((kv_len + 63) / 64 * 64), q(static_cast<const uint16_t*>(a.q)),
        k(static_cast<const uint16_t*>(a.cache.k)), v(static_cast<const uint16_t*>(a.cache.v)), table(a.table),
        out(static_cast<uint16_t*>(a.out)), scale(a.scale), threads(a.threads) {}

  const uint16_t* key(const uint16_t* cache, int64_t j, int64_t h) const {
    return cache + table[j / page_size] * page_stride + (j % page_size) * slot + h * dim;
  }
};

// K of KV head h as [padded / 16][words][16] uint32 (key j's bf16 pair p at [j / 16][p][j % 16]);
// V as [padded / 2][dim] uint32 (keys 2t and 2t + 1 of dim d at [t][d]). Zero past kv_len.
void pack(const Bf16Extend& a, int64_t h, uint32_t* kp, uint32_t* vp) {
  std::memset(kp, 0, a.padded * a.words * 4);
  std::memset(vp, 0, a.padded / 2 * a.dim * 4);
  for (int64_t j = 0; j < a.kv_len; ++j) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(a.key(a.k, j, h));
    uint32_t* dst = kp + (j / 16) * a.words * 16 + j % 16;
    for (int64_t p = 0; p < a.words; ++p) dst[p * 16] = src[p];
    const uint16_t* val = a.key(a.v, j, h);
    uint16_t* vdst = reinterpret_cast<uint16_t*>(vp + (j / 2) * a.dim) + (j % 2);
    for (int64_t d = 0; d < a.dim; ++d) vdst[2 * d] = val[d];
  }
}

// scores[i][0, 64) = scale * q_i . keys[first, first + 64) for R query rows.
template <int R>
inline void bf16_score_tile(const uint32_t* const* qw, const uint32_t* kp, int64_t words, float scale,
                            float* const* out) {
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < words; ++p) {
    __m512i kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_si512(kp + (c * words + p) * 16);
    for (int i = 0; i < R; ++i) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(qw[i][p]));
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(qb), as_bh(kv[c]));
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out[i] + 16 * c, _mm512_mul_ps(acc[i][c], s));
}

// o_i[0, 16 C) += sum over key pairs t < pairs of p_i[2t, 2t + 1] . V pairs, for R rows; each
// probability is the sum of two bf16 values (high part at pw[i], low part `lo` words further).
template <int R, int NC>
inline void bf16_pv_tile(const uint32_t* const* pw, int64_t lo, const uint32_t* vp, int64_t dim, int64_t pairs,
                         float* const* o) {
  __m512 acc[R][NC];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_loadu_ps(o[i] + 16 * c);
  for (int64_t t = 0; t < pairs; ++t) {
    __m512i vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_si512(vp + t * dim + 16 * c);
    for (int i = 0; i < R; ++i) {
      const __m512i hi = _mm512_set1_epi32(static_cast<int>(pw[i][t]));
      const __m512i low = _mm512_set1_epi32(static_cast<int>(pw[i][t + lo]));
      for (int c = 0; c < NC; ++c) {
        acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(hi), as_bh(vv[c]));
        acc[i][c] = _mm512_dpbf16_ps(acc[i][c], as_bh(low), as_bh(vv[c]));
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o[i] + 16 * c, acc[i][c]);
}

template <int NC>
void bf16_block(const Bf16Extend& a, int64_t h, int64_t t0, int64_t t1, const uint32_t* kp, const uint32_t* vp) {
  constexpr int RP = NC <= 4 ? 4 : 2;   // rows per P.V tile: R * NC = 16 accumulators
  const int64_t rows = (t1 - t0) * a.group, dim = a.dim;
  std::vector<float> scores(rows * kChunk), acc(rows * dim, 0.f), mx(rows, -std::numeric_limits<float>::infinity()),
      sum(rows, 0.f);
  std::vector<uint16_t> probs(rows * 2 * kChunk);   // per row: kChunk high parts, then kChunk low parts
  std::vector<const uint32_t*> qw(rows);
  std::vector<int64_t> limit(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / a.group, head = h * a.group + r % a.group;
    qw[r] = reinterpret_cast<const uint32_t*>(a.q + t * a.q_row + head * a.q_head);
    limit[r] = a.kv_len - a.n + t + 1;
  }
  const int64_t end = limit[rows - 1];
  for (int64_t c0 = 0; c0 < end; c0 += kChunk) {
    const int64_t kc = std::min(kChunk, end - c0), tiles = (kc + 63) / 64, pairs = (kc + 1) / 2;
    for (int64_t r = 0; r < rows; r += 4) {
      float* out[4];
      const int rr = static_cast<int>(std::min<int64_t>(4, rows - r));
      for (int i = 0; i < rr; ++i) out[i] = scores.data() + (r + i) * kChunk;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const uint32_t* kt = kp + (c0 / 16 + tile * 4) * a.words * 16;
        float* o[4];
        for (int i = 0; i < rr; ++i) o[i] = out[i] + tile * 64;
        switch (rr) {
          case 4: bf16_score_tile<4>(&qw[r], kt, a.words, a.scale, o); break;
          case 3: bf16_score_tile<3>(&qw[r], kt, a.words, a.scale, o); break;
          case 2: bf16_score_tile<2>(&qw[r], kt, a.words, a.scale, o); break;
          default: bf16_score_tile<1>(&qw[r], kt, a.words, a.scale, o); break;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {   // online softmax over this chunk
      float* s = scores.data() + r * kChunk;
      uint16_t *p = probs.data() + r * 2 * kChunk, *plo = p + kChunk;
      const int64_t valid = std::clamp<int64_t>(limit[r] - c0, 0, kc);
      if (valid == 0) {
        std::fill(p, p + 2 * pairs, uint16_t{0});
        std::fill(plo, plo + 2 * pairs, uint16_t{0});
        continue;
      }
      float m = mx[r];
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < valid; ++j) m = s[j] > m ? s[j] : m;
      const float alpha = fast_exp(mx[r] - m);   // 0 on the first chunk (mx = -inf)
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < valid; ++j) {
        s[j] = fast_exp(s[j] - m);
        total += s[j];
      }
      for (int64_t j = 0; j < valid; j += 16) {   // p = hi + lo, both bf16 (vcvtneps2bf16: nearest even)
        const __m512 x = _mm512_loadu_ps(s + j);
        const __m256i hi = (__m256i)_mm512_cvtneps_pbh(x);
        const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(plo + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, back)));
      }
      std::fill(p + valid, p + 2 * pairs, uint16_t{0});
      std::fill(plo + valid, plo + 2 * pairs, uint16_t{0});
      if (mx[r] != m) {
        float* o = acc.data() + r * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] *= alpha;
      }
      sum[r] = sum[r] * alpha + total;
      mx[r] = m;
    }
    const uint32_t* vc = vp + (c0 / 2) * dim;
    for (int64_t r = 0; r < rows; r += RP) {
      const int rr = static_cast<int>(std::min<int64_t>(RP, rows - r));
      const uint32_t* pw[RP];
      float* o[RP];
      for (int i = 0; i < rr; ++i) {
        pw[i] = reinterpret_cast<const uint32_t*>(probs.data() + (r + i) * 2 * kChunk);
        o[i] = acc.data() + (r + i) * dim;
      }
      if (rr == RP) {
        bf16_pv_tile<RP, NC>(pw, kChunk / 2, vc, dim, pairs, o);
      } else {
        for (int i = 0; i < rr; ++i) bf16_pv_tile<1, NC>(pw + i, kChunk / 2, vc, dim, pairs, o + i);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / a.group, head = h * a.group + r % a.group;
    uint16_t* dst = a.out + t * a.out_row + head * a.out_head;
    const float inv = 1.f / sum[r];
    const float* o = acc.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = from_f32<bf16_t>(o[d] * inv).bits;
  }
}

void extend_bf16(const ExtendArgs& args) {
  const Bf16Extend a(args);
  const int64_t kstride = a.padded * a.words, vstride = a.padded / 2 * a.dim;
  std::vector<uint32_t> kp(a.kv_heads * kstride), vp(a.kv_heads * vstride);
  parallel_for(a.kv_heads, 1, a.threads, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) pack(a, h, kp.data() + h * kstride, vp.data() + h * vstride);
  });
  // Causal blocks grow with their position: tasks go heaviest first, dealt to the threads in turn
  // (contiguous ranges would give one thread all the long blocks).
  const int64_t blocks = (a.n + kTokens - 1) / kTokens, tasks = a.kv_heads * blocks;
  const int threads = static_cast<int>(std::min<int64_t>(a.threads, tasks));
  parallel_for(threads, 1, threads, [&](int64_t b, int64_t e) {
    for (int64_t tid = b; tid < e; ++tid)
      for (int64_t task = tid; task < tasks; task += threads) {
        const int64_t h = task % a.kv_heads, blk = blocks - 1 - task / a.kv_heads;
        const int64_t t0 = blk * kTokens, t1 = std::min(a.n, t0 + kTokens);
        const uint32_t *k = kp.data() + h * kstride, *v = vp.data() + h * vstride;
        if (a.dim == 64) bf16_block<4>(a, h, t0, t1, k, v);
        else bf16_block<8>(a, h, t0, t1, k, v);
      }
  });
}

#endif  // TANDEM_EXTEND_BF16

}  // namespace

bool extend_supported(DType dtype, int64_t dim) {
#ifdef TANDEM_EXTEND_BF16
  return dtype == DType::bf16 && (dim == 64 || dim == 128);   // the P.V tiles hold 4 x 4 or 2 x 8 accumulators
#else
  (void)dtype, (void)dim;
  return false;
#endif
}

void extend_attention(const ExtendArgs& a) {
#ifdef TANDEM_EXTEND_BF16
  extend_bf16(a);
#else
  (void)a;   // extend_supported() is false: the binding refuses every call
#endif
}

}  // namespace tandem_cpu
