"""Print the shape of the package's code: the largest modules, the longest functions, the
width policy's lines against the decoding core's, the share of docstring and comment lines
per module, and the import cycles between its modules (module-level and function-level
imports alike).

    python benchmarks/code_shape.py [--top 10] [--root DIR]

--root: another checkout (a commit to compare: `git worktree add DIR REV`). The test suite has
its own import-cycle check (tests/test_import_graph.py).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dflash2_mlx"
# what decides how wide to draft (dflash2_mlx/policy/), and what decodes (the subpackages
# decode/, model/ and cache/); then the flat modules of the versions before the subpackages,
# for --root at an older commit
POLICY = ("policy", "adaptive", "costs", "batch")
CORE = ("decode", "model", "cache",
        "engine", "sequence", "state", "stats", "batch_cache", "views", "drafter", "sampling",
        "lookup", "target", "kernels")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports, anywhere in the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name and not name.startswith(c + "."):
                found.add(c)
    return found


def import_graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    mods = modules() if mods is None else mods
    return {n: imports(n, p, set(mods)) for n, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.end_lineno - node.lineno + 1, node.name))
    return out


def prose_lines(path: Path) -> int:
    """Lines of docstrings and comments."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#") or "  # " in line:
            lines.add(i)
    return len(lines)


def part(name: str) -> str | None:
    top = name.split(".")[1] if "." in name else ""
    return "policy" if top in POLICY else "core" if top in CORE else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--root", type=Path, default=ROOT)
    args = ap.parse_args()
    mods = modules(args.root)
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in mods.items()), reverse=True)
    print(f"largest modules ({len(mods)} modules, {sum(s for s, _ in sizes)} lines):")
    for lines, name in sizes[: args.top]:
        print(f"  {lines:5d}  {name}")
    funcs = sorted(((n, f"{m}.{f}") for m, p in mods.items() for n, f in functions(p)),
                   reverse=True)
    print("longest functions:")
    for lines, name in funcs[: args.top]:
        print(f"  {lines:5d}  {name}")
    lines = {n: len(p.read_text().splitlines()) for n, p in mods.items()}
    for what in ("policy", "core"):
        names = [n for n in mods if part(n) == what]
        print(f"{what}: {sum(lines[n] for n in names)} lines in {len(names)} modules")
    share = sorted(((prose_lines(p) / max(lines[n], 1), n) for n, p in mods.items()
                    if lines[n] >= 100), reverse=True)
    print("docstring and comment share (modules of 100 lines or more):")
    for r, name in share[: args.top]:
        print(f"  {100 * r:4.0f}%  {name}")
    found = cycles(import_graph(mods))
    print(f"import cycles: {len(found) or 'none'}")
    for comp in found:
        print("  " + " <-> ".join(comp))


if __name__ == "__main__":
    main()
