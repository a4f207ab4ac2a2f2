"""The whole recipe as one resumable run: prompts -> target responses with features -> training
-> export. Every stage leaves its results in the run folder and is skipped when they are there:

  <run>/prompts.jsonl        the prompts (source, text)
  <run>/data/                FeatureStore: greedy shards g*, sampled shards s*
  <run>/ckpt/step_*/         training checkpoints (the newest is resumed)
  <run>/drafter/             the exported drafter (published layout)
  <run>/recipe.json          the settings of the run
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from .. import log
from ..files import atomic_write
from .config import Recipe

LOG = log.get(__name__)


def load_target_for_training(model: str | None):
    """(target model, tokenizer, model path): the target in float32 (on the fast BLAS, as
    `load()` puts it)."""
    from ..loading.blas import use_fast_blas

    use_fast_blas()
    import mlx.core as mx

    from ..loading.checkpoint import load_target

    if model is None:
        from ..loading.assets import smollm2_gguf

        model = str(smollm2_gguf())
    target, tokenizer, path = load_target(model, mx.float32)
    return target, tokenizer, str(path)


def copy_layers_for(recipe: Recipe, num_layers: int) -> list[int] | None:
    """The target layers the drafter's layers start from, one each (None: random init)."""
    if not recipe.init_from_target:
        return None
    depth = recipe.drafter.layers
    if recipe.init_layers is None:
        return list(range(num_layers - depth, num_layers))
    layers = list(recipe.init_layers)
    if len(layers) != depth or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"--init-layers {','.join(map(str, layers))}: expected {depth} "
                         f"target layer(s) (one per drafter layer) in 0..{num_layers - 1}")
    return layers


def drafter_to_continue(folder: str, args, adapter):
    """A published drafter folder's weights (dequantized to float32) as the starting point of
    a run: fine-tuning the shipped drafter on new data. Its shape must be the recipe's."""
    import mlx.core as mx

    from ..loading.checkpoint import load_drafter

    drafter = load_drafter(folder, hidden_size=adapter.hidden_size, vocab_size=adapter.vocab_size,
                           num_layers=adapter.num_layers, dtype=mx.float32)
    have, want = _flat(drafter.args.to_config()), _flat(args.to_config())
    differ = [f"{k} {have.get(k)} (the recipe's {want.get(k)})"
              for k in sorted(have.keys() | want.keys()) if have.get(k) != want.get(k)]
    if differ:
        raise ValueError(f"--init-from {folder}: its config.json differs from this run's drafter "
                         f"flags: {'; '.join(differ)}")
    drafter.train()
    return drafter


def _flat(config: dict) -> dict:
    out = {k: v for k, v in config.items() if k not in ("dflash_config", "quantization")}
    out.update(config.get("dflash_config", {}))
    return out


