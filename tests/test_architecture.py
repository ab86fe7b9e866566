"""The module map stays what the README says: imports point down the layers, no cycles, short functions.

Lazy imports inside functions count: hiding a cycle in a function body is still a cycle.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "visppo"

LAYERS = [
    {"errors", "atomic"},  # leaves: nothing of visppo
    {"config", "memory", "metrics", "buffer", "seeding", "extras", "env_check",
     "env_process"},  # leaves: nothing of visppo but config
    {"precision", "distributed", "envs", "checkpoint", "video"},
    {"encoders"},
    {"policy"},
    {"builders", "rollout"},
    {"ppo"},
    {"evaluate", "probe", "bench", "plot", "health"},
    {"loop", "deploy", "export"},
    {"cli", "__main__", "__init__", "api"},
]
"""Bottom to top, as in the README's architecture section: a module imports only from lower
layers (or its own layer's leaves below it, checked as a graph without cycles)."""

MAX_FUNCTION_LINES = 60


def _imports(path: Path) -> set[str]:
    """The visppo modules ``path`` imports, at the top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "visppo":
                found |= {a.name for a in node.names}
            elif node.module.startswith("visppo."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("visppo.")}
    return found - {path.stem}


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}


def test_every_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert set(_graph()) == placed, "add new modules to LAYERS and to the README's module map"


def test_imports_only_point_down_the_layers():
    layer = {m: i for i, group in enumerate(LAYERS) for m in group}
    upward = [(m, d) for m, deps in _graph().items() for d in deps if layer[d] > layer[m]]
    assert not upward, f"imports that point up the module map: {upward}"


def test_the_import_graph_has_no_cycle():
    graph, done, active = _graph(), set(), []

    def visit(module: str) -> None:
        if module in active:
            raise AssertionError(f"import cycle: {' -> '.join(active[active.index(module):] + [module])}")
        if module in done:
            return
        active.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        active.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_each_module_imports_on_its_own():
    """In a fresh interpreter, each module imports with no other visppo module loaded first."""
    modules = sorted(m for m in _graph() if m not in ("__main__",))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    for k in [k for k in sys.modules if k == 'visppo' or k.startswith('visppo.')]:\n"
            "        del sys.modules[k]\n"
            "    importlib.import_module('visppo.' + m if m != '__init__' else 'visppo')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_training_loop_fits_one_screen():
    """``train()`` is the loop a reader follows top to bottom: about 15 lines per iteration."""
    tree = ast.parse((PACKAGE / "loop.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    loop = next(n for n in ast.walk(train) if isinstance(n, ast.For))
    assert loop.end_lineno - loop.lineno + 1 <= 25
