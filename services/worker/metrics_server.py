"""A worker's HTTP side port: Prometheus `/metrics`, and `/profile` for a trace of the next steps.

    curl -X POST 'http://127.0.0.1:PORT/profile?steps=20'            # 200 {"path": ...} once written
    curl -X POST 'http://127.0.0.1:PORT/profile?steps=20&wait=0'     # 202 {"path": ...} at once

GET works too. `wait` (seconds, default 30) bounds how long the answer waits for the file: a worker
with no traffic runs no steps, and then answers 202 with the path the trace will have.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from prometheus_client.exposition import MetricsHandler

from tandem.services.worker.profiler import ProfileBusy, StepProfiler

DEFAULT_WAIT_S = 30.0
MAX_WAIT_S = 3600.0


def start_metrics_server(host: str, port: int, profiler: StepProfiler | None) -> ThreadingHTTPServer:
    """Serve on a daemon thread; `server.server_port` is the port (close with `shutdown()`)."""

    class Handler(MetricsHandler):
        def do_GET(self) -> None:
            if urlparse(self.path).path.rstrip("/") == "/profile":
                self._profile()
            else:
                super().do_GET()

        def do_POST(self) -> None:
            if urlparse(self.path).path.rstrip("/") == "/profile":
                self._profile()
            else:
                self._reply(404, {"error": "POST /profile?steps=N is the only POST endpoint"})

        def _profile(self) -> None:
            if profiler is None:
                self._reply(404, {"error": "profiling is off on this worker"})
                return
            query = parse_qs(urlparse(self.path).query)
            try:
                steps = int(query.get("steps", ["10"])[-1])
                wait = float(query.get("wait", [str(DEFAULT_WAIT_S)])[-1])
                if not 0 <= wait <= MAX_WAIT_S:
                    raise ValueError(f"wait must be in [0, {MAX_WAIT_S:g}] seconds")
                job = profiler.request(steps)
            except ProfileBusy as e:
                self._reply(409, {"error": str(e)})
                return
            except ValueError as e:
                self._reply(400, {"error": f"bad /profile query: {e} (expected steps=N, optional wait=SECONDS)"})
                return
            body = {"path": str(job.path), "steps": job.steps}
            if not job.done.wait(wait):
                self._reply(202, {**body, "status": "recording", "steps_done": job.steps_done})
            elif job.error:
                self._reply(500, {**body, "error": job.error})
            else:
                self._reply(200, {**body, "status": "written"})

        def _reply(self, status: int, body: dict) -> None:
            data = (json.dumps(body) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = _family(host, port)

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def _family(host: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]
