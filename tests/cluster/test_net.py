"""tandem.bench.cluster.net on its own (root): hosts reach each other over the bridge and not once
partitioned, a shaped link is limited, and close() leaves no namespace, veth or bridge behind."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

if os.geteuid() != 0:
    pytest.skip("network namespaces need root", allow_module_level=True)

from tandem.bench.cluster.net import Network, _ip, links, namespaces  # noqa: E402

ECHO = ("import socket,sys; s=socket.create_server(('0.0.0.0', 7000)); c,_=s.accept(); "
        "n=0\nwhile (b:=c.recv(1<<20)): n+=len(b)\nprint(n)")


def reach(net: Network, src: str, dst: str) -> bool:
    code = f"import socket; socket.create_connection(('{net.host(dst).ip}', 7001), timeout=1).close()"
    return net.host(src).run([sys.executable, "-c", code]).returncode == 0


def test_partition_heal_shape_and_nothing_left_behind():
    with Network("ntest") as net:
        a, b = net.add_host("a"), net.add_host("b")
        server = b.popen([sys.executable, "-c", "import socket,time; s=socket.create_server(('0.0.0.0', 7001)); "
                          "[s.accept() for _ in range(9)]"])
        time.sleep(0.5)
        assert reach(net, "a", "b")
        net.partition("b")
        assert net.partitioned("b") and not reach(net, "a", "b")
        net.heal("b")
        assert not net.partitioned("b") and reach(net, "a", "b")

        # 8 Mbit/s: 2 MB take about 2 s to arrive (a token bucket, not an exact rate). Timed at the
        # receiver, which reads until the sender closes: sendall() returns once the bytes are buffered.
        net.shape("b", mbit=8)
        sink = b.popen([sys.executable, "-c", ECHO.replace("7000", "7002")])
        time.sleep(0.5)
        t0 = time.monotonic()
        send = (f"import socket; c=socket.create_connection(('{b.ip}', 7002)); c.sendall(b'x' * 2_000_000); c.close()")
        assert a.run([sys.executable, "-c", send], timeout=30).returncode == 0
        sink.wait(30)
        assert time.monotonic() - t0 > 1.5
        server.kill()
        bridge = net.bridge
    assert not namespaces(bridge) and bridge not in links(bridge)


def test_partitioning_any_host_leaves_the_others_and_the_root_namespace_connected():
    """The bridge keeps its address whichever port leaves it: before it was fixed, cutting off the host
    whose veth had the lowest MAC changed the bridge's MAC, and every other host lost the root namespace
    (where clients run) until its ARP entry expired."""
    with Network("nmac") as net:
        for name in ("a", "b", "c", "d"):
            net.add_host(name)
        root = socket.create_server((net.gateway_ip, 7003), backlog=64)   # a client's side of the bridge
        code = f"import socket; socket.create_connection(('{net.gateway_ip}', 7003), timeout=1).close()"

        def reach_root(host: str) -> bool:
            return net.host(host).run([sys.executable, "-c", code]).returncode == 0

        mac = _ip("-br", "link", "show", net.bridge).stdout.split()[2]
        assert all(reach_root(h) for h in net.hosts)       # every host now has the bridge in its ARP cache
        for name in net.hosts:
            net.partition(name)
            assert _ip("-br", "link", "show", net.bridge).stdout.split()[2] == mac, f"partitioning {name}"
            assert all(reach_root(h) for h in net.hosts if h != name), f"partitioning {name}"
            net.heal(name)
            assert _ip("-br", "link", "show", net.bridge).stdout.split()[2] == mac, f"healing {name}"
        root.close()


def test_cut_separates_two_hosts_only_and_mend_joins_them():
    with Network("ncut") as net:
        for name in ("a", "b", "c"):
            net.add_host(name)
        servers = [net.host(h).popen([sys.executable, "-c", "import socket; s=socket.create_server(('0.0.0.0', 7001)); "
                                      "[s.accept() for _ in range(9)]"]) for h in ("a", "b")]
        time.sleep(0.5)
        assert reach(net, "a", "b") and reach(net, "b", "a")
        net.cut("a", "b")
        assert not reach(net, "a", "b") and not reach(net, "b", "a")
        assert reach(net, "c", "a") and reach(net, "c", "b")       # both still reach everyone else
        net.mend("a", "b")
        assert reach(net, "a", "b") and reach(net, "b", "a")
        for s in servers:
            s.kill()
