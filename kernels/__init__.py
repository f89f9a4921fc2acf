"""Triton kernels for the GPU hot path, each with a shape/stride/dtype-checking wrapper and a torch
reference (`kernels.reference`).

| module | wrapper | what it does |
|---|---|---|
| `decode_attention` | `paged_decode_attention` | one query per sequence over its KV pages; GQA, split-K |
| `extend_attention` | `extend_attention` | new tokens attend causally to themselves and a paged prefix |
| `kv_store` | `store_kv` | write a step's new K/V rows into their page slots |
| `kv_pack` | `pack_kv_pages`, `unpack_kv_pages` | gather pages (either pool layout) into a contiguous staging buffer and back |
| `lora` | `add_lora` (`lora_shrink`, `lora_expand`) | mixed-adapter LoRA: each adapter's rows times its A, then added into y via its B |
| `rmsnorm` | `rms_norm` | RMSNorm, optionally fused with the residual add |
| `rope` | `apply_rope` | rotate-half rotary embedding of q and k in one launch |

Importing this package imports nothing heavy: each kernel module imports triton, and only the
triton attention backend, the tests and the benchmark import them. On CPU the kernels run only
under `TRITON_INTERPRET=1` (set before the kernel modules are imported; correctness only, ~1000x
slower than torch). All arithmetic is fp32 whatever the storage dtype.
"""
