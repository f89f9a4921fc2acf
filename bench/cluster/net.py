"""Hosts on one machine: a Linux network namespace per host on a bridge, each with its own IP,
hostname and /dev/shm (torch-free; needs root and `ip`/`tc` from iproute2).

    with Network("t1") as net:                    # bridge tdm-t1, subnet 10.213.<k>.0/24
        redis = net.add_host("redis")             # namespace tdm-t1-redis, eth0 10.213.<k>.2
        proc = redis.popen(["redis-server", ...])
        net.shape("decode-0", mbit=100)           # tc tbf on both directions of that host's link
        net.partition("decode-0"); net.heal("decode-0")
        net.cut("prefill-0", "decode-0"); net.mend("prefill-0", "decode-0")   # only between those two
    # every process killed, every namespace, veth and the bridge deleted, and checked

A host is `ip netns exec <ns> unshare --uts --mount`: its own network stack, hostname (so the shm
data path's same-host check sees different hosts) and a private tmpfs on /dev/shm (POSIX shared
memory does not cross hosts). The bridge itself has .1, so this namespace (the test, the load
generator) reaches every host like a client on the same network. Partitioning takes a host's veth off
the bridge (`ip link set ... nomaster`): the host keeps its address but reaches nobody and nobody
reaches it, as when its switch port goes dark; healing puts it back. Cutting two hosts off each
other only (`cut`) gives each a blackhole route to the other (this kernel has no packet filter
modules: no iptables/nft, no tc filters). There is no delay or loss
emulation: this kernel has no `netem` (docs/resilience.md).

Names are short (Linux interface names are at most 15 bytes): bridge `tdm-<name>`, namespaces
`tdm-<name>-<host>`, veths `tdm<k>h<i>`. Another run with the same name is refused (the bridge
exists); `cleanup(name)` removes what a killed run left.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "tdm"
# A private test subnet per network: 10.213.<k>.0/24, k from the name (collisions are refused).
SUBNET_BASE = ipaddress.ip_network("10.213.0.0/16")


class NetError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetError(f"tc {' '.join(args)}: {proc.stderr.strip()}")


def namespaces(prefix: str = PREFIX) -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix + "-")]


def links(prefix: str = PREFIX) -> list[str]:
    out = _ip("-o", "link", "show").stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(prefix)]


def cleanup(name: str) -> list[str]:
    """Remove every namespace, veth and bridge of network `name` (a run that was killed); what was removed."""
    removed = []
    for ns in namespaces(f"{PREFIX}-{name}"):
        _kill_namespace_processes(ns)
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
    bridge = f"{PREFIX}-{name}"
    if bridge in links(bridge):
        _ip("link", "del", bridge, check=False)
        removed.append(bridge)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def burst_for(mbit: float) -> int:
    """A tbf bucket (KiB) for `mbit`: 64 KiB, or a millisecond of the rate where that is more (a
    smaller bucket caps the rate below what was asked: 10 Gbit with 64 KiB gave well under 10)."""
    return max(64, int(mbit // 8))


def host_ip(ns: str) -> str:
    """The IPv4 address of namespace `ns`'s eth0 (for the CLI, which has no Network object)."""
    out = _ip("-n", ns, "-4", "-o", "addr", "show", "dev", "eth0").stdout.split()
    return out[out.index("inet") + 1].split("/")[0]


