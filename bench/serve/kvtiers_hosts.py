"""The KV-tiers comparison's 1P1D configurations across hosts (issue [22]): P and D each on a network
namespace host of its own (tandem.bench.cluster: its own IP, hostname and /dev/shm), P's link shaped
by tc tbf (`--link-mbit`), each worker with an L3 directory of its own (hosts share no disk), the
router and the gateway on a third host; the same seeded multi-turn load from this namespace. Needs root.

    python -m tandem.bench.serve.kvtiers --hosts --link-mbit 1000 --configs 1p1d-tiers-no-d2p,1p1d-tiers

The flags are what `tandem up` would give each process (`--kv-reuse-policy` to the router, the tier
and L1 flags to the workers, placed as `tandem up` places 1P1D: P on core 0, D on core 1), split by
`tandem up`'s own flag table, so a configuration means the same on one host and across hosts.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

from tandem.bench.serve.deployment import DeploymentUnavailable, Endpoint

PREFILL, DECODE = "prefill-0", "decode-0"
CORES = {PREFILL: "0", DECODE: "1"}       # `tandem up --mode disagg --prefill 1 --decode 1` on 2 cores


def split_up_args(up_argv: list[str]) -> tuple[list[str], list[str]]:
    """(every worker's flags, the router's) of a `tandem up` command line, as `tandem up` forwards them."""
    from tandem.cli import up_cmd

    parser = argparse.ArgumentParser(add_help=False)
    up_cmd.add_arguments(parser)
    args, unknown = parser.parse_known_args(up_argv)
    if unknown:
        raise ValueError(f"not `tandem up` flags: {' '.join(unknown)}")
    if args.mode != "disagg" or args.prefill != 1 or args.decode != 1:
        raise ValueError("--hosts runs 1P1D configurations only (--mode disagg --prefill 1 --decode 1)")
    return up_cmd.worker_args(args), up_cmd.router_args(args)


def host_args(disk_dirs: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Each worker's own flags: its cores, and its L3 directory where the configuration has tiers."""
    out = {}
    for name, cores in CORES.items():
        out[name] = ("--cpu-cores", cores, *(("--kv-disk-cache-dir", disk_dirs[name]) if name in disk_dirs else ()))
    return out


def _without(argv: list[str], flag: str) -> list[str]:
    """`argv` less `flag` and its value (the per-host copy replaces it)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


class ClusterConfigUp:
    """A kvtiers Tandem configuration on namespace hosts; the interface of kvtiers.TandemConfigUp."""

    def __init__(self, name: str, up_argv: list[str], tiers: bool, model: str, link_mbit: float | None,
                 start_timeout_s: float, backend: str, disk_root: str | None = None):
        self.name, self.model, self.link_mbit, self.tiers = name, model, link_mbit, tiers
        self.start_timeout_s, self.backend, self.disk_root = start_timeout_s, backend, disk_root
        workers, self.router_args = split_up_args(up_argv)
        self.worker_args = _without(workers, "--kv-disk-cache-dir")
        self.disk_dirs: dict[str, str] = {}
        self.net = self.cluster = None

    def describe(self) -> str:
        link = f"{self.link_mbit:g} Mbit/s" if self.link_mbit else "unshaped"
        return (f"namespace hosts ({PREFILL}'s link {link}): workers {' '.join(self.worker_args)}; "
                f"router {' '.join(self.router_args) or '(defaults)'}")

    def start(self) -> Endpoint:
        from tandem.bench.cluster.deploy import Cluster
        from tandem.bench.cluster.net import NetError, Network

        if self.tiers:
            self.disk_dirs = {n: tempfile.mkdtemp(prefix=f"tandem-kvtiers-{n}-", dir=self.disk_root) for n in CORES}
        try:
            self.net = Network("kvtiers")
        except NetError as e:
            raise DeploymentUnavailable(str(e)) from None
        self.cluster = Cluster(self.net, model=self.model, worker_args=tuple(self.worker_args),
                               host_args=host_args(self.disk_dirs), router_args=tuple(self.router_args),
                               gateway=self.backend == "openai-http", start_timeout_s=self.start_timeout_s)
        if self.link_mbit:
            self.net.shape(PREFILL, self.link_mbit)
        if self.backend == "openai-http":
            from tandem.bench.serve.sweep import first_http_model

            url = self.cluster.gateway_url
            return Endpoint("openai-http", url, first_http_model(url) or self.model, "ignore-eos")
        return Endpoint("tandem-grpc", self.cluster.router_addr, "", "ignore-eos")

    def close(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.cluster = None
            if self.net is not None:
                self.net.close()
                self.net = None
            for d in self.disk_dirs.values():
                shutil.rmtree(d, ignore_errors=True)
            self.disk_dirs = {}

    def log_tail(self) -> str:
        if self.cluster is None:
            return ""
        return "\n".join(f"[{n}] {line}" for n, lines in self.cluster.logs.items() for line in list(lines)[-15:])

    # ---- what kvtiers records beside each run (the metrics of each worker and the router) ---------
    def _workers(self) -> dict[str, str]:
        from tandem.bench.serve.kvtiers import metrics_text

        return {f"{n.split('-')[0]} {n}": metrics_text(self.cluster.worker_metrics_url(n)) for n in CORES}

    def kv_capacity(self) -> dict:
        from tandem.bench.serve.kvtiers import pool_tokens

        return {label: pool_tokens(text) for label, text in self._workers().items()}

    def tier_hits(self) -> dict:
        from tandem.bench.serve.kvtiers import tier_hits

        return {label: tier_hits(text) for label, text in self._workers().items()}

    def kv_reuse(self) -> dict:
        from tandem.bench.serve.kvtiers import metrics_text, reuse_summary

        prefill = metrics_text(self.cluster.worker_metrics_url(PREFILL))
        return reuse_summary([prefill], metrics_text(self.cluster.router_metrics_url()))