def run_recipe(recipe: Recipe) -> Path:
    """Run (or continue) every stage up to `recipe.stop_after`; -> the export folder (or the
    run folder when stopping earlier). Progress and one line per stage go to the package's
    logger (`dflash2_mlx.log.setup()` prints them)."""
    import mlx.core as mx

    from ..model.target import TargetAdapter
    from . import data as D
    from .init import drafter_args_for, init_drafter
    from .trainer import latest_checkpoint, load_checkpoint, train

    run, seed = Path(recipe.run), recipe.train.seed
    store = D.FeatureStore(*recipe.data) if recipe.data else None   # fails before run/ exists
    run.mkdir(parents=True, exist_ok=True)
    with atomic_write(run / "recipe.json") as f:
        f.write(json.dumps(asdict(recipe), indent=1) + "\n")
    t_start = time.perf_counter()
    target, tokenizer, model_path = load_target_for_training(recipe.model)
    plain = TargetAdapter(target)
    copy_layers = copy_layers_for(recipe, plain.num_layers)
    capture = recipe.capture_layers
    if capture is None:
        capture = sorted(set(recipe.drafter.target_layer_ids)
                         | ({copy_layers[0] - 1} if copy_layers else set()))

    # ---- data
    if store is None:
        store = _generate_data(recipe, target, capture, tokenizer, model_path)
    LOG.info(f"data: {store.stats()} in {', '.join(str(f) for f in store.folders)}")
    if recipe.stop_after == "data":
        return run

    # ---- train
    args = drafter_args_for(plain, recipe.drafter)
    if recipe.heads is not None:           # a head on the --init-from drafter, nothing else
        from .heads import train_confidence

        if recipe.init_from is None:
            raise ValueError("--heads confidence trains a head of a trained drafter: give it "
                             "with --init-from DRAFTER")
        drafter = drafter_to_continue(recipe.init_from, args, plain)
        drafter.freeze()
        train_confidence(drafter, plain, store, run, D.dedupe(store), seed=seed)
        if recipe.stop_after == "train":
            return run
        return _export(recipe, drafter, run, t_start)
    drafter = (init_drafter(args, plain, copy_layers, seed=seed)
               if recipe.init_from is None else drafter_to_continue(recipe.init_from, args, plain))
    train(drafter, plain, store, run, recipe.train, D.dedupe(store))
    ckpt = latest_checkpoint(run)
    done, steps = load_checkpoint(ckpt, drafter, None)["step"], recipe.train.steps
    LOG.info(f"training at step {done}/{steps} ({ckpt})"
             + ("" if done == steps else "; run the same command again to continue"))
    if recipe.stop_after == "train":
        return run

    return _export(recipe, drafter, run, t_start)


def _export(recipe: Recipe, drafter, run: Path, t_start: float) -> Path:
    """The export stage -> the drafter's folder (`--out`, default <run>/drafter)."""
    import mlx.core as mx

    from .export import export_drafter, folder_megabytes

    out = Path(recipe.out or run / "drafter")
    export_drafter(drafter, out, bits=recipe.bits)
    LOG.info(f"exported {out} ({folder_megabytes(out):.1f} MB) after "
             f"{(time.perf_counter() - t_start) / 60:.1f} min in this session")
    mx.clear_cache()
    return out


def _generate_data(recipe: Recipe, target, capture: list[int], tokenizer, model_path: str):
    """The data stage: the prompts (`<run>/prompts.jsonl`), then the target's greedy answers
    to all of them and sampled ones to `recipe.sampled_fraction` of them, with the features
    of the `capture` layers -> the new `FeatureStore` in `<run>/data`."""
    from ..model.target import TargetAdapter
    from . import data as D

    adapter = TargetAdapter(target, tuple(capture))
    run, seed = Path(recipe.run), recipe.train.seed
    stop_ids = set(tokenizer.eos_token_ids)
    gcfg = D.GenConfig(max_new_tokens=recipe.max_new_tokens, batch_size=recipe.gen_batch,
                       seed=seed)
    rows = D.build_prompts(run / "prompts.jsonl", recipe.counts, adapter, tokenizer, gcfg,
                           stop_ids, seed=seed, exclude=recipe.exclude_prompts)
    ids = D.encode_prompts(tokenizer, rows, recipe.max_prompt_tokens)
    LOG.info(f"prompts: {len(rows)} ({_by_source(rows)}); {len(ids)} within "
             f"{recipe.max_prompt_tokens} tokens")
    store = D.FeatureStore.create(run / "data", capture, adapter.hidden_size, gcfg.topk,
                                  adapter.vocab_size, {"model": model_path})
    D.generate_store(adapter, ids, store, gcfg, stop_ids, "g", desc="greedy")
    if recipe.sampled_fraction > 0:
        step = max(1, round(1 / recipe.sampled_fraction))
        scfg = D.GenConfig(max_new_tokens=recipe.max_new_tokens, temperature=1.0,
                           batch_size=recipe.gen_batch, seed=seed + 1)
        D.generate_store(adapter, ids[::step], store, scfg, stop_ids, "s", desc="sampled")
    return store


def _by_source(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
