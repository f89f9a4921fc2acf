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
// Two phases in one OpenMP team: the shrink (tasks: a tile's part by SJ rank columns) fills an fp32 xa
// per (part, tile); after a barrier the expand (tasks: a tile's part by BLOCK output columns) adds it into
// y. Each phase's tasks are split into contiguous ranges of equal cost (multiply-adds) among the threads.
// Every xa and every output element is one sum computed by one task in a fixed order: the result does not
// depend on the thread count.
//
// Numerics, as the torch code (`y.addmm_(x @ a.t(), b.t())`): xa is rounded to the model dtype (the
// dtype of `x @ a.t()`), the output once, after adding y. Compiled with -ffp-contract=fast.

#include "common.h"

namespace tandem_cpu {

namespace {

#if defined(__AVX512F__)
constexpr int SR = 4;    // shrink micro-tile: rows x SJ rank columns (16 of 32 zmm accumulate)
constexpr int ER = 8;    // expand micro-tile: rows x EV vectors of outputs (16 of 32 zmm)
#else
constexpr int SR = 2;    // 8 of 16 ymm (AVX2) or xmm (SSE2)
constexpr int ER = 4;
#endif
constexpr int SJ = 4;
constexpr int EV = 2;
constexpr int TILE = 16;            // rows of one adapter per task
constexpr int64_t BLOCK = 256;      // output columns per expand task (a multiple of EV * W)
constexpr int64_t GRAIN = 1 << 15;  // multiply-adds below which one thread does the whole call

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

// xa[r * xa_row + j] = round(x_r · a_j) for R rows x_r (pointers) and J rows a_j of A (n_in apart).
template <typename T, int R, int J>
inline void shrink_tile(const T* const* x, const T* a, int64_t n_in, float* xa, int64_t xa_row) {
  vec acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = vec{};
  int64_t k = 0;
  for (; k + W <= n_in; k += W) {
    vec av[J];
    for (int j = 0; j < J; ++j) av[j] = loadv(a + j * n_in + k);
    for (int r = 0; r < R; ++r) {
      const vec xv = loadv(x[r] + k);
      for (int j = 0; j < J; ++j) acc[r][j] += xv * av[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t kk = k; kk < n_in; ++kk) s += to_f32(x[r][kk]) * to_f32(a[j * n_in + kk]);
      xa[r * xa_row + j] = to_f32(from_f32<T>(s));
    }
}

template <typename T, int R, int J = SJ>
inline void shrink_rows(int rows, int cols, const T* const* x, const T* a, int64_t n_in, float* xa, int64_t xa_row) {
  if constexpr (R > 1) {
    if (rows < R) return shrink_rows<T, R - 1, J>(rows, cols, x, a, n_in, xa, xa_row);
  }
  if constexpr (J > 1) {
    if (cols < J) return shrink_rows<T, R, J - 1>(rows, cols, x, a, n_in, xa, xa_row);
  }
  shrink_tile<T, R, J>(x, a, n_in, xa, xa_row);
}

// y_r[o : o + V * W] += Σ_j xa[r * rank + j] · bt[j * ld + o : ...] for R rows y_r (pointers).
template <typename T, int R, int V>
inline void expand_tile(T* const* y, const float* xa, int rank, const T* bt, int64_t ld, int64_t o) {
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vec{};
  for (int j = 0; j < rank; ++j) {
    vec b[V];
    for (int v = 0; v < V; ++v) b[v] = loadv(bt + j * ld + o + v * W);
    for (int r = 0; r < R; ++r) {
      const vec s = broadcast(xa[r * rank + j]);
      for (int v = 0; v < V; ++v) acc[r][v] += s * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) add_store(y[r] + o + v * W, acc[r][v]);
}

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
          for (int32_t j = 0; j < part.rank; j += SJ) {
            const int32_t end = std::min(part.rank, j + SJ);
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
    const T* rows[SR];
    for (int32_t r0 = 0; r0 < u.count; r0 += SR) {
      const int n = std::min<int32_t>(SR, u.count - r0);
      for (int r = 0; r < n; ++r) rows[r] = x + order[u.first + r0 + r] * a.x_row;
      for (int32_t j = 0; j < task.end - task.begin; j += SJ)
        shrink_rows<T, SR>(n, std::min<int32_t>(SJ, task.end - task.begin - j), rows, w + j * a.n_in, a.n_in,
                           out + int64_t{r0} * part.rank + j, part.rank);
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
