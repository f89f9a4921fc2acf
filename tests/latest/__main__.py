"""`make test-latest`: Tandem as a new user would install it today, without the lock.

A throwaway venv resolved from pyproject.toml's ranges (the newest releases pip finds), Tandem and its
SDK installed into it from this checkout, then a smoke from a directory outside the checkout: `tandem
up` with the default model, one chat request over HTTP, one request through the SDK. What drifted from
locks/tandem.lock is listed first, so a failure can be traced to a release. Not in CI (it depends on
what the registry serves today); run it before `make lock` and after a release of a dependency.

Only the standard library: it runs with any python3 (`make test-latest` uses the machine's).

    python3 -m tests.latest [--python python3.11] [--keep] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"


def step(what: str) -> None:
    print(f"test-latest: {what}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, **kw)


def locked() -> dict[str, str]:
    text = (ROOT / "locks" / "tandem.lock").read_text() + (ROOT / "locks" / "no-deps.lock").read_text()
    return {_canon(n): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M)}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install(venv: Path, python: str, find_links: list[str]) -> dict[str, str]:
    """pyproject's ranges resolved today into `venv`; returns name -> version of what got installed."""
    run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *find_links]
    run([*pip, "--upgrade", "pip"])
    run([*pip, "torch==2.13.0"])       # the CPU build on this disk (pip's default index has CUDA ones)
    run([*pip, "-e", f"{ROOT}[dev]"])
    no_deps = [line.strip() for line in (ROOT / "locks" / "no-deps.in").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    run([*pip, "--no-deps", *no_deps])
    run([*pip, "-e", str(ROOT / "sdk")])
    freeze = run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"], capture_output=True).stdout
    return {_canon(p["name"]): p["version"] for p in json.loads(freeze)}


def drift(installed: dict[str, str]) -> dict[str, list[str | None]]:
    lock = locked()
    names = (set(lock) | set(installed)) - {"tandem", "tandem-client", "uv"}
    return {n: [lock.get(n), installed.get(n)] for n in sorted(names) if lock.get(n) != installed.get(n)}


def smoke(venv: Path, where: Path, model: str, timeout_s: float) -> dict:
    """The stack from `where` (outside the checkout), a chat request and an SDK request."""
    proc = subprocess.Popen([str(venv / "bin" / "tandem"), "up", "--model", model, "--port", "0",
                             "--gateway-port", "0", "--ready-json"], cwd=where, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log: list[str] = []
    info = None
    deadline = time.monotonic() + timeout_s
    try:
        for line in proc.stdout:
            log.append(line.rstrip())
            if line.startswith("TANDEM_UP "):
                info = json.loads(line[len("TANDEM_UP "):])
                break
            if time.monotonic() > deadline:
                break
        if info is None:
            raise RuntimeError("the stack did not come up:\n" + "\n".join(log[-40:]))
        step(f"up: gateway {info['gateway']}, router {info['router']}")
        body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                           "temperature": 0}).encode()
        req = urllib.request.Request(info["gateway"] + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            chat = json.loads(r.read())["choices"][0]["message"]["content"]
        step(f"chat: {chat!r}")
        sdk = run([str(venv / "bin" / "python"), "-P", "-c",
                   "import sys; from tandem_client import Client\n"
                   "with Client(sys.argv[1]) as c: print(c.generate('The capital of France is', max_tokens=8, "
                   "temperature=0).text)", info["router"]], cwd=where, capture_output=True, timeout=120).stdout.strip()
        step(f"sdk: {sdk!r}")
        return {"chat": chat, "sdk": sdk, "ok": "Paris" in chat and "Paris" in sdk}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.latest", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the interpreter of the throwaway venv")
    p.add_argument("--find-links", action="append", default=[], help="passed to pip (e.g. /opt/wheels)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the stack to come up")
    p.add_argument("--keep", action="store_true", help="keep the venv (its path is printed)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "test_latest.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tandem-latest-"))
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "venv": str(work / "venv"), "ok": False}
    t0 = time.monotonic()
    try:
        step(f"resolving pyproject's ranges into {work / 'venv'} (no lock)")
        installed = install(work / "venv", args.python, [f"--find-links={f}" for f in args.find_links])
        result["install_s"] = round(time.monotonic() - t0, 1)
        result["drift"] = drift(installed)
        step(f"{len(result['drift'])} packages differ from locks/ (locked -> today):")
        for name, (was, now) in result["drift"].items():
            print(f"  {name}: {was} -> {now}")
        result.update(smoke(work / "venv", work, args.model, args.timeout))
    except (subprocess.CalledProcessError, RuntimeError, OSError, ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}" + (f"\n{e.stderr}" if getattr(e, "stderr", None) else "")
        step(f"FAILED: {result['error']}")
    finally:
        result["total_s"] = round(time.monotonic() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        if args.keep:
            step(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    step(("passed" if result["ok"] else "FAILED") + f" in {result['total_s']} s; JSON: {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
