"""Build hook of `tandem-client`: generate the protobuf module before packaging (see gen_proto.py).

Metadata lives in pyproject.toml; only the dependencies are computed here, because the protobuf
runtime the package needs depends on the protoc that generated its module.
"""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_proto import generate, runtime_protobuf_requirement  # noqa: E402


class BuildPy(build_py):
    def run(self):
        generate()
        super().run()


class Sdist(sdist):
    def run(self):
        generate()  # the sdist carries the generated module: installing it needs no proto, no protoc
        super().run()


module = generate()
setup(
    cmdclass={"build_py": BuildPy, "sdist": Sdist},
    install_requires=["grpcio>=1.62", runtime_protobuf_requirement(module)],
)
