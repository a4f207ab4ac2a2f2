"""Use oMLX's per-model settings (`model_settings.json`) to configure dflash2-mlx.

    python examples/omlx_settings.py --settings ~/.omlx/model_settings.json --model-id ID
    python examples/omlx_settings.py        # writes a sample file for the embedded default

Without --settings it writes a small sample file into a temporary folder (the format oMLX
uses), then reads it back exactly as it would read oMLX's own.

test-args: --model {llama} --draft {dflash2}
"""

import argparse
import json
import tempfile
from pathlib import Path

import dflash2_mlx


def sample_file(folder: Path, model_id: str, draft: str | None) -> Path:
    entry = {"dflash_enabled": True, "dflash_block_size": 4, "dflash_verify_mode": "dflash",
             "dflash_draft_quant_enabled": False, "dflash_max_ctx": 4096}
    if draft:
        entry["dflash_draft_model"] = draft
    path = folder / "model_settings.json"
    path.write_text(json.dumps({"version": 1, "models": {model_id: entry}}, indent=2))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", help="model_settings.json, or the folder holding it")
    parser.add_argument("--model-id", help="the entry to use (default: --model)")
    parser.add_argument("--model", help="target (default: the embedded default)")
    parser.add_argument("--draft", help="drafter when the entry names none")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    model_id = args.model_id or args.model or "SmolLM2-135M-Instruct"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.settings or sample_file(Path(tmp), model_id, args.draft)
        # Unknown keys are ignored; a bad value raises OmlxSettingsError naming key and file.
        settings = dflash2_mlx.load_omlx_settings(path, model_id=model_id)
        print(f"{settings.source}: {model_id}: drafting={settings.drafting}, "
              f"block_size={settings.block_size}, verify_mode={settings.verify_mode}")
        # Explicit arguments to load() win over the file; the file wins over the defaults.
        pipe = dflash2_mlx.load(args.model, args.draft, settings=settings)
        gen = pipe.generate("def add(a, b):", max_tokens=args.max_tokens)
        print(gen.text)
        print(f"[block size {pipe.block_size(None)}, tau {gen.stats.tau:.2f}]")


if __name__ == "__main__":
    main()
