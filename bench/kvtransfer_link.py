"""What the KV checksums cost on a link: tcp transfers between two hosts (network namespaces on a
bridge, bench/cluster/net.py), checked vs unchecked, with the link unshaped and shaped (tc tbf).

    python -m tandem.bench.kvtransfer_link --out bench/results/kvtransfer_link.json   # as root, ~1 min

bench/kvtransfer.py times the data paths on 127.0.0.1, where the bytes move at memory speed and, on a
small box, sender and receiver already keep every core busy: there a checksum costs what computing it
costs. Between hosts the link sets the pace; this measures how much of the checks' work still shows
on the transfer's time there. P (this process, in the root namespace, reaching the hosts through the
bridge) sends SmolLM2-shaped pages scattered over its pool to D (a receiver in its own namespace host)
over the tcp backend; `checked` negotiates the best checksum both have (crc32c where native, computed
on the way), `unchecked` sends none. Rows are interleaved in a shuffled order, repeats per rate.
`checksum_cost` = checked / unchecked - 1 (median; target <= 5%).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics

import torch

from tandem.bench.cluster.net import Network
from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.kvtransfer import Link, RxChild, smollm2_layout
from tandem.bench.results import write_result
from tandem.kvtransfer.protocol.checksum import available


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--move", type=int, default=128, help="pages per transfer (368 KiB each)")
    ap.add_argument("--pool-pages", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mbit", default="0,10000,1000", help="link rates to measure; 0 = unshaped")
    add_load_flags(ap, seed=0)
    add_out_flag(ap)
    args = ap.parse_args()
    layout = smollm2_layout(args.pool_pages)
    rng = random.Random(args.seed)
    src = rng.sample(range(layout.num_pages), args.move)
    dst = rng.sample(range(layout.num_pages), args.move)
    nbytes = args.move * layout.num_layers * 2 * layout.page_bytes
    pool = torch.empty(layout.shape, dtype=layout.torch_dtype)
    pool.view(torch.int16).random_(-30000, 30000)
    rates = [int(r) for r in args.mbit.split(",")]
    print(f"{args.move} scattered pages ({nbytes / 1e6:.1f} MB) per transfer over tcp, P -> D across a veth; "
          f"checked with {available()[0]}; rates {rates} Mbit (0 = unshaped)")

    rows: dict[str, list[float]] = {}
    with Network("kvlink") as net:
        host = net.add_host("d")
        rx = RxChild("tcp", layout, host=host.ip, netns=host.ns)
        links = {}
        try:
            links = {kind: Link(kind, rx, "tcp", pool, layout, "tcp", **opts)
                     for kind, opts in (("checked", {}), ("unchecked", {"checksums": ()}))}
            for mbit in rates:
                net.shape("d", mbit or None)
                order = list(links)
                for rep in range(args.repeats + 1):
                    rng.shuffle(order)
                    for kind in order:
                        t = links[kind].transfer(src, dst)
                        if rep:
                            rows.setdefault(f"{kind}@{mbit}", []).append(t)
        finally:
            for link in links.values():
                link.tx.close()
            rx.close()

    results, cost = [], {}
    print(f"\n{'link':<10}{'row':<11}{'median ms':>10}{'min ms':>9}{'Gbit/s':>8}")
    for mbit in rates:
        for kind in ("checked", "unchecked"):
            ts = rows[f"{kind}@{mbit}"]
            med = statistics.median(ts)
            results.append({"mbit": mbit, "row": kind, "median_ms": 1e3 * med, "min_ms": 1e3 * min(ts),
                            "gbit_s": nbytes * 8 / med / 1e9})
            print(f"{mbit or 'unshaped':<10}{kind:<11}{1e3 * med:10.1f}{1e3 * min(ts):9.1f}{nbytes * 8 / med / 1e9:8.2f}")
        cost[str(mbit)] = statistics.median(rows[f"checked@{mbit}"]) / statistics.median(rows[f"unchecked@{mbit}"]) - 1
    print("\nchecksum cost: " + ", ".join(f"{m if m != '0' else 'unshaped'} {c:+.1%}" for m, c in cost.items()))
    if args.out:
        write_result(args.out, {
            "bench": "kvtransfer_link", "checksum": available()[0], "moved_pages": args.move,
            "payload_mb": nbytes / 1e6, "repeats": args.repeats, "cores": mp.cpu_count(), "rows": results,
            "checksum_cost": cost, "targets_met": {f"checksum_cost_{m}<=0.05": c <= 0.05 for m, c in cost.items()},
            "layout": layout.__dict__,
        }, tool="tandem.bench.kvtransfer_link")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
