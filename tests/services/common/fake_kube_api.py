"""A fake Kubernetes API server on 127.0.0.1 for discovery tests: EndpointSlice list and watch.

It answers `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices` the way kube-apiserver does:
a list (with the collection's resourceVersion) or, with `watch=true`, a stream of JSON lines
(`{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}`) for changes after `resourceVersion`, ended
after `timeoutSeconds`. Tests change the objects with `put` / `delete` and can expire a watch (410).
The objects start from a recorded list (data/endpointslice_list.json).
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RECORDED = Path(__file__).parent / "data" / "endpointslice_list.json"
PATH = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"


def recorded_slices() -> dict[str, dict]:
    """The recorded slices by role label (deep copies, free to edit)."""
    items = json.loads(RECORDED.read_text())["items"]
    return {s["metadata"]["labels"]["tandem.ai/role"]: copy.deepcopy(s) for s in items}


def endpoint(ip: str, uid: str, name: str, ready: bool = True, terminating: bool = False) -> dict:
    return {"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
            "targetRef": {"kind": "Pod", "namespace": "tandem", "name": name, "uid": uid}, "nodeName": "node-1"}


class FakeKubeAPI:
    def __init__(self, namespace: str = "tandem"):
        self.namespace = namespace
        self.rv = 1000
        self.objects: dict[str, dict] = {}
        self.events: list[tuple[int, dict]] = []
        self.requests: list[dict] = []
        self.cond = threading.Condition()
        self._expire_before = 0       # watches from a version below this get 410 Gone
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"   # watch streams are chunked, as kube-apiserver sends them

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                api._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self._closed = False

    # --- test side -------------------------------------------------------------------------------
    def put(self, obj: dict) -> None:
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.objects else "ADDED"
            self.objects[name] = obj
            self.events.append((self.rv, {"type": kind, "object": obj}))
            self.cond.notify_all()

    def delete(self, name: str) -> None:
        with self.cond:
            self.rv += 1
            obj = self.objects.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, {"type": "DELETED", "object": obj}))
            self.cond.notify_all()

    def expire_watches(self) -> None:
        """Compact history: open watches get a 410 Gone ERROR event and must list again."""
        with self.cond:
            self._expire_before = self.rv + 1
            self.cond.notify_all()

    def lists(self) -> int:
        return sum(1 for r in self.requests if r.get("watch") != ["true"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.cond:
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # --- server side -----------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = urllib.parse.parse_qs(url.query)
        self.requests.append(query)
        if url.path != PATH.format(ns=self.namespace):
            return self._json(h, 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "reason": "NotFound", "code": 404, "message": f"no route {url.path}"})
        selector = query.get("labelSelector", [""])[0]
        if query.get("watch") == ["true"]:
            return self._watch(h, int(query.get("resourceVersion", ["0"])[0] or 0),
                               float(query.get("timeoutSeconds", ["30"])[0]), selector)
        with self.cond:
            items = [copy.deepcopy(o) for o in self.objects.values() if _matches(o, selector)]
            body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.rv)}, "items": items}
        self._json(h, 200, body)

    def _watch(self, h: BaseHTTPRequestHandler, since: int, timeout_s: float, selector: str) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        deadline = time.monotonic() + timeout_s
        sent = since
        try:
            while not self._closed and time.monotonic() < deadline:
                with self.cond:
                    if sent < self._expire_before:
                        gone = {"type": "ERROR", "object": {
                            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                            "code": 410, "message": f"too old resource version: {sent} ({self.rv})"}}
                        chunk(json.dumps(gone).encode() + b"\n")
                        break
                    pending = [(rv, e) for rv, e in self.events if rv > sent]
                    if not pending:
                        self.cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                        continue
                for rv, event in pending:
                    sent = rv
                    if _matches(event["object"], selector):
                        chunk(json.dumps(event).encode() + b"\n")
            h.wfile.write(b"0\r\n\r\n")    # the server ends the watch (timeoutSeconds)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


def _matches(obj: dict, selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True
