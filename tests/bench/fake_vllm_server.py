"""Stands in for `python -m vllm.entrypoints.openai.api_server` in tests: the same flags, /health and
/v1/models, and a forked child (like vLLM's engine core) that ignores SIGTERM, so only a process-group
teardown stops it. Writes {argv, env, child pid} as JSON to $FAKE_VLLM_RECORD once serving."""

import argparse
import json
import os
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--exit-at-once", action="store_true", help="fail like a broken install")
args, _ = p.parse_known_args()
if args.exit_at_once:
    print("ModuleNotFoundError: No module named 'vllm'", flush=True)
    sys.exit(1)

child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": args.model, "object": "model"}]}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


server = ThreadingHTTPServer((args.host, args.port), Handler)
record = os.environ["FAKE_VLLM_RECORD"]
with open(record + ".tmp", "w") as f:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid(),
               "child": child.pid}, f)
os.replace(record + ".tmp", record)  # whole or absent
print("INFO: Application startup complete.", flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # the leader exits on SIGTERM; its child does not
server.serve_forever()
