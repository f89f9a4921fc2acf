// Paged causal attention for a prefill/extend chunk of one sequence on the CPU (see kernels/cpu/__init__.py).
// Causal: token t of an n-token chunk over kv_len keys sees keys [0, kv_len - n + t]; query heads of a
// group (GQA) share every key. Compiled with -ffp-contract=fast (not bit-compared with the torch code).
//
// Two kernels, chosen by the variant and the dtype (extend_attention at the bottom):
// - **fp32 compute** (every ISA level; fp32, bf16 and fp16 caches; head dim 64 or 128). Keys and
//   values are converted once per call from their pages into contiguous fp32 [key][dim] copies per KV
//   head (O(kv_len * dim), small next to the O(n * kv_len * dim) products). The query rows of a
//   block ((token, head of the group) pairs) lie across the lanes of C vectors, so that a score tile
//   is SK keys x C row vectors of accumulators, each key value broadcast from the packed copy
//   (no horizontal sums), and the online softmax (flash-attention style, over chunks of KC keys) is
//   element-wise: max, exp and sum run down the keys with every lane a row of its own. P.V keeps the
//   output transposed ([dim][rows]) so that its tiles are RD dims x C row vectors, each value
//   broadcast. Tile sizes fill the register file of the level: 12 of 16 ymm with AVX2, 24 of 32
//   zmm with AVX-512 (the ISA differences are these constants and the vector width, nothing else).
//   Several row blocks take each key chunk in turn while it is in cache (SB): at 2,048 tokens that
//   took the avx512 kernel from ~65 to ~145 GFLOP/s on one core, the avx2 one from ~29 to ~77.
// - **bf16 pairs** (the avx512_bf16 variant, bf16 caches): `vdpbf16ps` multiplies bf16 pairs into
//   fp32 sums at twice the rate of fp32 FMAs; each probability is split into two bf16 parts (~16
//   significant bits) for the P.V products. Keys are packed as [16-key block][dim / 2][16] pairs and
//   values as [key pair][dim]; scores are row-major and the online softmax runs over 256-key chunks.

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_EXTEND_BF16 1
#endif

