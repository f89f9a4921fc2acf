"""gRPC keepalive for every long-lived connection between Tandem's services (torch-free).

A TCP connection to a host that is partitioned away, frozen or powered off does not fail by itself:
nothing arrives and nothing is refused, so an open stream waits for as long as the kernel retries
(minutes). Every channel one of Tandem's services opens to another (router -> workers, gateway ->
router, worker -> peer workers) therefore pings on HTTP/2 every `KEEPALIVE_TIME_S` and gives the
connection up when a ping is not answered within `KEEPALIVE_TIMEOUT_S`: its calls end with
UNAVAILABLE, which the router treats as the worker being gone (retry, or mid-stream migration). A
silent peer is noticed within DETECT_BOUND_S. Servers accept pings that often (their default
rejects pings more frequent than 5 min and closes the connection), and ping their clients on the
same schedule, so a worker cancels the requests of a router it can no longer reach and frees their
pages.

The KV transfer links (kvtransfer/protocol/wire.py) use TCP keepalive on the same bound, the
registry's heartbeats expire a silent worker within their TTL (services/common/registry.py).
"""

from __future__ import annotations

KEEPALIVE_TIME_S = 2.0       # ping after this long without a ping (data or not)
KEEPALIVE_TIMEOUT_S = 3.0    # ... and give the connection up if the ack is not back within this
DETECT_BOUND_S = KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S   # worst case from the last byte to UNAVAILABLE

CLIENT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),   # an idle channel notices too (before its next call)
    ("grpc.http2.max_pings_without_data", 0),     # pings are not limited while no data flows
    # The timeout of any ping in flight: a keepalive ping that finds another ping (e.g. the flow-control
    # estimator's) outstanding waits on that one, which gRPC gives up only after this (default 60 s).
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *CLIENT_OPTIONS,                              # the server pings its clients on the same schedule
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_TIME_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),           # never close a connection for pinging often
)
