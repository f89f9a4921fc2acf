// fp32 linear layers on panel-packed weights for the CPU path (see kernels/cpu/__init__.py):
// y[m, :] = x[m, :] · Wᵀ (+ bias), fp32 in and out, fp32 sums.
//
// The weight is packed once at load time (binding.cpp, pack_linear) as [N / NR][K][NR]: panels of
// NR output columns, each panel's K rows of NR weights contiguous, the last panel zero-padded. A tile
// is R (<= MR) rows of x by one panel: R x NV vectors of accumulators in registers, each k step loads
// NV weight vectors once and broadcasts R values of x into them (12 of 16 ymm with AVX2, 28 of 32 zmm
// with AVX-512). A panel is read front to back, once per block of MR rows while it sits in cache, so
// a decode step (M <= MR) streams each weight exactly once, in order, prefetched ahead; the M rows
// are split into blocks as evenly as the MR bound allows (8 rows with AVX2: 4 + 4, not 6 + 2).
// Threads take contiguous ranges of panels (and, when M is large and the panels few, of row blocks
// too). Why not MKL or oneDNN: at decode's row counts their fp32 GEMMs ran at a third to a half of
// this (bench/cpu_kernels.py --parts linear), and at prefill sizes this is as fast, so one packed
// copy of the weights serves both.
//
// Every output element is one fp32 sum over k in order, whatever the blocking or the thread count,
// then + bias: not MKL's order (it is not bit-identical to F.linear) but deterministic.
//
// The weights may also be stored as bf16 (converted in registers; half the bytes a decode step
// streams), which rounds the weights: an option measured by bench/cpu_kernels.py, not the default.
// Compiled with -ffp-contract=fast (the products and sums fuse into FMAs).

#include "common.h"

namespace tandem_cpu {

namespace {

// Tiles measured on Zen 5 (one core, the model's projection shapes at 1-256 rows, best of 4-6 runs):
// with AVX-512, 14 x 2 zmm beat 12 x 2, 8 x 3 and 6 x 4 (8 x 3: 140 vs 160 GFLOP/s at 8 rows, 207 vs
// 231 at 64); with AVX2, 6 x 2 ymm beat 4 x 3 and 5 x 2 once the weights were prefetched.
#if defined(__AVX512F__)
constexpr int NV = 2, MR = 14;   // 32 zmm: 28 accumulators, 2 weight vectors, a broadcast
#else
constexpr int NV = 2, MR = 6;    // 16 ymm (AVX2) or xmm (SSE2): 12 accumulators, 2 weights, a broadcast
#endif
constexpr int NR = NV * W;       // output columns per panel
// The weights stream from memory once per step: prefetched into L2 this far ahead of the loads (the
// hardware prefetchers alone left 8 rows at ~55 GFLOP/s with AVX2, ~85 with this; 2-8 KiB measured).
constexpr int64_t PREFETCH_BYTES = 8192;
// At prefill sizes every panel passes over all of x: x is taken in chunks of rows this large (rounded
// to MR rows), each chunk staying in L2 while the thread's panels pass over it. Unchunked, 8,192 rows
// ran ~90 GFLOP/s with AVX2 and ~160 with AVX-512 against ~111 and ~220 chunked (a chunk of 128 KiB
// - 1 MiB measured; AVX-512 CPUs have 1 MiB+ L2, some AVX2 ones 256 KiB).
#if defined(__AVX512F__)
constexpr int64_t X_CHUNK_BYTES = 512 << 10;
#else
constexpr int64_t X_CHUNK_BYTES = 256 << 10;
#endif

// x into every lane, as one vbroadcastss (common.h's splat adds x to 0, an extra add on the path).
inline vec broadcast(const float* x) {
  const vec v = {*x};
  return __builtin_shuffle(v, ivec{});
}

// Rows [0, R) of x (row stride x_row) times one panel (`w`: [k][NR]) into y (row stride y_row), the
// first `cols` columns.
template <typename TW, int R>
inline void tile(const float* x, int64_t x_row, const TW* w, int64_t k, const float* bias, float* y,
                 int64_t y_row, int64_t cols) {
  vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vec{};
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int c = 0; c < NR; c += 64 / static_cast<int>(sizeof(TW)))   // each cache line of this row, ahead
      __builtin_prefetch(w + kk * NR + PREFETCH_BYTES / sizeof(TW) + c, 0, 2);
    vec b[NV];
    for (int j = 0; j < NV; ++j) b[j] = loadv(w + kk * NR + j * W);
    for (int r = 0; r < R; ++r) {
      const vec xr = broadcast(x + r * x_row + kk);
      for (int j = 0; j < NV; ++j) acc[r][j] += xr * b[j];
    }
  }
  if (cols == NR) {
    for (int j = 0; j < NV; ++j) {
      const vec bj = bias ? loadv(bias + j * W) : vec{};
      for (int r = 0; r < R; ++r) storev(y + r * y_row + j * W, acc[r][j] + bj);
    }
    return;
  }
  float out[NR];                 // the last, partial panel
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NV; ++j) storev(out + j * W, acc[r][j]);
    for (int64_t c = 0; c < cols; ++c) y[r * y_row + c] = out[c] + (bias ? bias[c] : 0.f);
  }
}

