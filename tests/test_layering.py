"""The tree's layering, read from the source with `ast` (torch-free, nothing imported): imports go
services -> engine, kvtransfer, kernels and never back; engine's rooms import each other without a
cycle; the bookkeeping and the torch-free services never reach torch through the repo's own modules.

An import counts wherever it stands (a function-level import runs when the function does), except
under `if TYPE_CHECKING:`, which never runs: an annotation is not a dependency at run time.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from functools import cache
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The source folders installed as tandem.<folder> (setup.py), and tandem/ itself (cli, v1, kvblocks).
FOLDERS = ("engine", "services", "kvtransfer", "kernels", "bench")
LAYERS = ("engine", "services", "kvtransfer", "kernels")

# What each layer must never import.
FORBIDDEN = {
    "engine": {"services", "kvtransfer"},
    "kvtransfer": {"services"},
    "kernels": {"engine", "services", "kvtransfer"},
}

# Modules that run without torch (schedulers, allocators, caches, queues; the services that ship
# without torch): neither they nor any repo module they import imports torch.
TORCH_FREE = (
    "engine/scheduler/*.py", "engine/kvcache/*.py", "engine/kvcache/tiers/*.py", "engine/tokenizer/*.py", "engine/sampling_params.py",
    "engine/structured/*.py", "engine/structured_output.py",
    "engine/config.py", "engine/errors.py", "engine/outputs.py",
    "engine/models/config.py", "engine/models/source.py",   # the gateway reads the model's folder too
    "services/router/*.py", "services/gateway/*.py", "tandem/kvblocks/*.py",
)
TORCH_FREE_EXCEPT = {"engine/kvcache/kv_pool.py"}   # the KV tensors themselves


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] != "tandem":
        parts = ("tandem", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top(mod: str) -> str:
    """The folder a module's file is in at the top of the tree: tandem.engine.x -> engine, tandem.cli -> cli."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for folder in (*FOLDERS, "tandem") for p in (ROOT / folder).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _import_nodes_in(child))
            continue
        yield from _import_nodes_in(node)


def _import_nodes_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _import_nodes(node)


def _with_parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__, a/b/__init__ and a/b/c."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@cache
def imports_of(mod: str) -> tuple[set[str], set[str]]:
    """(repo modules `mod` imports, the top-level names of the other modules it imports)."""
    path = modules()[mod]
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    internal: set[str] = set()
    external: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base for alias in node.names]
        for target in targets:
            found = [m for m in _with_parents(target) if m in modules()]
            if found:
                internal.update(found)
            else:
                external.add(target.split(".")[0])
    return internal - {mod}, external


def room(mod: str) -> str:
    """The node of the folder graph a module belongs to: each of engine's subfolders; the top-level
    engine modules (config, errors, outputs, sampling_params, hardware, forward_context: the words the
    rooms share) as one; the other packages whole. The one exception to "top level is one node" is
    engine/engine.py: LLMEngine is the composition root that wires tokenizer, scheduler, runner and
    speculator together, so it imports every room while the rooms import the shared top-level
    modules; counted with them it would make a cycle of every room. No other cycle is allowed."""
    parts = mod.split(".")[1:]   # below tandem.
    if not parts or parts[0] != "engine" or len(parts) == 1:
        return parts[0] if parts else "tandem"
    if (ROOT / "engine" / parts[1]).is_dir():
        return f"engine/{parts[1]}"
    return "engine/engine.py" if parts[1] == "engine" else "engine"