namespace tandem_cpu {

namespace {

// ---- fp32 compute, any ISA --------------------------------------------------------------------------

// C vectors (of W floats, common.h) of rows per block, SK keys per score tile, RD dims per P.V tile;
// measured on Zen 4 (256-2,048 tokens, one core): C = 3 beat C = 2 and 4 at both levels.
#if defined(__AVX512F__)
constexpr int C = 3, SK = 8, RD = 8;     // 32 zmm: 24 accumulators
#else
constexpr int C = 3, SK = 4, RD = 4;     // 16 ymm (AVX2) or xmm (SSE2): 12 accumulators
#endif
constexpr int RB = C * W;          // query rows per block
constexpr int64_t KC = 120;        // keys per softmax chunk (a multiple of SK)
constexpr int64_t SB = 8;          // row blocks that share each chunk of keys (see extend_fp32)
static_assert(KC % SK == 0, "a chunk is whole score tiles");

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

inline vec vexp(vec x) { return exp_nonpositive<vec, ivec>(x); }

struct Packed {       // one KV head's keys and values as fp32 [key][dim], zero past kv_len
  const float *k, *v;
};

// Scores of SK keys (packed rows `k`) against the block's rows (Qt: [D][RB], scale folded in),
// stored as s[key][C vectors].
template <int D, int N>
inline void score_tile(const float* qt, const float* k, vec* s) {
  vec acc[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = vec{};
  for (int d = 0; d < D; ++d) {
    vec q[C];
    for (int c = 0; c < C; ++c) q[c] = loadv(qt + d * RB + c * W);
    for (int i = 0; i < N; ++i) {
      const float key = k[i * D + d];
      for (int c = 0; c < C; ++c) acc[i][c] += q[c] * key;
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) s[i * C + c] = acc[i][c];
}

// ot[d0 + i][rows] += sum over keys j < keys of v[j][d0 + i] * p[j][rows], for i < N.
template <int D, int N>
inline void pv_tile(const vec* p, const float* v, int64_t keys, int d0, vec* ot) {
  vec acc[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = ot[(d0 + i) * C + c];
  for (int64_t j = 0; j < keys; ++j) {
    vec pj[C];
    for (int c = 0; c < C; ++c) pj[c] = p[j * C + c];
    const float* vj = v + j * D + d0;
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] += pj[c] * vj[i];
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) ot[(d0 + i) * C + c] = acc[i][c];
}

template <int D>
inline void pv_chunk(const vec* p, const float* v, int64_t keys, vec* ot) {
  int d0 = 0;
  for (; d0 + RD <= D; d0 += RD) pv_tile<D, RD>(p, v, keys, d0, ot);
  constexpr int tail = D % RD;
  if constexpr (tail != 0) pv_tile<D, tail>(p, v, keys, D - tail, ot);
}

// One block's running state: rows [r0, r0 + RB) of KV head h (row r: token r / group, query head
// h * group + r % group), their queries transposed (qt: [D][RB], scale folded in), the last key each
// row sees, and the online softmax's max, sum and output (ot: [D][C vectors]).
template <int D>
struct RowBlock {
  int64_t r0, end, unmasked;   // keys [0, end) matter; keys below `unmasked` are seen by every row
  ivec limit[C];
  vec m[C], l[C];
  float qt[D * RB];
  vec ot[D * C];
};

template <typename T, int D>
void start_block(const ExtendArgs& a, int64_t h, int64_t r0, RowBlock<D>& b) {
  const int64_t group = a.heads / a.cache.kv_heads, rows = a.n * group, first = a.kv_len - a.n;
  int32_t limit[RB];
  for (int lane = 0; lane < RB; ++lane) {
    const int64_t r = r0 + lane;
    float* col = b.qt + lane;
    if (r < rows) {
      const T* src = static_cast<const T*>(a.q) + (r / group) * a.q_row + (h * group + r % group) * a.q_head;
      for (int d = 0; d < D; ++d) col[d * RB] = to_f32(src[d]) * a.scale;
      limit[lane] = static_cast<int32_t>(first + r / group);
    } else {   // padding rows: zeros over every key, written nowhere
      for (int d = 0; d < D; ++d) col[d * RB] = 0.f;
      limit[lane] = static_cast<int32_t>(a.kv_len - 1);
    }
  }
  std::memcpy(b.limit, limit, sizeof limit);
  b.r0 = r0;
  b.end = first + (std::min(r0 + RB, rows) - 1) / group + 1;
  b.unmasked = first + r0 / group + 1;
  for (int c = 0; c < C; ++c) {
    b.m[c] = splat(-std::numeric_limits<float>::infinity());
    b.l[c] = vec{};
  }
  for (int i = 0; i < D * C; ++i) b.ot[i] = vec{};
}

// Keys [c0, c0 + KC) (or fewer, up to b.end) into block b's online softmax and output; s: scratch.
template <int D>
void add_chunk(const Packed& kv, int64_t c0, RowBlock<D>& b, vec* s) {
  const int64_t keys = (std::min(KC, b.end - c0) + SK - 1) / SK * SK;   // past end: masked below
  for (int64_t j = 0; j < keys; j += SK) score_tile<D, SK>(b.qt, kv.k + (c0 + j) * D, s + j * C);
  if (c0 + keys > b.unmasked) {
    for (int64_t j = std::max<int64_t>(0, b.unmasked - c0); j < keys; ++j) {
      const ivec key = ivec{} + static_cast<int32_t>(c0 + j);
      for (int c = 0; c < C; ++c)
        s[j * C + c] = key <= b.limit[c] ? s[j * C + c] : splat(-std::numeric_limits<float>::infinity());
    }
  }
  for (int c = 0; c < C; ++c) {   // online softmax, every lane a row
    vec mx = b.m[c];
    for (int64_t j = 0; j < keys; ++j) mx = vmax(mx, s[j * C + c]);
    const vec alpha = vexp(b.m[c] - mx);   // 0 on the first chunk (m = -inf)
    vec sum = vec{};
    for (int64_t j = 0; j < keys; ++j) {
      const vec p = vexp(s[j * C + c] - mx);
      s[j * C + c] = p;
      sum += p;
    }
    b.l[c] = b.l[c] * alpha + sum;
    b.m[c] = mx;
    for (int d = 0; d < D; ++d) b.ot[d * C + c] *= alpha;
  }
  pv_chunk<D>(s, kv.v + c0 * D, keys, b.ot);
}

template <typename T, int D>
void finish_block(const ExtendArgs& a, int64_t h, const RowBlock<D>& b) {
  const int64_t group = a.heads / a.cache.kv_heads, rows = a.n * group;
  for (int lane = 0; lane < RB && b.r0 + lane < rows; ++lane) {
    const int64_t r = b.r0 + lane;
    T* dst = static_cast<T*>(a.out) + (r / group) * a.out_row + (h * group + r % group) * a.out_head;
    const int c = lane / W, i = lane % W;
    const float inv = 1.f / b.l[c][i];
    for (int d = 0; d < D; ++d) dst[d] = from_f32<T>(b.ot[d * C + c][i] * inv);
  }
}

template <typename T, int D>
void extend_fp32(const ExtendArgs& a) {
  const int64_t kv_heads = a.cache.kv_heads, slot = kv_heads * D, page_stride = a.cache.page_stride;
  const int64_t padded = (a.kv_len + KC - 1) / KC * KC + SK, stride = padded * D;
  std::vector<float> keys(kv_heads * stride), values(kv_heads * stride);
  // Pack: page p's keys for every head, converted to fp32; the zero tail stays zero.
  const int64_t ps = a.cache.page_size, pages = (a.kv_len + ps - 1) / ps;
  parallel_for(pages, 4, a.threads, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t base = a.table[p] * page_stride, count = std::min(ps, a.kv_len - p * ps);
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t o = 0; o < count; ++o) {
          const int64_t src = base + o * slot + h * D, dst = h * stride + (p * ps + o) * D;
          to_f32(static_cast<const T*>(a.cache.k) + src, keys.data() + dst, D);
          to_f32(static_cast<const T*>(a.cache.v) + src, values.data() + dst, D);
        }
    }
  });
  // A task is up to SB consecutive row blocks of one KV head, which take each key chunk in turn while
  // it is in cache (the packed keys and values of a long sequence are L3-sized: read once per task,
  // not once per block). Causal tasks grow with their position: heaviest first, dealt to the threads
  // in turn (contiguous ranges would give one thread all the long ones).
  const int64_t group = a.heads / kv_heads, blocks = (a.n * group + RB - 1) / RB;
  const int64_t supers = (blocks + SB - 1) / SB, tasks = kv_heads * supers;
  const int threads = static_cast<int>(std::min<int64_t>(a.threads, tasks));
  parallel_for(threads, 1, threads, [&](int64_t tb, int64_t te) {
    std::vector<RowBlock<D>> state(SB);
    std::vector<vec> s((KC + SK) * C);
    for (int64_t tid = tb; tid < te; ++tid)
      for (int64_t task = tid; task < tasks; task += threads) {
        const int64_t h = task % kv_heads, sb = supers - 1 - task / kv_heads;
        const int64_t b0 = sb * SB, nb = std::min<int64_t>(SB, blocks - b0);
        const Packed kv{keys.data() + h * stride, values.data() + h * stride};
        for (int64_t i = 0; i < nb; ++i) start_block<T, D>(a, h, (b0 + i) * RB, state[i]);
        for (int64_t c0 = 0; c0 < state[nb - 1].end; c0 += KC)
          for (int64_t i = 0; i < nb; ++i)
            if (c0 < state[i].end) add_chunk<D>(kv, c0, state[i], s.data());
        for (int64_t i = 0; i < nb; ++i) finish_block<T, D>(a, h, state[i]);
      }
  });
}

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
        words(dim / 2), page_size(a.cache.page_size), slot(kv_heads * dim), page_stride(a.cache.page_stride),
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
  // Heaviest blocks first, dealt to the threads in turn (as extend_fp32).
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
  (void)dtype;   // every storage type: fp32 compute converts on packing (bf16 pairs where the CPU has them)
  return dim == 64 || dim == 128;
}

void extend_attention(const ExtendArgs& a) {
#ifdef TANDEM_EXTEND_BF16
  if (a.dtype == DType::bf16) return extend_bf16(a);
#endif
  dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (a.cache.dim == 64) extend_fp32<T, 64>(a);
    else extend_fp32<T, 128>(a);
  });
}

}  // namespace tandem_cpu
