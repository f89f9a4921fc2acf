"""`python -m tandem.bench.cluster`: a Tandem deployment with every service on a host of its own (a
network namespace on a bridge), and the link operations the tests and the chaos drill use.

    python -m tandem.bench.cluster up --prefill 1 --decode 2 [--worker-args "--transfer-backend tcp"]
    python -m tandem.bench.cluster partition --host decode-1      # from another shell; heal, shape too
    python -m tandem.bench.cluster cut --host prefill-0 --peer decode-0   # those two only; mend
    python -m tandem.bench.cluster cleanup                        # what a killed run left behind

`up` prints the hosts and addresses (JSON), serves until Ctrl-C, then removes everything it made.
Needs root (network namespaces) and iproute2.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading

from tandem.bench.cluster.deploy import Cluster, dump
from tandem.bench.cluster.net import PREFIX, Network, _ip, burst_for, cleanup, host_ip


def _veth(name: str, host: str) -> str:
    """The bridge side of `host`'s link in a running network (found through its namespace's peer index)."""
    ns = f"{PREFIX}-{name}-{host}"
    out = _ip("-n", ns, "-o", "link", "show", "eth0").stdout      # "... eth0@if123: ..."
    index = out.split("@if", 1)[1].split(":", 1)[0]
    for line in _ip("-o", "link", "show").stdout.splitlines():
        if line.split(":", 1)[0].strip() == index:
            return line.split(":")[1].strip().split("@")[0]
    raise SystemExit(f"no link of host {host!r} in network {name!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.cluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a deployment across namespaces and serve until Ctrl-C")
    up.add_argument("--model", default="smollm2-135m")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (hosts)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (hosts)")
    up.add_argument("--worker-args", default="", help='more flags for every worker, e.g. "--dtype float32"')
    up.add_argument("--router-args", default="", help="more flags for the router")
    up.add_argument("--mbit", type=float, default=None, help="shape every worker host's link to this rate")
    for cmd, text in (("partition", "cut a host off the bridge"), ("heal", "put a host back on the bridge"),
                      ("shape", "limit a host's link rate (--mbit; 0 lifts it)"),
                      ("cut", "cut two hosts off each other only (--host, --peer)"), ("mend", "undo cut")):
        q = sub.add_parser(cmd, help=text)
        q.add_argument("--host", required=True, help="e.g. decode-1, prefill-0, router, redis")
        if cmd == "shape":
            q.add_argument("--mbit", type=float, required=True)
        if cmd in ("cut", "mend"):
            q.add_argument("--peer", required=True, help="the other host, e.g. decode-0")
    sub.add_parser("cleanup", help="remove the namespaces and links of a run that was killed")
    for q in sub.choices.values():
        q.add_argument("--name", default="cl", help="the network's name (default: cl)")
    args = p.parse_args(argv)

    if args.cmd == "cleanup":
        print("removed: " + (", ".join(cleanup(args.name)) or "nothing"))
        return 0
    if args.cmd in ("partition", "heal"):
        veth = _veth(args.name, args.host)
        _ip("link", "set", veth, *(["nomaster"] if args.cmd == "partition" else ["master", f"{PREFIX}-{args.name}"]))
        return 0
    if args.cmd in ("cut", "mend"):
        a, b = (f"{PREFIX}-{args.name}-{h}" for h in (args.host, args.peer))
        for x, y in ((a, b), (b, a)):
            verb = "replace" if args.cmd == "cut" else "del"
            _ip("-n", x, "route", verb, "blackhole", f"{host_ip(y)}/32", check=args.cmd == "cut")
        return 0
    if args.cmd == "shape":
        import subprocess

        veth, ns = _veth(args.name, args.host), f"{PREFIX}-{args.name}-{args.host}"
        for pre in ([], ["-n", ns]):
            dev = "eth0" if pre else veth
            if args.mbit <= 0:
                subprocess.run(["tc", *pre, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            else:
                subprocess.run(["tc", *pre, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                                f"{args.mbit}mbit", "burst", f"{burst_for(args.mbit)}kb", "latency", "50ms"], check=True)
        return 0

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Network(args.name) as net:
        cluster = Cluster(net, model=args.model, prefill=args.prefill, decode=args.decode,
                          worker_args=tuple(shlex.split(args.worker_args)),
                          router_args=tuple(shlex.split(args.router_args)), quiet=False)
        try:
            if args.mbit:
                for w in cluster.worker_names():
                    net.shape(w, args.mbit)
            print(dump(cluster.summary()), flush=True)
            print(f"serving: curl {cluster.gateway_url}/v1/models  (Ctrl-C stops and removes everything)",
                  file=sys.stderr, flush=True)
            stop.wait()
        finally:
            cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
