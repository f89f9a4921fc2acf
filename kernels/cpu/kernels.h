// The contract between binding.cpp (torch: argument checks, pybind11) and the kernels (plain C++,
// compiled once per ISA level, see kernels/cpu/__init__.py). Torch-free, so the kernel sources compile
// in seconds; binding.cpp checks every shape, stride, dtype and index before it fills one of these.
//
// Pointers are raw model-dtype data (`DType`); strides are in elements. KV caches are the pool's
// contiguous [pages, page_size, kv_heads, dim] tensors, so a key's `kv_heads * dim` values are one
// contiguous slot. `threads`: the caller's torch thread count (the kernels run an OpenMP team of at
// most that size on the OpenMP runtime torch has loaded).
#pragma once

#include <cstdint>

namespace tandem_cpu {

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

struct Paged {              // one layer's KV pages; a page's slots are contiguous, pages page_stride apart
  const void *k, *v;
  int64_t page_size, kv_heads, dim, page_stride;  // page_stride in elements, the same for K and V
};

struct DecodeArgs {         // rows queries, row r over the first kv_lens[r] keys of tables[r]'s pages
  DType dtype;
  Paged cache;
  int64_t rows, heads, q_row, q_head, out_row, out_head, table_stride;
  const void* q;
  const int32_t* tables;
  const int64_t* kv_lens;
  void* out;
  float scale;
  int threads;
};

struct ExtendArgs {         // n new tokens of one sequence, causal over the first kv_len keys of table
  DType dtype;
  Paged cache;
  int64_t n, heads, q_row, q_head, out_row, out_head, kv_len;
  const void* q;
  const int32_t* table;
  void* out;
  float scale;
  int threads;
};

struct NormArgs {           // out = norm(x (+ residual, in place)) * weight
  DType dtype;
  int64_t tokens, hidden, x_row, residual_row;
  const void *x, *weight;
  float* residual;          // fp32, or null
  void* out;                // contiguous [tokens, hidden]
  float eps;
  int threads;
};

struct RopeArgs {           // x[t, h, :] rotated in place (rotate-half) by cos/sin[t, :dim / 2]
  DType dtype;
  int64_t tokens, heads, dim, row, head, cs_row;
  void* x;
  const float *cos, *sin;
  int threads;
};

struct LinearArgs {         // y[m, :] = x[m, :] · Wᵀ (+ bias) in fp32; W packed as [ceil(n / panel)][k][panel]
  DType w_dtype;            // f32, or bf16 (converted in registers)
  int64_t m, n, k, x_row, y_row;
  const float* x;           // [m, k], unit stride in k
  const void* w;            // linear_panel() columns per panel, the last one zero-padded
  const float* bias;        // [n], or null
  float* y;                 // [m, n], unit stride in n
  int threads;
};

struct LoraArgs {           // y[t, part's outputs] += round(x[t] · A[part]ᵀ) · Bᵀ[part], each part of row t's adapter
  DType dtype;              // of x, y and the weights
  int64_t tokens, n_in, n_out, x_row, y_row, adapters;
  const void *x;            // [tokens, n_in], unit stride in n_in
  const void *a, *b_t;      // the stacked weights: a [S, n_in], b_t [S, n_out] (B transposed), contiguous
  void* y;                  // [tokens, n_out], unit stride in n_out, updated in place
  const int32_t* slots;     // [tokens]: each row's adapter in [0, adapters), or -1 (untouched)
  const int32_t* parts;     // [P][4]: first stacked column, rank, first output, outputs (disjoint per adapter)
  const int32_t* first_part;  // [adapters + 1]: adapter s's parts are [first_part[s], first_part[s + 1])
  int threads;
};

const char* level();                               // the ISA level this variant was compiled for
bool extend_supported(DType dtype, int64_t dim);   // whether extend_attention takes these
void decode_attention(const DecodeArgs& a);
void extend_attention(const ExtendArgs& a);
void rms_norm(const NormArgs& a);
void rope(const RopeArgs& a);
int64_t linear_panel();                            // output columns per weight panel in this variant
void linear(const LinearArgs& a);
void lora(const LoraArgs& a);

}  // namespace tandem_cpu
