"""Generate the SDK's protobuf module from the repository's proto file (run by the build, or by hand).

    python sdk/gen_proto.py            # writes sdk/tandem_client/_proto/generation_pb2.py (+ .pyi)

The module keeps the proto's own file name (`tandem/v1/generation.proto`) so it can share a
process with the server's stubs (`tandem.v1.generation_pb2`): protobuf accepts the same file
registered twice when the bytes are identical. Only messages are generated; the SDK calls the two
RPCs by method path, which spares it grpcio-tools' version pin on grpcio.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "tandem_client" / "_proto"
PROTO = "tandem/v1/generation.proto"
# A checkout has the proto next to sdk/; an sdist carries the generated module instead.
PROTO_ROOTS = (HERE.parent / "proto", HERE / "proto")


def proto_root() -> Path | None:
    return next((root for root in PROTO_ROOTS if (root / PROTO).is_file()), None)


def generate() -> Path:
    """(Re)generate `generation_pb2.py` when the proto is at hand; return the module's path."""
    target = OUT / "generation_pb2.py"
    root = proto_root()
    if root is None:
        if target.is_file():
            return target
        raise FileNotFoundError(f"neither {PROTO} (looked in {', '.join(map(str, PROTO_ROOTS))}) nor a generated {target}")
    from grpc_tools import protoc  # build-time only

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{root}", f"-I{Path(protoc.__file__).parent / '_proto'}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", str(root / PROTO)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {root / PROTO}")
        OUT.mkdir(parents=True, exist_ok=True)
        for name in ("generation_pb2.py", "generation_pb2.pyi"):
            shutil.copyfile(Path(tmp) / "tandem" / "v1" / name, OUT / name)
    return target


def runtime_protobuf_requirement(module: Path) -> str:
    """`protobuf>=X.Y.Z`: the generated code refuses an older runtime than the protoc that wrote it."""
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                  module.read_text())
    return f"protobuf>={m.group(1)}.{m.group(2)}.{m.group(3)}" if m else "protobuf>=5.29"


if __name__ == "__main__":
    path = generate()
    print(f"wrote {path} (needs {runtime_protobuf_requirement(path)})", file=sys.stderr)
