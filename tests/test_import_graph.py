"""The package's modules import one another without cycles, function-level imports included.
The graph is read from the sources with `ast` (nothing is imported): every `import` and `from
... import` anywhere in a module, relative or absolute, that names a module of the package
(a module's own parent packages left out: they are initialised before it runs)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names(package: Path, prefix: str | None = None) -> dict[str, Path]:
    """name -> file of every module under `package` (a package is its __init__.py); prefix:
    the dotted name the folder is installed as (default: its own name)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        parts = tuple((prefix or package.name).split(".")) + parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports, at any depth of its code."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg and, where it is one, the module pkg.mod
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:       # `import a.b.c` names a.b.c's module
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph(package: Path, mapped: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """mapped: folders installed under another name (pyproject's package-dir)."""
    modules = module_names(package)
    for prefix, folder in (mapped or {}).items():
        modules.update(module_names(folder, prefix))
    return {name: imported(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    graph = import_graph(ROOT / "dflash2_mlx",
                         {"dflash2_mlx.model.kernels": ROOT / "metal_kernels"})
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100     # it read the package
    assert "dflash2_mlx.model.kernels.ops" in graph["dflash2_mlx.model.kernels.metal"]
    assert cycles(graph) == [], "import cycles between the package's modules"


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "import os\nfrom . import b\n\ndef f():\n    from .sub.c import g\n",
        "b.py": "from pkg.sub import d\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.b\nfrom .. import a\n",
        "sub/d.py": "from ..a import f\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub.c"}             # the last one in a function
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.d"}
    assert graph["pkg.sub"] == set()
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.b"}
    assert graph["pkg.sub.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]]


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