def _free_octet(start: int) -> int:
    """The first 10.213.k.0/24 from `start` that no interface of this namespace uses."""
    used = _ip("-o", "-4", "addr", "show").stdout
    for i in range(250):
        k = 1 + (start - 1 + i) % 250
        if f" 10.213.{k}." not in used:
            return k
    raise NetError("every 10.213.k.0/24 subnet is in use")


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    veth: str                      # the bridge side of the host's link
    net: Network
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run on this host: its namespace, its hostname, its own /dev/shm."""
        setup = (f"hostname {shlex.quote(self.name)} && mount -t tmpfs -o size=4g tmpfs /dev/shm && "
                 'exec "$@"')
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup, "sh", *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on this host (its own session, so that stopping it stops its children)."""
        proc = subprocess.Popen(self.command(argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True,
                              timeout=timeout)


class Network:
    """A bridge and its hosts. Use as a context manager: `close()` stops every process it started,
    deletes every namespace and link, and raises if anything was left behind."""

    def __init__(self, name: str, third_octet: int | None = None):
        if not name.replace("-", "").isalnum() or len(f"{PREFIX}-{name}") > 15:
            raise ValueError(f"network name {name!r}: letters, digits and '-', at most {15 - len(PREFIX) - 1} long")
        if os.geteuid() != 0:
            raise NetError("network namespaces need root")
        self.name = name
        self.bridge = f"{PREFIX}-{name}"
        k = third_octet if third_octet is not None else _free_octet(1 + (sum(map(ord, name)) * 7 + len(name)) % 250)
        self.subnet = ipaddress.ip_network(f"10.213.{k}.0/24")
        self.k = k
        self.gateway_ip = str(self.subnet.network_address + 1)
        self.bridge_mac = f"02:54:d5:{k:02x}:00:01"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        if self.bridge in links(self.bridge):
            raise NetError(f"network {name!r} exists (bridge {self.bridge}); `python -m tandem.bench.cluster "
                           f"cleanup --name {name}` removes what a killed run left")
        try:
            # A bridge takes the lowest MAC of its ports unless given one: a partitioned port that had
            # it would change the bridge's address under the hosts' ARP caches, and traffic to the root
            # namespace (the clients) would vanish until they expire (~1 min). A fixed, locally
            # administered address keeps partitions from cutting anything but the host partitioned.
            _ip("link", "add", self.bridge, "address", self.bridge_mac, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_ip}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except Exception:
            self.close(check=False)
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close(check=exc[0] is None)

    def add_host(self, name: str) -> Host:
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        i = len(self.hosts)
        ns = f"{self.bridge}-{name}"
        veth = f"{PREFIX}{self.k}h{i}"
        ip = str(self.subnet.network_address + 2 + i)
        host = self.hosts[name] = Host(name, ns, ip, veth, self)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return host

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise KeyError(f"no host {name!r}; hosts: {', '.join(self.hosts)}")
        return self.hosts[name]

    # ---- links ------------------------------------------------------------------------------
    def shape(self, name: str, mbit: float | None, burst_kb: int | None = None) -> None:
        """Limit `name`'s link to `mbit` in each direction (token bucket); None lifts the limit.
        `burst_kb`: the bucket (default `burst_for(mbit)`)."""
        host = self.host(name)
        for args in (["dev", host.veth], ["-n", host.ns, "dev", "eth0"]):
            netns = args[:2] if args[0] == "-n" else []
            dev = args[len(netns):]
            if mbit is None:
                subprocess.run(["tc", *netns, "qdisc", "del", *dev, "root"], capture_output=True)
            else:
                _tc(*netns, "qdisc", "replace", *dev, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", f"{burst_kb or burst_for(mbit)}kb", "latency", "50ms")

    def partition(self, name: str) -> None:
        """Cut `name` off the network (its veth leaves the bridge)."""
        _ip("link", "set", self.host(name).veth, "nomaster")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.host(name).veth, "master", self.bridge)

    def cut(self, a: str, b: str) -> None:
        """Cut hosts `a` and `b` off each other only (each drops what it would send the other: a
        blackhole route); both still reach everyone else. Their open connections go silent, as across a
        failed path; a new connect between them fails at once (EINVAL) rather than timing out."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.host(x).ns, "route", "replace", "blackhole", f"{self.host(y).ip}/32")

    def mend(self, a: str, b: str) -> None:
        """Undo `cut(a, b)`."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.host(x).ns, "route", "del", "blackhole", f"{self.host(y).ip}/32", check=False)

    def partitioned(self, name: str) -> bool:
        return f"master {self.bridge}" not in _ip("-o", "link", "show", self.host(name).veth).stdout

    # ---- teardown ---------------------------------------------------------------------------
    def stop_processes(self, grace_s: float = 10.0) -> None:
        procs = [p for h in self.hosts.values() for p in h.procs if p.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)

    def close(self, check: bool = True, grace_s: float = 10.0) -> None:
        """Idempotent. `check`: raise NetError if a namespace or link of this network is left."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.stop_processes(grace_s)
        for host in self.hosts.values():
            _kill_namespace_processes(host.ns)
            _ip("link", "del", host.veth, check=False)    # both ends at once, whatever still holds the netns
            _ip("netns", "del", host.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 10.0   # the kernel tears a namespace down once its last user is gone
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left and check:
            raise NetError(f"network {self.name} left {', '.join(left)} behind")

    def leftovers(self) -> list[str]:
        """This network's namespaces, bridge and veths that still exist."""
        names = set(links(PREFIX))
        return (namespaces(self.bridge) + [self.bridge] * (self.bridge in names)
                + [h.veth for h in self.hosts.values() if h.veth in names])
