"""The repository's shape: who may import whom, no import cycles, and docs that stand alone.

The import graph is read from the source with ``ast`` (every ``import`` statement, at module
level or inside a function, so a deferred import that closes a circle is caught too; only
``if TYPE_CHECKING:`` blocks, which never run, are left out); nothing is imported. Documents
are read from ``git ls-files``, so a clone is checked as it is.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("warsha", "tokenizer_ext", "context_ext", "distill", "quantize", "serve")
STAGE_PACKAGES = ("tokenizer_ext", "context_ext", "distill", "quantize")
TRAINING_STACK = ("transformers", "peft", "deepspeed", "bitsandbytes", "accelerate", "warsha")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``name`` imports, resolved to the most specific known module."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: {m for m in _imports(path, name, known) if m in known and m != name} for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_stage_packages_never_import_each_other() -> None:
    for name, deps in _graph().items():
        top = name.split(".")[0]
        if top in STAGE_PACKAGES:
            other = {d for d in deps if d.split(".")[0] in STAGE_PACKAGES and d.split(".")[0] != top}
            assert not other, f"{name} imports another stage package: {sorted(other)}"


def test_serve_stands_alone() -> None:
    """serve imports neither the core nor the training stack, so it deploys alone."""
    for path in (ROOT / "serve").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad = [n for n in names if n.split(".")[0] in TRAINING_STACK]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split() if (ROOT / f).suffix in {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ""}]


# Built from parts so that this file does not match itself.
_OUTSIDE = re.compile(r"\.\./" + "shared" + r"|\b(" + "DESIGN|STACK|DATA|ANCHORS" + r")\.md\b")


def test_documents_stand_alone() -> None:
    """No file points at notes outside the repository (a clone has none of them)."""
    held = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    problems = []
    for path in _tracked_text_files():
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in _OUTSIDE.finditer(line):
                if m.group(0).startswith("../") or m.group(0) not in held:
                    problems.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)}")
    assert problems == [], "references to documents the repository does not hold:\n" + "\n".join(problems)
