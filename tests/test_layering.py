"""The tree's import rules, read from the source with ast: no import circles, no import from a
lower layer to a higher one, the router apart, and the HTTP front free of torch. And the map:
every module is named on docs/ARCHITECTURE.md.

Layers, low to high (a module may import its own layer and the ones below):
kernels < shared definitions (serving.config, serving.protocol, serving.sampling_params,
serving.forward_batch, serving.server_args with server_args_checks and cli_flags,
serving.distributed) < memory <
layers < models < executor < speculative < engine < workers < front < launch_server < tools <
training and bench. training and bench are one layer: the evaluation measures EAGLE with
bench.spec, and bench.spec draws its prompts from training.distill_nextn. bench may import the
router too; the router imports only itself, so nothing that ships (serving, workers, kernels,
router) imports training or bench. Imports under `if TYPE_CHECKING:` are types only: they do not
count for the layers, but they do for circles (a circle of types is still two modules that
cannot be understood, or split, apart).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("serving", "workers", "kernels", "router", "training", "bench")
LAYERS = [
    ("kernels",),
    (
        "serving.config",
        "serving.protocol",
        "serving.sampling_params",
        "serving.forward_batch",
        "serving.server_args",
        "serving.server_args_checks",
        "serving.cli_flags",
        "serving.distributed",
    ),
    ("serving.memory",),
    ("serving.layers",),
    ("serving.models",),
    ("serving.executor",),
    ("serving.speculative",),
    ("serving.engine",),
    ("workers",),
    ("serving.front",),
    ("serving.launch_server",),
    ("serving.tools",),
    ("training", "bench"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, types: bool = False) -> set[str]:
    """Every module of ours that `path` imports at run time (module level or in a function);
    with `types`, the imports under `if TYPE_CHECKING:` too."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not types:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from serving.engine import scheduler` imports the module serving.engine.scheduler
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    ours = set()
    for name in found:
        if name.split(".")[0] in PACKAGES:
            # the longest prefix that is a module or package of the tree
            parts = name.split(".")
            while parts and not _exists(parts):
                parts.pop()
            if parts:
                ours.add(".".join(parts))
    ours.discard(module)
    return ours


def _exists(parts: list[str]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def graph(types: bool = False) -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return {module_name(p): imports_of(p, types) for p in files}


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    upward = []
    for module, deps in graph().items():
        if module.startswith("router") or (module in PACKAGES and not deps):
            continue  # a bare top-level package __init__ has no layer
        mine = layer_of(module)
        assert mine is not None, f"{module} is in no layer: add it to LAYERS"
        for dep in deps:
            theirs = layer_of(dep)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} imports {dep}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def test_kernels_and_router_import_nothing_of_the_rest() -> None:
    bad = [
        f"{module} imports {dep}"
        for module, deps in graph().items()
        for dep in deps
        if (module.startswith("kernels") and not dep.startswith("kernels"))
        or (module.startswith("router") and not dep.startswith("router"))
    ]
    assert not bad, "\n".join(sorted(bad))


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_no_import_circles_types_included() -> None:
    circle = find_circle(graph(types=True))
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_checker_sees_a_circle_of_types_only() -> None:
    """An import under TYPE_CHECKING is an edge of the circle check (not of the layer check),
    and a circle closed by such an edge is found."""
    source = (
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n"
        "    from serving.memory.pool import MemoryPool\n"
    )
    fake = ROOT / "serving" / "memory" / "_circle_probe.py"
    fake.write_text(source)
    try:
        assert "serving.memory.pool" in imports_of(fake, types=True)
        assert "serving.memory.pool" not in imports_of(fake)
    finally:
        fake.unlink()
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(edges) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_the_front_never_imports_torch() -> None:
    code = (
        "import sys, serving.front.http_server, serving.front.engine_client; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rules above must be able to fail: a memory module importing a model is caught."""
    source = "from serving.models.glm5_next import Glm5NextForCausalLM\n"
    fake = ROOT / "serving" / "memory" / "_layering_probe.py"
    fake.write_text(source)
    try:
        deps = imports_of(fake)
        assert "serving.models.glm5_next" in deps
        assert layer_of("serving.models.glm5_next") > layer_of(module_name(fake))
    finally:
        fake.unlink()


def test_every_module_is_on_the_map() -> None:
    """docs/ARCHITECTURE.md is the repository's map: a module it does not name is one a
    newcomer cannot find from it."""
    names = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__init__.py" and not re.search(rf"\b{path.stem}\b", names)
    ]
    assert not missing, f"modules docs/ARCHITECTURE.md does not name: {missing}"