template <typename TW, int R = MR>
inline void tile_rows(int rows, const float* x, int64_t x_row, const TW* w, int64_t k, const float* bias,
                      float* y, int64_t y_row, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<TW, R - 1>(rows, x, x_row, w, k, bias, y, y_row, cols);
  }
  tile<TW, R>(x, x_row, w, k, bias, y, y_row, cols);
}

template <typename TW>
void linear_impl(const LinearArgs& a) {
  const TW* w = static_cast<const TW*>(a.w);
  const int64_t panels = (a.n + NR - 1) / NR, blocks = (a.m + MR - 1) / MR;
  // Row blocks are split among threads only when the panels alone leave threads idle.
  const int64_t groups = std::min<int64_t>(blocks, std::max<int64_t>(1, (2 * a.threads + panels - 1) / panels));
  const int64_t per_group = (blocks + groups - 1) / groups;
  const int64_t chunk = std::max<int64_t>(1, X_CHUNK_BYTES / (a.k * static_cast<int64_t>(sizeof(float))) / MR) * MR;
  parallel_for(groups * panels, 1, a.threads, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin, t1; t0 < end; t0 = t1) {
      // Tasks [t0, t1): panels [p0, p1) of one group of row blocks, rows [r0, r1).
      const int64_t g = t0 / panels;
      t1 = std::min(end, (g + 1) * panels);
      const int64_t p0 = t0 % panels, p1 = p0 + (t1 - t0);
      const int64_t r0 = std::min(a.m, g * per_group * MR), r1 = std::min(a.m, (g + 1) * per_group * MR);
      for (int64_t c0 = r0; c0 < r1; c0 += chunk) {     // rows of x that stay in cache for every panel
        const int64_t c1 = std::min(r1, c0 + chunk);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * NR, cols = std::min<int64_t>(NR, a.n - n0);
          const TW* wp = w + p * a.k * NR;
          const float* bias = a.bias ? a.bias + n0 : nullptr;
          // Blocks of at most MR rows, as even as they come.
          for (int64_t m0 = c0, left = (c1 - c0 + MR - 1) / MR; m0 < c1; --left) {
            const int rows = static_cast<int>((c1 - m0 + left - 1) / left);
            tile_rows<TW>(rows, a.x + m0 * a.x_row, a.x_row, wp, a.k, bias, a.y + m0 * a.y_row + n0, a.y_row, cols);
            m0 += rows;
          }
        }
      }
    }
  });
}

}  // namespace

int64_t linear_panel() { return NR; }

void linear(const LinearArgs& a) {
  if (a.w_dtype == DType::bf16) return linear_impl<bf16_t>(a);
  linear_impl<float>(a);
}

}  // namespace tandem_cpu
