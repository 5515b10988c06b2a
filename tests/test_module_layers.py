"""The package's imports run one way: no import cycle between its modules (imports inside
functions counted), and the model layer (``models/``, ``layers/``, ``attention/``) imports
nothing of the backends, tensor parallelism's launcher, the engine or the server. Read from
the source, as a reviewer would."""

from __future__ import annotations

import ast
from pathlib import Path

import iron_batch

PACKAGE = Path(iron_batch.__file__).parent
MODEL_LAYER = ("iron_batch.models", "iron_batch.layers", "iron_batch.attention")
ABOVE_IT = ("iron_batch.backends", "iron_batch.parallel", "iron_batch.engine",
            "iron_batch.server")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its body. ``from P import
    X`` imports module P.X when X is one, else P itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules or a.name == "_core" else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_is_read_from_every_module() -> None:
    graph = _graph()
    assert "iron_batch.models.decoder" in graph and "iron_batch.server.app" in graph
    assert "iron_batch.layers.linear" in graph["iron_batch.models.decoder"]


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    # Depth-first search for a back edge; report the cycle's path.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_model_layer_imports_nothing_above_it() -> None:
    wrong = sorted(
        f"{name} -> {dep}"
        for name, deps in _graph().items() if name.startswith(MODEL_LAYER)
        for dep in deps if dep.startswith(ABOVE_IT)
    )
    assert wrong == []
