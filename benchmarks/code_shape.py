"""Print the shape of the package's code: the largest modules, the longest functions and the
import cycles between its modules (module-level and function-level imports alike).

    python benchmarks/code_shape.py [--top 10]

tests/test_import_graph.py loads this file for `import_graph` and `cycles` (one copy).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dflash2_mlx"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    mods = modules()
    sizes = sorted(((len(p.read_text().splitlines()), n) for n, p in mods.items()), reverse=True)
    print(f"largest modules ({len(mods)} modules, {sum(s for s, _ in sizes)} lines):")
    for lines, name in sizes[: args.top]:
        print(f"  {lines:5d}  {name}")
    funcs = sorted(((n, f"{m}.{f}") for m, p in mods.items() for n, f in functions(p)),
                   reverse=True)
    print("longest functions:")
    for lines, name in funcs[: args.top]:
        print(f"  {lines:5d}  {name}")
    found = cycles(import_graph(mods))
    print(f"import cycles: {len(found) or 'none'}")
    for comp in found:
        print("  " + " <-> ".join(comp))


if __name__ == "__main__":
    main()