def layer_edges() -> set[tuple[str, str, str]]:
    """(importing module, imported module, imported module's top package) across the layers."""
    edges = set()
    for mod in modules():
        if top(mod) in LAYERS:
            deps = imports_of(mod)[0]
            # a.b.c stands for the a and a.b it runs too
            edges |= {(mod, d, top(d)) for d in deps if not any(o.startswith(d + ".") for o in deps)}
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def room_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """The rooms' import graph, and for each edge one import that makes it."""
    graph: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for mod in sorted(modules()):
        if top(mod) != "engine":
            continue
        src = room(mod)
        for dep in sorted(imports_of(mod)[0], reverse=True):   # the deepest module names the edge
            dst = room(dep)
            if dst.startswith("engine") and dst != src and dep not in ("tandem", "tandem.engine"):   # both __init__s are empty
                graph.setdefault(src, set()).add(dst)
                witness.setdefault((src, dst), f"{mod} imports {dep}")
    return graph, witness


def torch_path(mod: str) -> list[str] | None:
    """A chain of repo imports from `mod` to a module that imports torch, or None."""
    seen = {mod}
    todo = [[mod]]
    while todo:
        chain = todo.pop()
        internal, external = imports_of(chain[-1])
        if "torch" in external:
            return chain
        for dep in sorted(internal - seen):
            seen.add(dep)
            todo.append(chain + [dep])
    return None


def torch_free_modules() -> list[str]:
    paths = {p for pattern in TORCH_FREE for p in ROOT.glob(pattern)}
    return sorted(module_name(p) for p in paths if str(p.relative_to(ROOT)) not in TORCH_FREE_EXCEPT)


def test_the_tree_is_read():
    # The checks below mean something only if the walk finds the modules and their imports.
    assert {"tandem.engine.scheduler.scheduler", "tandem.engine.kvcache.kv_manager", "tandem.services.router.server"} <= set(modules())
    assert "tandem.engine.kvcache.page_allocator" in imports_of("tandem.engine.kvcache.kv_manager")[0]
    assert "torch" in imports_of("tandem.engine.kvcache.kv_pool")[1]
    assert len(torch_free_modules()) > 20


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_go_one_way(layer):
    bad = sorted(f"{mod} imports {dep}" for mod, dep, dep_top in layer_edges()
                 if top(mod) == layer and dep_top in FORBIDDEN[layer])
    assert not bad, f"{layer} must not import {sorted(FORBIDDEN[layer])}:\n" + "\n".join(bad)


def test_no_cycle_between_engine_rooms():
    graph, witness = room_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "engine's rooms import each other in a cycle: " + " -> ".join(cycle) + "\n" + "\n".join(
        witness[edge] for edge in pairwise(cycle))


@pytest.mark.parametrize("mod", torch_free_modules())
def test_torch_free(mod):
    chain = torch_path(mod)
    assert chain is None, f"{mod} reaches torch: " + " -> ".join(chain) + " -> torch"


def test_the_checks_catch_violations():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None
    assert room("tandem.engine.kvcache.kv_manager") == "engine/kvcache"
    assert room("tandem.engine.sampling_params") == "engine"
    assert room("tandem.engine.engine") == "engine/engine.py"


def test_one_import_namespace():
    """Nothing of Tandem's is imported by a top-level name of its folders (`engine`, `kernels`, ...): those
    names belong to other distributions (Hugging Face's `kernels`), and installed they do not exist."""
    sources = [*modules().values(), *(ROOT / "tests").rglob("*.py")]
    bad = []
    for path in sources:
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not getattr(node, "level", 0):
                bad += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in FOLDERS]
    assert not bad, "import these as tandem.<folder>...:\n" + "\n".join(bad)


def test_contract_rooms_import_only_the_standard_library():
    """tandem/kvblocks is what workers and the router both speak: it depends on neither (nor on anything
    installed), so either side can import it without the other's world."""
    bad = []
    for mod in modules():
        if mod.startswith("tandem.kvblocks"):
            internal, external = imports_of(mod)
            bad += [f"{mod} imports {d}" for d in internal if not d.startswith("tandem.kvblocks") and d != "tandem"]
            bad += [f"{mod} imports {e}" for e in external - set(sys.stdlib_module_names)]
    assert any(m.startswith("tandem.kvblocks.") for m in modules()) and not bad, bad
