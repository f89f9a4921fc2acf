// Mixed-adapter LoRA for the CPU path (see kernels/cpu/__init__.py; engine/lora/batch.py calls it after
// each projection). For each token row t whose adapter is s = slots[t] (-1: the base model's row, never
// read or written) and each part p of s (a fused q/k/v or gate/up projection has one part per adapted
// module: its own block of rank columns in the stacked weights and its own output columns):
//
//     xa = round(x[t] · A[col : col + rank]ᵀ)                                fp32 sums
//     y[t, out : out + len] = round(y[t, out : out + len] + xa · Bᵀ[col : col + rank, out : out + len])
//
// reading the registry's stacked weights in place: A [S, in] (each adapter's rank rows side by side) and
// Bᵀ [S, out] (B stored transposed, so a part's rank rows are contiguous over the outputs it writes). A
// row is multiplied by its own adapter only, and a part by its own output columns only: no other
// adapter's weights, no zero blocks of a fused B, no gather of x or y, no padding.
//
// Work: the rows are grouped by adapter (a counting sort of indices; the data stays where it is) into
// tiles of up to TILE rows, so that a tile reads each weight once and reuses it from L1 for all its rows.
// Two phases in one OpenMP team: the shrink (tasks: a tile's part by ACC rank columns) fills an xa per
// (part, tile); after a barrier the expand (tasks: a tile's part by BLOCK output columns) adds it into y.
// Each phase's tasks are split into contiguous ranges of equal cost (multiply-adds) among the threads.
// Every xa and every output element is one sum computed by one task in a fixed order: the result does
// not depend on the thread count.
//
// Numerics, as the torch code (`y.addmm_(x @ a.t(), b.t())`): fp32 sums, xa rounded to the model dtype
// (the dtype of `x @ a.t()`), the output once, after adding y. Compiled with -ffp-contract=fast. For
// bf16 the avx512_bf16 variant multiplies bf16 pairs with `vdpbf16ps` (fp32 sums of exact products, no
// conversions, twice the products of an fp32 FMA): x and A are bf16, and so are xa (rounded) and Bᵀ.
//
// Measured on Zen 4 (one core, SmolLM2's projections, 8 rank-16 adapters, a decode step's 120 calls):
// 8 rows of 8 adapters ~7 ms (the weights, 78 MB, from memory: the kernel is bound by it), 256 rows of
// one ~24 ms. Every micro-tile loop is unrolled (UNROLL: #pragma GCC unroll): left to GCC, the
// accumulator arrays stayed in memory, a store per multiply (the 256-row case took 44 ms).

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_LORA_BF16 1
#endif

