"""The one way a benchmark writes its results JSON: `write_result(path, data, tool=...)`.

Every file it writes says what made it: `tool` (the module, e.g. "tandem.bench.chaos"), `command`
(the command line, e.g. "python -m tandem.bench.chaos --model smollm2-135m") and `date` (local time,
ISO 8601), each unless `data` has that key already (then its value stays). Floats JSON has no
literal for become null (NaN) and "inf" / "-inf"; anything else JSON cannot hold (a Path, a tuple
inside an object...) is written as its str(). Indented by 1, ends with a newline, and replaces the
file atomically (a benchmark that rewrites its file after each step, then dies, leaves the last
whole one). Stdlib only: the GPU machine's parts import it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

STAMPS = ("tool", "command", "date")


def _json_safe(x):
    """`x` with NaN as None and +-inf as "inf" / "-inf" (JSON has neither), dict keys as str."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def command_line(tool: str) -> str:
    """How this process was started, to run it again: `python -m MODULE ARGS` when it was started with
    -m, `tandem ARGS` from a console script, `python FILE ARGS` for a script; else `python -m TOOL ARGS`."""
    args = shlex.join(sys.argv[1:])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv0 = sys.argv[0] if sys.argv else ""
    if spec is not None and spec.name:
        prog = f"python -m {spec.name.removesuffix('.__main__')}"
    elif argv0.endswith(".py"):
        prog = f"python {shlex.quote(argv0)}"
    elif argv0 and argv0 != "-c":
        prog = shlex.quote(Path(argv0).name)
    else:
        prog = f"python -m {tool}"
    return f"{prog} {args}".rstrip()


def write_result(path: str | os.PathLike, data: dict, *, tool: str) -> Path:
    """Write `data` to `path` as the results JSON described above (parent folders made); returns the
    path. `data` itself is not changed."""
    path = Path(path)
    stamps = {"tool": tool, "command": command_line(tool), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    doc = {**{k: v for k, v in stamps.items() if k not in data}, **data}
    text = json.dumps(_json_safe(doc), indent=1, default=str) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
