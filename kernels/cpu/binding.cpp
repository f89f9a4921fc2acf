// The Python module of the CPU kernels: checks every argument with TORCH_CHECK (shapes, strides,
// dtypes, page indices), fills the torch-free argument structs of kernels.h and calls the kernels of
// the ISA variant this module was linked with (kernels/cpu/__init__.py links this one object file,
// compiled once, with each variant's kernel objects). The only translation unit that includes torch.

#include <torch/extension.h>

#include "kernels.h"

namespace {

using tandem_cpu::DType;
using tandem_cpu::Paged;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

bool has_kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK(false, "unsupported dtype ", t);
  }
}

int threads() { return at::get_num_threads(); }

Paged check_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  // Each page contiguous, pages any (equal) stride apart: a layer's view of a page-first pool.
  const auto page_contiguous = [](const at::Tensor& c) {
    return c.dim() == 4 && c.stride(3) == 1 && c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3) &&
           c.stride(0) >= c.size(1) * c.stride(1);
  };
  TORCH_CHECK(page_contiguous(k_cache) && v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "k_cache and v_cache must be [pages, page_size, kv_heads, dim], each page contiguous, with equal strides");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "q's heads must be a multiple of the cache's kv heads, with the same head dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  return Paged{k_cache.data_ptr(), v_cache.data_ptr(), k_cache.size(1), k_cache.size(2), k_cache.size(3),
               k_cache.stride(0)};
}

// The first `len` keys' pages of `table` must lie in the cache.
void check_pages(const int32_t* table, int64_t len, const at::Tensor& k_cache) {
  for (int64_t p = 0; p < (len + k_cache.size(1) - 1) / k_cache.size(1); ++p)
    TORCH_CHECK(table[p] >= 0 && table[p] < k_cache.size(0), "page ", table[p], " outside the cache");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& kv_lens, double scale) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &tables, &kv_lens}) check_cpu(*t, "every argument");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, dim] with unit stride in dim");
  const Paged cache = check_cache(q, k_cache, v_cache);
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.stride(1) == 1 &&
                  tables.size(0) == q.size(0),
              "tables must be int32 [rows, max_pages]");
  TORCH_CHECK(kv_lens.scalar_type() == at::kLong && kv_lens.dim() == 1 && kv_lens.size(0) == q.size(0) &&
                  kv_lens.is_contiguous(),
              "kv_lens must be int64 [rows]");
  const int64_t max_len = tables.size(1) * k_cache.size(1);
  const int64_t* lp = kv_lens.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t r = 0; r < kv_lens.size(0); ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= max_len, "kv_lens[", r, "] = ", lp[r], " outside [1, ", max_len, "]");
    check_pages(tp + r * tables.stride(0), lp[r], k_cache);
  }
  auto out = at::empty(q.sizes(), q.options());
  tandem_cpu::decode_attention(tandem_cpu::DecodeArgs{kernel_dtype(q.scalar_type()), cache, q.size(0), q.size(1), q.stride(0), q.stride(1),
                              out.stride(0), out.stride(1), tables.stride(0), q.data_ptr(), tp, lp, out.data_ptr(),
                              static_cast<float>(scale), threads()});
  return out;
}

bool extend_attention_supported(at::ScalarType dtype, int64_t dim) {
  return has_kernel_dtype(dtype) && tandem_cpu::extend_supported(kernel_dtype(dtype), dim);
}