namespace tandem_cpu {

namespace {

// Shrink micro-tiles are R rows x J rank columns with R * J = ACC accumulators, the row's x loaded once
// per step for all J columns: (4, ACC / 4), (2, ACC / 2), (1, ACC), as a decode step's tiles often have
// a row or two. Expand micro-tiles are ER rows x EV vectors of outputs.
#if defined(__AVX512F__)
constexpr int ACC = 16;  // of 32 zmm
constexpr int ER = 8;    // 16 of 32 zmm accumulate
#else
constexpr int ACC = 8;   // of 16 ymm (AVX2) or xmm (SSE2)
constexpr int ER = 4;
#endif
constexpr int EV = 2;
constexpr int TILE = 16;            // rows of one adapter per task
constexpr int64_t BLOCK = 256;      // output columns per expand task (a multiple of EV * W and of 32)
constexpr int64_t GRAIN = 1 << 15;  // multiply-adds below which one thread does the whole call

// Before each loop over a micro-tile's rows, columns or vectors (see the measurements above).
#define UNROLL _Pragma("GCC unroll 16")

inline vec broadcast(float x) {
  const vec v = {x};
  return __builtin_shuffle(v, ivec{});
}

// y += acc (one rounding), W outputs.
inline void add_store(float* p, vec acc) { storev(p, loadv(p) + acc); }
inline void add_store(bf16_t* p, vec acc) {
  const vec v = loadv(p) + acc;
  uvec u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;   // round to nearest even, as from_f32<bf16_t>
  u = v != v ? uvec{} + 0x7FC0u : u;
  const hvec h = __builtin_convertvector(u, hvec);
  std::memcpy(p, &h, sizeof h);
}
inline void add_store(f16_t* p, vec acc) {
  const vec v = loadv(p) + acc;
  for (int i = 0; i < W; ++i) p[i] = from_f32<f16_t>(v[i]);
}

#ifdef TANDEM_LORA_BF16
inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }
inline __mmask32 first_n(int64_t n) { return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1; }

// shrink_tile for bf16 with vdpbf16ps: x and A are both bf16, so pairs of their products go straight
// into fp32 sums (no conversions; twice the products of an fp32 FMA); the tail by masked loads.
template <int R, int J>
inline void shrink_tile_bf16(const bf16_t* const* x, const bf16_t* const* w, int64_t n_in, float* xa, int64_t xa_row,
                             int cols) {
  __m512 acc[R][J];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n_in; k += 32) {
    const __mmask32 m = first_n(n_in - k);
    __m512i xv[R];
    UNROLL for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_epi16(m, x[r] + k);
    UNROLL for (int j = 0; j < J; ++j) {
      const __m512i wv = _mm512_maskz_loadu_epi16(m, w[j] + k);
      UNROLL for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], as_bh(xv[r]), as_bh(wv));
    }
  }
  float sums[R][J];   // every accumulator reduced by a constant index, then the first `cols` stored
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < J; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  UNROLL for (int r = 0; r < R; ++r)
    for (int j = 0; j < cols; ++j) xa[r * xa_row + j] = to_f32(from_f32<bf16_t>(sums[r][j]));
}
#endif

// xa[r * xa_row + j] = round(x_r · w_j) for R rows x_r and J rows w_j of A (pointers), j < cols.
template <typename T, int R, int J>
inline void shrink_tile(const T* const* x, const T* const* w, int64_t n_in, float* xa, int64_t xa_row, int cols) {
#ifdef TANDEM_LORA_BF16
  if constexpr (std::is_same_v<T, bf16_t>) return shrink_tile_bf16<R, J>(x, w, n_in, xa, xa_row, cols);
#endif
  vec acc[R][J];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < J; ++j) acc[r][j] = vec{};
  int64_t k = 0;
  for (; k + W <= n_in; k += W) {
    vec wv[J];
    UNROLL for (int j = 0; j < J; ++j) wv[j] = loadv(w[j] + k);
    UNROLL for (int r = 0; r < R; ++r) {
      const vec xv = loadv(x[r] + k);
      UNROLL for (int j = 0; j < J; ++j) acc[r][j] += xv * wv[j];
    }
  }
  float sums[R][J];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int j = 0; j < J; ++j) sums[r][j] = hsum(acc[r][j]);
  UNROLL for (int r = 0; r < R; ++r)
    for (int j = 0; j < cols; ++j) {
      float s = sums[r][j];
      for (int64_t kk = k; kk < n_in; ++kk) s += to_f32(x[r][kk]) * to_f32(w[j][kk]);
      xa[r * xa_row + j] = to_f32(from_f32<T>(s));
    }
}

// Columns [0, cols) of A's rows `a` (n_in apart) against R rows of x, J columns at a time; past the last
// column a tile recomputes the last one (not stored) rather than read beyond the part.
template <typename T, int R, int J>
inline void shrink_cols(const T* const* x, const T* a, int64_t n_in, int cols, float* xa, int64_t xa_row) {
  for (int j0 = 0; j0 < cols; j0 += J) {
    const T* w[J];
    UNROLL for (int j = 0; j < J; ++j) w[j] = a + std::min(j0 + j, cols - 1) * n_in;
    shrink_tile<T, R, J>(x, w, n_in, xa + j0, xa_row, std::min(J, cols - j0));
  }
}

