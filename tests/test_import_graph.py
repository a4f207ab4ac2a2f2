"""The package's modules import one another without cycles, and every import runs down the
layers of docs/api.md ("Where the code is"), function-level imports included. The graph is
read from the sources with `ast` (nothing is imported): every `import` and `from ... import`
anywhere in a module, relative or absolute, that names a module of the package (a module's own
parent packages left out: they are initialised before it runs).

`python tests/test_import_graph.py` prints the imports between folders (and the root modules):
how many modules of one import the other, and the pairs that import each other."""

import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"dflash2_mlx.model.kernels": ROOT / "metal_kernels"}     # pyproject's package-dir


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
    return {target for target, _ in imports(name, path, known)}


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module, line) of every import of one of the package's modules in module `name`."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
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
                found.append((target, node.lineno))
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
    graph = import_graph(ROOT / "dflash2_mlx", MAPPED)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100     # it read the package
    assert "dflash2_mlx.model.kernels.ops" in graph["dflash2_mlx.model.kernels.metal"]
    assert cycles(graph) == [], "import cycles between the package's modules"


def write_package(pkg: Path, files: dict[str, str]) -> Path:
    """A package of these files (path -> text) at `pkg`, its folders made."""
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = write_package(tmp_path / "pkg", {
        "__init__.py": "from .a import f\n",
        "a.py": "import os\nfrom . import b\n\ndef f():\n    from .sub.c import g\n",
        "b.py": "from pkg.sub import d\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.b\nfrom .. import a\n",
        "sub/d.py": "from ..a import f\n",
    })
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


# ---------------------------------------------------------------- layers

def layers(api_md: str) -> list[list[str]]:
    """The layers of docs/api.md's "Where the code is" table, bottom first: each a list of the
    dotted names of its folders and modules (`metal_kernels/` is installed inside model/)."""
    section = re.search(r"^## Where the code is\n(.*?)(?=^## |\Z)", api_md, re.M | re.S)
    assert section, "docs/api.md has no section 'Where the code is'"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")][2:]
    out = []
    for row in rows:
        paths = re.findall(r"`dflash2_mlx/([a-z_/]+?)(?:/|\.py)?`", row.split("|")[2])
        out.append(["dflash2_mlx." + p.replace("/", ".") for p in paths])
    return out


def unit(module: str, units: list[str]) -> str | None:
    """The folder or root module of the layer table that holds `module` (None: the package's
    own __init__, above every layer)."""
    found = [u for u in units if module == u or module.startswith(u + ".")]
    return max(found, key=len) if found else None


def upward_imports(package: Path, table: list[list[str]],
                   mapped: dict[str, Path] | None = None, root: Path = ROOT) -> list[str]:
    """One line per import that runs up the layers or sideways to a sibling of the same layer:
    'file:line: folder (layer n) imports folder (layer m)'. A module outside every layer is
    itself an error."""
    modules = module_names(package)
    for prefix, folder in (mapped or {}).items():
        modules.update(module_names(folder, prefix))
    units = [u for layer in table for u in layer]
    level = {u: i + 1 for i, layer in enumerate(table) for u in layer}
    problems = []
    for name, path in sorted(modules.items()):
        here = unit(name, units)
        if here is None:
            if name != package.name:
                problems.append(f"{path.relative_to(root)}: in no layer of the table")
            continue
        for target, line in imports(name, path, set(modules)):
            there = unit(target, units)
            if there is None or there == here or level[there] < level[here]:
                continue
            how = "up to" if level[there] > level[here] else "sideways to"
            problem = (f"{path.relative_to(root)}:{line}: {here} (layer {level[here]}) "
                       f"imports {how} {there} (layer {level[there]})")
            if problem not in problems:          # `from pkg import mod` names pkg and pkg.mod
                problems.append(problem)
    return problems


def test_every_import_runs_down_the_layers():
    table = layers((ROOT / "docs" / "api.md").read_text())
    assert len(table) >= 8 and ["dflash2_mlx.pipeline"] in table     # it read the table
    problems = upward_imports(ROOT / "dflash2_mlx", table, MAPPED)
    assert problems == [], "imports against docs/api.md's layers:\n" + "\n".join(problems)


def test_an_upward_or_sideways_import_is_named_with_its_file_and_line(tmp_path):
    """The check fails where it should: a lower layer importing a higher one, at module level or
    in a function, and one sibling importing another; a module in no layer."""
    pkg = write_package(tmp_path / "pkg", {
        **{f"{folder}/__init__.py": "" for folder in ("low", "mid", "side", "top")},
        "__init__.py": "",
        "base.py": "import os\n",
        "low/a.py": "from .. import base\n\ndef f():\n    from ..top import t\n",
        "mid/m.py": "from ..low import a\nfrom ..side import s\n",
        "side/s.py": "from pkg.low.a import f\n",
        "top/t.py": "from ..mid import m\nfrom pkg import base\n",
        "stray.py": "",
    })
    table = [["pkg.base"], ["pkg.low"], ["pkg.mid", "pkg.side"], ["pkg.top"]]
    assert upward_imports(pkg, table, root=tmp_path) == [
        "pkg/low/a.py:4: pkg.low (layer 2) imports up to pkg.top (layer 4)",
        "pkg/mid/m.py:2: pkg.mid (layer 3) imports sideways to pkg.side (layer 3)",
        "pkg/stray.py: in no layer of the table"]
    api_md = ("## Where the code is\n\n| layer | paths | jobs |\n|---|---|---|\n"
              "| 1 | `dflash2_mlx/log.py`, `dflash2_mlx/files.py` | x |\n"
              "| 2 | `dflash2_mlx/model/`, `metal_kernels/` | y |\n\n## Next\n| a | b |\n")
    assert layers(api_md) == [["dflash2_mlx.log", "dflash2_mlx.files"], ["dflash2_mlx.model"]]


MAX_LINES = 600         # a module past this holds more than one job: split it where its parts are


def test_no_module_is_over_600_lines():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines())
             for folder in (ROOT / "dflash2_mlx", ROOT / "metal_kernels")
             for p in folder.rglob("*.py")}
    assert len(sizes) > 50
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def folder_imports(package: Path = ROOT / "dflash2_mlx") -> Counter:
    """(importing folder, imported folder) -> how many modules of the first import the second;
    root modules count as folders of their own."""
    graph = import_graph(package, MAPPED)

    def folder(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    return Counter((folder(a), folder(b)) for a, targets in graph.items() for b in targets
                   if folder(a) != folder(b))


if __name__ == "__main__":
    counts = folder_imports()
    width = max(len(a) for a, _ in counts)
    for (a, b), n in sorted(counts.items()):
        print(f"{a:>{width}} -> {b:<12} {n}")
    both = sorted({tuple(sorted(k)) for k in counts if k[::-1] in counts})
    print(f"pairs that import each other: {len(both)}" +
          "".join(f"\n  {a} <-> {b}" for a, b in both))
    sys.exit(0)