at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& table, int64_t kv_len, double scale) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &table}) check_cpu(*t, "every argument");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.size(0) >= 1,
              "q must be [tokens, heads, dim] with unit stride in dim");
  TORCH_CHECK(extend_attention_supported(q.scalar_type(), q.size(2)), "paged_extend_attention (", tandem_cpu::level(),
              " kernels) does not take ", q.scalar_type(), " with a head dim of ", q.size(2),
              " (see extend_attention_supported)");
  const Paged cache = check_cache(q, k_cache, v_cache);
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 1 && table.is_contiguous(),
              "table must be int32 [pages]");
  const int64_t page_size = k_cache.size(1);
  TORCH_CHECK(kv_len >= q.size(0) && kv_len <= table.size(0) * page_size, "kv_len ", kv_len, " outside [",
              q.size(0), ", ", table.size(0) * page_size, "]");
  check_pages(table.data_ptr<int32_t>(), kv_len, k_cache);
  auto out = at::empty(q.sizes(), q.options());
  tandem_cpu::extend_attention(tandem_cpu::ExtendArgs{kernel_dtype(q.scalar_type()), cache, q.size(0), q.size(1), q.stride(0), q.stride(1),
                              out.stride(0), out.stride(1), kv_len, q.data_ptr(), table.data_ptr<int32_t>(),
                              out.data_ptr(), static_cast<float>(scale), threads()});
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
    check_cpu(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->sizes() == x.sizes() &&
                    residual->stride(1) == 1,
                "residual must be fp32 with x's shape");
  }
  auto out = at::empty(x.sizes(), x.options());
  float* res = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  tandem_cpu::rms_norm(tandem_cpu::NormArgs{kernel_dtype(x.scalar_type()), x.size(0), x.size(1), x.stride(0),
                    res ? residual->stride(0) : 0, x.data_ptr(), weight.data_ptr(), res, out.data_ptr(),
                    static_cast<float>(eps), threads()});
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
  const DType dtype = kernel_dtype(q.scalar_type());
  for (at::Tensor* x : {&q, &k})
    tandem_cpu::rope(tandem_cpu::RopeArgs{dtype, x->size(0), x->size(1), x->size(2), x->stride(0), x->stride(1), cos.stride(0),
                  x->data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), threads()});
}

// [n, k] -> [ceil(n / panel)][k][panel] in `dtype` (fp32 or bf16), the last panel zero-padded (linear.cpp).
at::Tensor pack_linear(const at::Tensor& weight, c10::optional<at::ScalarType> dtype) {
  check_cpu(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) >= 1 && weight.size(1) >= 1, "weight must be [out, in]");
  TORCH_CHECK(weight.is_floating_point(), "weight must be a floating-point tensor");
  const at::ScalarType to = dtype.value_or(at::kFloat);
  TORCH_CHECK(to == at::kFloat || to == at::kBFloat16, "packed weights are float32 or bfloat16, not ", to);
  const int64_t n = weight.size(0), k = weight.size(1), panel = tandem_cpu::linear_panel();
  const int64_t panels = (n + panel - 1) / panel;
  auto padded = at::zeros({panels * panel, k}, weight.options().dtype(to));
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, panel, k}).transpose(1, 2).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n) {
  check_cpu(x, "x");
  check_cpu(packed, "packed");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "x must be float32 [rows, in] with unit stride in in (got ", x.scalar_type(), " ", x.sizes(), ")");
  const int64_t panel = tandem_cpu::linear_panel();
  TORCH_CHECK((packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) && packed.dim() == 3 &&
                  packed.size(2) == panel && packed.is_contiguous(),
              "packed must be pack_linear's float32 or bfloat16 [panels, in, ", panel, "] (", tandem_cpu::level(),
              " kernels)");
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " input features, the weight ", packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * panel && n <= packed.size(0) * panel, "n = ", n, " does not fit ",
              packed.size(0), " panels of ", panel);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bias must be contiguous float32 [", n, "]");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  tandem_cpu::linear(tandem_cpu::LinearArgs{kernel_dtype(packed.scalar_type()), x.size(0), n, x.size(1), x.stride(0),
                                            y.stride(0), x.data_ptr<float>(), packed.data_ptr(), bp,
                                            y.data_ptr<float>(), threads()});
  return y;
}