// R = rows (1, 2 or 4) x cols (<= ACC): the widest tile the row count allows, narrower for few columns.
template <typename T>
inline void shrink_rows(int rows, int cols, const T* const* x, const T* a, int64_t n_in, float* xa, int64_t xa_row) {
  if (rows == 4) return shrink_cols<T, 4, ACC / 4>(x, a, n_in, cols, xa, xa_row);
  if (rows == 2) {
    if (cols <= ACC / 4) return shrink_cols<T, 2, ACC / 4>(x, a, n_in, cols, xa, xa_row);
    return shrink_cols<T, 2, ACC / 2>(x, a, n_in, cols, xa, xa_row);
  }
  if (cols <= ACC / 4) return shrink_cols<T, 1, ACC / 4>(x, a, n_in, cols, xa, xa_row);
  if (cols <= ACC / 2) return shrink_cols<T, 1, ACC / 2>(x, a, n_in, cols, xa, xa_row);
  shrink_cols<T, 1, ACC>(x, a, n_in, cols, xa, xa_row);
}

// y_r[o : o + V * W] += Σ_j xa[r * rank + j] · bt[j * ld + o : ...] for R rows y_r (pointers).
template <typename T, int R, int V>
inline void expand_tile(T* const* y, const float* xa, int rank, const T* bt, int64_t ld, int64_t o) {
  vec acc[R][V];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < V; ++v) acc[r][v] = vec{};
  for (int j = 0; j < rank; ++j) {
    vec b[V];
    UNROLL for (int v = 0; v < V; ++v) b[v] = loadv(bt + j * ld + o + v * W);
    UNROLL for (int r = 0; r < R; ++r) {
      const vec s = broadcast(xa[r * rank + j]);
      UNROLL for (int v = 0; v < V; ++v) acc[r][v] += s * b[v];
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < V; ++v) add_store(y[r] + o + v * W, acc[r][v]);
}

