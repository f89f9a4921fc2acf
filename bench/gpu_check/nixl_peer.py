"""The receiving side of part `nixl`: a second process that owns a zeroed KV pool, registers it with
its own NIXL agent (kvtransfer.backends.nixl._Agent, with its progress thread, as a decode worker's),
and answers on stdin/stdout:

  out  NIXL_PEER {"agent", "md", "base", "mem", "dev", "error_handling"}   once, when registered
  in   {"cmd": "digest", "pages": [...]}  ->  NIXL_PEER {"digest": int, "untouched_nonzero": int}
  in   {"cmd": "quit"}                    ->  closes the agent and exits 0

Only lines that start with NIXL_PEER are protocol (NIXL and UCX may print to stdout too).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

import torch

PREFIX = "NIXL_PEER "
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def digest(pool: torch.Tensor, pages: list[int]) -> int:
    """A position-weighted checksum of `pages` (in that order) over every (layer, K|V) region of a
    pool `[L, 2, P, ...]`: equal on both sides iff the bytes arrived where they should, in practice."""
    idx = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    total = torch.zeros((), dtype=torch.int64, device=pool.device)
    weights = None
    for layer in range(pool.shape[0]):
        for kv in range(2):
            x = pool[layer, kv].index_select(0, idx).contiguous().view(torch.int32).reshape(-1).to(torch.int64)
            if weights is None:
                weights = torch.arange(x.numel(), dtype=torch.int64, device=pool.device) % 65521 + 1
            total += (x * weights).sum() * (2 * layer + kv + 1)
    return int(total.item())


def untouched_nonzero(pool: torch.Tensor, written: list[int]) -> int:
    keep = torch.ones(pool.shape[2], dtype=torch.bool)
    keep[torch.tensor(written, dtype=torch.int64)] = False
    return int(pool[:, :, keep.to(pool.device)].count_nonzero().item())


def main(argv: list[str] | None = None) -> int:
    from tandem.kvtransfer.backends.nixl import _Agent, _agent_name
    from tandem.kvtransfer.backends.ucx_env import UcxSettings

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", required=True, help="pool shape, comma-separated [L, 2, P, page, heads, dim]")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--error-handling", default="peer")
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    pool = torch.zeros(shape, dtype=DTYPES[args.dtype], device=args.device)
    settings = UcxSettings.from_env(error_handling=args.error_handling)
    agent = _Agent(_agent_name("gpu-check", "rx"), pool, settings, host="127.0.0.1", busy=lambda: True)
    try:
        print(PREFIX + json.dumps({"agent": agent.name, "md": base64.b64encode(agent.metadata).decode(),
                                   "base": pool.data_ptr(), "mem": agent.mem, "dev": agent.dev,
                                   "error_handling": agent.error_handling}), flush=True)
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "quit":
                break
            if msg["cmd"] == "digest":
                if pool.is_cuda:
                    torch.cuda.synchronize()
                print(PREFIX + json.dumps({"digest": digest(pool, msg["pages"]),
                                           "untouched_nonzero": untouched_nonzero(pool, msg["pages"])}), flush=True)
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