// y[t] += each part of row t's adapter (lora.cpp), in place. The stacked weights: a [S, in], b_t [S, out]
// (B transposed); parts [P, 4] int32 (first column, rank, first output, outputs), adapter s's parts
// [first_part[s], first_part[s + 1]); slots [tokens] int32 (-1: the base model's row, untouched).
void lora_(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& b_t, const at::Tensor& slots,
           const at::Tensor& parts, const at::Tensor& first_part) {
  for (const at::Tensor* t : {&x, static_cast<const at::Tensor*>(&y), &a, &b_t, &slots, &parts, &first_part})
    check_cpu(*t, "every argument");
  TORCH_CHECK(has_kernel_dtype(x.scalar_type()), "lora_ takes float32, bfloat16 or float16, not ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1) &&
                  (y.stride(1) == 1 || y.size(1) <= 1) && y.size(0) == x.size(0),
              "x and y must be [tokens, in] and [tokens, out] with unit stride in their columns");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1), "a must be contiguous [stacked, ",
              x.size(1), "]");
  TORCH_CHECK(b_t.dim() == 2 && b_t.is_contiguous() && b_t.size(0) == a.size(0) && b_t.size(1) == y.size(1),
              "b_t must be contiguous [", a.size(0), ", ", y.size(1), "] (the stacked B, transposed)");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&y), &a, &b_t})
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "x, y, a and b_t must share a dtype");
  const auto int32s = [](const at::Tensor& t, int64_t dim) {
    return t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous();
  };
  TORCH_CHECK(int32s(slots, 1) && slots.size(0) == x.size(0), "slots must be contiguous int32 [tokens]");
  TORCH_CHECK(int32s(parts, 2) && parts.size(1) == 4, "parts must be contiguous int32 [parts, 4]");
  TORCH_CHECK(int32s(first_part, 1) && first_part.size(0) >= 1, "first_part must be contiguous int32 [adapters + 1]");
  const int64_t adapters = first_part.size(0) - 1, stacked = a.size(0), n_out = y.size(1);
  const int32_t* fp = first_part.data_ptr<int32_t>();
  const int32_t* pp = parts.data_ptr<int32_t>();
  TORCH_CHECK(fp[0] == 0 && fp[adapters] == parts.size(0), "first_part must run from 0 to the number of parts");
  for (int64_t s = 0; s < adapters; ++s) {
    TORCH_CHECK(fp[s] <= fp[s + 1], "first_part must not decrease");
    for (int32_t p = fp[s]; p < fp[s + 1]; ++p) {
      const int32_t* q = pp + 4 * p;
      TORCH_CHECK(q[0] >= 0 && q[1] >= 0 && q[0] + int64_t{q[1]} <= stacked, "part ", p, ": columns [", q[0], ", ",
                  q[0] + int64_t{q[1]}, ") outside the ", stacked, " stacked");
      TORCH_CHECK(q[2] >= 0 && q[3] >= 0 && q[2] + int64_t{q[3]} <= n_out, "part ", p, ": outputs [", q[2], ", ",
                  q[2] + int64_t{q[3]}, ") outside the ", n_out);
      for (int32_t o = fp[s]; o < p; ++o)   // one adapter's parts write disjoint outputs: no two tasks share one
        TORCH_CHECK(q[1] == 0 || q[3] == 0 || pp[4 * o + 1] == 0 || pp[4 * o + 3] == 0 ||
                        q[2] >= pp[4 * o + 2] + pp[4 * o + 3] || pp[4 * o + 2] >= q[2] + q[3],
                    "parts ", o, " and ", p, " of adapter ", s, " write the same outputs");
    }
  }
  const int32_t* sp = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] >= -1 && sp[t] < adapters, "slots[", t, "] = ", sp[t], " outside [-1, ", adapters, ")");
  tandem_cpu::lora(tandem_cpu::LoraArgs{kernel_dtype(x.scalar_type()), x.size(0), x.size(1), n_out, x.stride(0),
                                        y.stride(0), adapters, x.data_ptr(), a.data_ptr(), b_t.data_ptr(),
                                        y.data_ptr(), sp, pp, fp, threads()});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("LEVEL") = tandem_cpu::level();
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query row per sequence over its KV pages (GQA), fp32 softmax; returns [rows, heads, dim]");
  m.def("paged_extend_attention", &paged_extend_attention,
        "causal attention of one sequence's n new tokens over its KV pages (GQA), fp32 compute; [n, heads, dim]");
  m.def("extend_attention_supported", &extend_attention_supported,
        "whether paged_extend_attention takes this dtype (a torch.dtype) and head dim");
  m.def("rms_norm", &rms_norm, "RMSNorm in fp32, optionally adding x into the fp32 residual in place first");
  m.def("rope_", &rope_, "rotate-half RoPE applied to q and k in place");
  m.attr("LINEAR_PANEL") = tandem_cpu::linear_panel();
  m.def("pack_linear", &pack_linear, "an [out, in] weight packed for linear: [panels, in, LINEAR_PANEL], fp32 or bf16",
        py::arg("weight"), py::arg("dtype") = py::none());
  m.def("linear", &linear, "y = x · Wᵀ (+ bias) in fp32 from pack_linear's weight; n: W's rows (out features)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"));
  m.def("lora_", &lora_, "y[t] += (x[t] · A_partᵀ) · B_partᵀ for each part of row t's adapter (slots[t]; -1: none), "
        "from the stacked a [S, in] and b_t [S, out], in place", py::arg("x"), py::arg("y"), py::arg("a"),
        py::arg("b_t"), py::arg("slots"), py::arg("parts"), py::arg("first_part"));
}