#ifdef TANDEM_LORA_BF16
// expand_tile for bf16 with vdpbf16ps, n <= 32 outputs from o: rows j and j + 1 of Bᵀ interleaved
// (vpunpck[lh]wd, within 128-bit lanes) against the pair (xa_j, xa_j+1), both exact bf16 (xa is rounded
// to the dtype); lo then holds outputs 0-3, 8-11, 16-19, 24-27 and hi the others, put back in order
// before the one rounding into y.
template <int R>
inline void expand_tile_bf16(bf16_t* const* y, const float* xa, int rank, const bf16_t* bt, int64_t ld, int64_t o,
                             int n) {
  const __mmask32 m = first_n(n);
  __m512 lo[R], hi[R];
  UNROLL for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int j = 0; j < rank; j += 2) {
    const bool pair = j + 1 < rank;
    const __m512i b0 = _mm512_maskz_loadu_epi16(m, bt + j * ld + o);
    const __m512i b1 = pair ? _mm512_maskz_loadu_epi16(m, bt + (j + 1) * ld + o) : _mm512_setzero_si512();
    const __m512i pl = _mm512_unpacklo_epi16(b0, b1), ph = _mm512_unpackhi_epi16(b0, b1);
    UNROLL for (int r = 0; r < R; ++r) {
      uint32_t x0, x1 = 0;
      std::memcpy(&x0, xa + r * rank + j, 4);
      if (pair) std::memcpy(&x1, xa + r * rank + j + 1, 4);
      const __m512i s = _mm512_set1_epi32(static_cast<int>((x0 >> 16) | (x1 & 0xFFFF0000u)));
      lo[r] = _mm512_dpbf16_ps(lo[r], as_bh(s), as_bh(pl));
      hi[r] = _mm512_dpbf16_ps(hi[r], as_bh(s), as_bh(ph));
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  UNROLL for (int r = 0; r < R; ++r) {
    vec out[2];
    const __m512 a0 = _mm512_permutex2var_ps(lo[r], first, hi[r]), a1 = _mm512_permutex2var_ps(lo[r], second, hi[r]);
    std::memcpy(&out[0], &a0, sizeof a0);
    std::memcpy(&out[1], &a1, sizeof a1);
    if (n == 32) {
      add_store(y[r] + o, out[0]);
      add_store(y[r] + o + 16, out[1]);
    } else {
      for (int i = 0; i < n; ++i) y[r][o + i] = from_f32<bf16_t>(to_f32(y[r][o + i]) + out[i / 16][i % 16]);
    }
  }
}

template <int R = ER>
inline void expand_rows_bf16(int rows, bf16_t* const* y, const float* xa, int rank, const bf16_t* bt, int64_t ld,
                             int64_t o, int n) {
  if constexpr (R > 1) {
    if (rows < R) return expand_rows_bf16<R - 1>(rows, y, xa, rank, bt, ld, o, n);
  }
  expand_tile_bf16<R>(y, xa, rank, bt, ld, o, n);
}
#endif

template <typename T, int V, int R = ER>
inline void expand_rows(int rows, T* const* y, const float* xa, int rank, const T* bt, int64_t ld, int64_t o) {
  if constexpr (R > 1) {
    if (rows < R) return expand_rows<T, V, R - 1>(rows, y, xa, rank, bt, ld, o);
  }
  expand_tile<T, R, V>(y, xa, rank, bt, ld, o);
}

struct Part { int32_t col, rank, out, len; };

// One part of one adapter over one tile of its rows: order[first, first + count) are the rows, and
// xa[xa, xa + count * rank) their shrink result (row-major).
struct Unit { int32_t part, first, count; int64_t xa; };

// A range of work: columns [begin, end) of a unit (rank columns in the shrink, outputs in the expand).
// `cost`: the multiply-adds of every task before it.
struct Task { int32_t unit; int32_t begin, end; int64_t cost; };

template <typename T>
struct Lora {
  const LoraArgs& a;
  const Part* parts;
  std::vector<int32_t> order;   // the adapter rows, grouped by adapter
  std::vector<Unit> units;
  std::vector<Task> shrink, expand;
  std::vector<float> xa;

  explicit Lora(const LoraArgs& args) : a(args), parts(reinterpret_cast<const Part*>(args.parts)) {
    std::vector<int32_t> start(a.adapters + 1, 0);   // counting sort of the rows by adapter
    for (int64_t t = 0; t < a.tokens; ++t)
      if (a.slots[t] >= 0) ++start[a.slots[t] + 1];
    for (int64_t s = 0; s < a.adapters; ++s) start[s + 1] += start[s];
    order.resize(start[a.adapters]);
    std::vector<int32_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < a.tokens; ++t)
      if (a.slots[t] >= 0) order[next[a.slots[t]]++] = static_cast<int32_t>(t);
    int64_t size = 0, shrink_cost = 0, expand_cost = 0;
    for (int64_t s = 0; s < a.adapters; ++s) {
      for (int32_t p = a.first_part[s]; p < a.first_part[s + 1]; ++p) {
        const Part& part = parts[p];
        if (part.rank == 0 || part.len == 0) continue;
        for (int32_t first = start[s]; first < start[s + 1]; first += TILE) {
          const int32_t count = std::min<int32_t>(TILE, start[s + 1] - first);
          const int32_t u = static_cast<int32_t>(units.size());
          units.push_back({p, first, count, size});
          size += int64_t{count} * part.rank;
          for (int32_t j = 0; j < part.rank; j += ACC) {
            const int32_t end = std::min(part.rank, j + ACC);
            shrink.push_back({u, j, end, shrink_cost});
            shrink_cost += int64_t{count} * (end - j) * a.n_in;
          }
          for (int32_t o = 0; o < part.len; o += BLOCK) {
            const int32_t end = static_cast<int32_t>(std::min<int64_t>(part.len, o + BLOCK));
            expand.push_back({u, o, end, expand_cost});
            expand_cost += int64_t{count} * part.rank * (end - o);
          }
        }
      }
    }
    shrink.push_back({-1, 0, 0, shrink_cost});   // sentinels: each list's total cost
    expand.push_back({-1, 0, 0, expand_cost});
    xa.resize(size);
  }

  void run_shrink(const Task& task) {
    const Unit& u = units[task.unit];
    const Part& part = parts[u.part];
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.a) + (part.col + int64_t{task.begin}) * a.n_in;
    float* out = xa.data() + u.xa + task.begin;
    const T* rows[4];
    for (int32_t r0 = 0, n; r0 < u.count; r0 += n) {
      n = u.count - r0 >= 4 ? 4 : u.count - r0 >= 2 ? 2 : 1;
      for (int r = 0; r < n; ++r) rows[r] = x + order[u.first + r0 + r] * a.x_row;
      shrink_rows<T>(n, task.end - task.begin, rows, w, a.n_in, out + int64_t{r0} * part.rank, part.rank);
    }
  }

  void run_expand(const Task& task) {
    const Unit& u = units[task.unit];
    const Part& part = parts[u.part];
    T* y = static_cast<T*>(a.y);
    const T* bt = static_cast<const T*>(a.b_t) + int64_t{part.col} * a.n_out + part.out;
    T* rows[ER];
    for (int32_t r0 = 0; r0 < u.count; r0 += ER) {
      const int n = std::min<int32_t>(ER, u.count - r0);
      for (int r = 0; r < n; ++r) rows[r] = y + order[u.first + r0 + r] * a.y_row + part.out;
      const float* xr = xa.data() + u.xa + int64_t{r0} * part.rank;
#ifdef TANDEM_LORA_BF16
      if constexpr (std::is_same_v<T, bf16_t>) {
        for (int64_t o = task.begin; o < task.end; o += 32)
          expand_rows_bf16(n, rows, xr, part.rank, bt, a.n_out, o, static_cast<int>(std::min<int64_t>(32, task.end - o)));
        continue;
      }
#endif
      int64_t o = task.begin;
      for (; o + EV * W <= task.end; o += EV * W) expand_rows<T, EV>(n, rows, xr, part.rank, bt, a.n_out, o);
      for (; o + W <= task.end; o += W) expand_rows<T, 1>(n, rows, xr, part.rank, bt, a.n_out, o);
      for (; o < task.end; ++o)   // the last few outputs of a part whose width is not a multiple of W
        for (int r = 0; r < n; ++r) {
          float s = 0.f;
          for (int j = 0; j < part.rank; ++j) s += xr[r * part.rank + j] * to_f32(bt[j * a.n_out + o]);
          rows[r][o] = from_f32<T>(to_f32(rows[r][o]) + s);
        }
    }
  }

  // Thread `t` of `n` runs the tasks of `tasks` that start in its nth of their total cost.
  template <typename Fn>
  static void share(const std::vector<Task>& tasks, int t, int n, Fn&& fn) {
    const int64_t total = tasks.back().cost;
    const auto first = [&](int i) {
      return std::lower_bound(tasks.begin(), tasks.end() - 1, (total * i + n - 1) / n,
                              [](const Task& task, int64_t c) { return task.cost < c; });
    };
    for (auto it = first(t), end = first(t + 1); it != end; ++it) fn(*it);
  }

  void run() {
    const int64_t total = shrink.back().cost + expand.back().cost;
    const int64_t team = std::min<int64_t>(a.threads, std::max<int64_t>(1, total / GRAIN));
    if (team <= 1 || omp_in_parallel()) {
      for (size_t i = 0; i + 1 < shrink.size(); ++i) run_shrink(shrink[i]);
      for (size_t i = 0; i + 1 < expand.size(); ++i) run_expand(expand[i]);
      return;
    }
#pragma omp parallel num_threads(static_cast<int>(team))
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      share(shrink, t, n, [&](const Task& task) { run_shrink(task); });
#pragma omp barrier
      share(expand, t, n, [&](const Task& task) { run_expand(task); });
    }
  }
};

}  // namespace

void lora(const LoraArgs& a) {
  if (a.tokens == 0) return;
  dispatch(a.dtype, [&](auto tag) { Lora<decltype(tag)>(a).run(); });
}

}  // namespace tandem_cpu
