"""Compile every kernel for an H100/H200 (sm_90) without a GPU: Triton's front end, LLVM and the
ptxas bundled with the triton wheel. Prints one JSON line per kernel with its resource usage.

    python -m tests.kernels.sm90_compile      # TRITON_INTERPRET must be unset

Launch attributes mimic a JIT launch: pointers and stride arguments 16-byte divisible (what Triton
specialises on when the real tensors are aligned), representative shapes (Llama-3-8B-like
attention, hidden 4096).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tandem.kernels import decode_attention, extend_attention, kv_pack, kv_store, lora, rmsnorm, rope
from tandem.kernels.common import attention_tile, num_warps_for

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(fn, ptrs: dict[str, str], consts: dict, floats=(), num_warps: int = 4) -> dict:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "fp32" if name in floats else "i32")
    aligned = [n for n in fn.arg_names if n in ptrs or n.startswith("stride") or n.startswith(("s_", "d_"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                              options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"kernel": fn.__name__, "regs": int(regs.group(1)), "stack": int(stack.group(1)),
            **{k: v for k, v in consts.items() if k.startswith("BLOCK") or k in ("UPCAST", "DIRECT")}}


def cases():
    cuda = torch.device("cuda")
    for dt, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        up = dtype == torch.float32
        tile = attention_tile(128, dtype, cuda)      # the wrappers' choice at head_dim 128
        warps = num_warps_for(tile * 128)
        qkv = dict(Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", PageTable="*i32")
        for direct in (True, False):
            yield (dt, decode_attention._decode_split_kernel,
                   {**qkv, "KVLens": "*i32", "Out": f"*{dt}", "PartO": "*fp32", "PartLSE": "*fp32"},
                   dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_N=tile,
                        BLOCK_D=128, UPCAST=up, DIRECT=direct), ("scale_log2",), warps)
        yield (dt, decode_attention._decode_merge_kernel, dict(PartO="*fp32", PartLSE="*fp32", Out=f"*{dt}"),
               dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, BLOCK_H=4, BLOCK_S=4, BLOCK_D=128), (), 4)
        yield (dt, extend_attention._extend_kernel,
               {**qkv, "QStart": "*i32", "QLens": "*i32", "PrefixLens": "*i32", "Out": f"*{dt}"},
               dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_Q=tile // 4, BLOCK_G=4, BLOCK_M=tile,
                    BLOCK_N=tile, BLOCK_D=128, UPCAST=up), ("scale_log2",), warps)
        yield (dt, kv_store._store_kv_kernel,
               dict(KNew=f"*{dt}", VNew=f"*{dt}", KCache=f"*{dt}", VCache=f"*{dt}", Slots="*i64"),
               dict(KV_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_T=4, BLOCK_C=1024), (), 4)
        for gather in (True, False):
            yield (dt, kv_pack._copy_pages_kernel, dict(Src=f"*{dt}", Dst=f"*{dt}", PageIds="*i64"),
                   dict(PAGE_SIZE=16, KV_HEADS=8, HEAD_DIM=128, BLOCK=4096, GATHER=gather), (), 4)
        segs = dict(Rows="*i32", Starts="*i32", Slots="*i32", Spans="*i32")
        for block_m in (16, 64):                      # decode-sized and prefill-sized segments
            yield (dt, lora._shrink_kernel, {"X": f"*{dt}", "A": f"*{dt}", "Part": "*fp32", **segs},
                   dict(BLOCK_M=block_m, BLOCK_R=lora.MAX_BLOCK_R, BLOCK_K=lora.BLOCK_K, UPCAST=up), (), lora.num_warps(block_m))
            yield (dt, lora._expand_kernel, {"Part": "*fp32", "B": f"*{dt}", "Y": f"*{dt}", **segs},
                   dict(BLOCK_M=block_m, BLOCK_N=lora.BLOCK_N, BLOCK_R=lora.MAX_BLOCK_R, UPCAST=up), (), lora.num_warps(block_m))
        yield (dt, rmsnorm._rms_norm_kernel,
               dict(X=f"*{dt}", Res=f"*{dt}", W=f"*{dt}", Out=f"*{dt}", ResOut=f"*{dt}"),
               dict(HAS_RESIDUAL=True, BLOCK_N=4096), ("eps",), num_warps_for(4096))
        yield (dt, rope._rope_kernel,
               dict(Q=f"*{dt}", K=f"*{dt}", Cos="*fp32", Sin="*fp32", QOut=f"*{dt}", KOut=f"*{dt}"),
               dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_J=64), (), 4)


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "unset TRITON_INTERPRET: this compiles real GPU code"
    for dtype, fn, ptrs, consts, floats, warps in cases():
        print(json.dumps({"dtype": dtype, **compile_kernel(fn, ptrs, consts, floats, warps)}), flush=True)


if __name__ == "__main__":
    main()
