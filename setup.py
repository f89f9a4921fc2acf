"""The one thing pyproject.toml cannot say: the source folders at the top of the tree are installed as
subpackages of `tandem` (engine/ -> tandem.engine, ...), every package below them included.
Metadata, dependencies and entry points are in pyproject.toml."""

from setuptools import find_packages, setup

# Top-level folders of the tree that are import packages, each installed as tandem.<folder>.
FOLDERS = ("engine", "services", "kvtransfer", "kernels", "bench")

packages = find_packages(include=["tandem", "tandem.*"])
for folder in FOLDERS:
    packages += [f"tandem.{p}" for p in find_packages(include=[folder, f"{folder}.*"])]

setup(
    packages=packages,
    package_dir={f"tandem.{folder}": folder for folder in FOLDERS},
    package_data={
        "tandem.kernels.cpu": ["*.cpp", "*.h"],          # compiled where they run, from these sources
        "tandem.kvtransfer.native": ["*.c"],
        "tandem.bench.serve": ["isa_cap/*.py"],           # a sitecustomize put on a peer's PYTHONPATH
    },
)
