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
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_COUNTS = {"stdlib_function": 400, "stdlib_task": 150, "pydoc_topic": 40, "self_chat": 32,
                  "doctest_function": 200, "package_function": 100}
# The layers `generate` captures by default: a superset, so that drafters picking different
# target_layer_ids (or copying different target layers) train on the same data.
SMOLLM2_CAPTURE = (1, 4, 8, 11, 15, 18, 22, 25, 26, 27, 28, 29)
SMOLLM2_MASK_ID = 16     # <empty_output>, a special token SmolLM2's chat never produces


@dataclass
class Recipe:
    run: str
    model: str | None = None                 # target; None: the embedded SmolLM2-135M-Instruct
    data: tuple | str | None = None          # existing FeatureStore(s) instead of <run>/data
    out: str | None = None                   # export folder (default <run>/drafter)
    # data
    counts: dict = field(default_factory=lambda: dict(DEFAULT_COUNTS))
    exclude_prompts: tuple = ()              # prompts.jsonl of earlier runs: not drawn again
    sampled_fraction: float = 0.25           # prompts also answered by sampling at T = 1
    max_prompt_tokens: int = 320
    max_new_tokens: int = 160
    gen_batch: int = 64                      # measured: 117 new tok/s against 85 at 16
    capture_layers: tuple | None = None      # None: target_layer_ids + copied layers' inputs
    # drafter
    layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple = (1, 8, 15, 22, 27)
    mask_token_id: int | None = None
    conv: bool = True
    selector: bool = True
    selector_rank: int = 128
    init_from_target: bool = True
    init_layers: tuple | None = None         # target layers copied; None: the last `layers`
    init_from: str | None = None             # a drafter folder to continue from (same shape)
    # training (see trainer.TrainConfig)
    steps: int = 1500
    lr: float = 1e-3
    seqs: int = 4
    anchors: int = 64
    gamma: float | None = None
    soft: float = 0.5
    copy_weight: float = 0.0                 # extra loss weight of rows a lookup would copy
    ckpt_every: int = 100
    snapshot_every: int = 0
    max_minutes: float | None = None         # training wall-time limit for this session
    seed: int = 0
    # export
    bits: int | None = None
    stop_after: str = "export"               # "data" | "train" | "export"

    def __post_init__(self):
        # paths may come as Path objects from Python callers; recipe.json needs strings
        self.run = str(self.run)
        for name in ("model", "out", "init_from"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        if self.data is not None:
            data = (self.data,) if isinstance(self.data, (str, Path)) else self.data
            self.data = tuple(str(d) for d in data)
        self.exclude_prompts = tuple(str(p) for p in self.exclude_prompts)


def _progress(desc: str):
    from tqdm import tqdm

    def wrap(it, **kw):
        return tqdm(it, desc=desc, mininterval=2.0, dynamic_ncols=True, file=sys.stderr, **kw)
    return wrap


def load_target_for_training(model: str | None):
    """(target model, tokenizer, model path): the target in float32."""
    import mlx.core as mx

    from ..loading import load_target

    if model is None:
        from ..assets import smollm2_gguf

        model = str(smollm2_gguf())
    target, tokenizer, path = load_target(model, mx.float32)
    return target, tokenizer, str(path)


def copy_layers_for(recipe: Recipe, num_layers: int) -> list[int] | None:
    if not recipe.init_from_target:
        return None
    if recipe.init_layers is None:
        return list(range(num_layers - recipe.layers, num_layers))
    layers = [int(i) for i in recipe.init_layers]
    if len(layers) != recipe.layers or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"--init-layers {','.join(map(str, layers))}: expected {recipe.layers} "
                         f"target layer(s) (one per drafter layer) in 0..{num_layers - 1}")
    return layers


def drafter_to_continue(folder: str, args, adapter):
    """A published drafter folder's weights (dequantized to float32) as the starting point of
    a run: fine-tuning the shipped drafter on new data. Its shape must be the recipe's."""
    import mlx.core as mx

    from ..loading import load_drafter

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


def run_recipe(recipe: Recipe, log=print) -> Path:
    """Run (or continue) every stage up to `recipe.stop_after`; -> the export folder (or the
    run folder when stopping earlier)."""
    import mlx.core as mx

    from ..target import TargetAdapter
    from . import data as D
    from .export import export_drafter, folder_megabytes
    from .init import drafter_args_for, init_drafter
    from .trainer import TrainConfig, latest_checkpoint, load_checkpoint, train

    run = Path(recipe.run)
    store = D.FeatureStore(*recipe.data) if recipe.data else None   # fails before run/ exists
    run.mkdir(parents=True, exist_ok=True)
    (run / "recipe.json").write_text(json.dumps(asdict(recipe), indent=1) + "\n")
    t_start = time.perf_counter()
    target, tokenizer, model_path = load_target_for_training(recipe.model)
    plain = TargetAdapter(target)
    copy_layers = copy_layers_for(recipe, plain.num_layers)
    capture = recipe.capture_layers
    if capture is None:
        capture = sorted(set(recipe.target_layer_ids)
                         | ({copy_layers[0] - 1} if copy_layers else set()))
    mask_id = recipe.mask_token_id
    if mask_id is None:
        mask_id = SMOLLM2_MASK_ID if plain.vocab_size == 49152 else plain.vocab_size - 1
    stop_ids = set(tokenizer.eos_token_ids)

    # ---- data
    if store is None:
        adapter = TargetAdapter(target, tuple(capture))
        gcfg = D.GenConfig(max_new_tokens=recipe.max_new_tokens, batch_size=recipe.gen_batch,
                           seed=recipe.seed)
        rows = D.build_prompts(run / "prompts.jsonl", recipe.counts, adapter, tokenizer, gcfg,
                               stop_ids, seed=recipe.seed, exclude=recipe.exclude_prompts)
        ids = D.encode_prompts(tokenizer, rows, recipe.max_prompt_tokens)
        log(f"prompts: {len(rows)} ({_by_source(rows)}); {len(ids)} within "
            f"{recipe.max_prompt_tokens} tokens")
        store = D.FeatureStore.create(run / "data", capture, adapter.hidden_size, gcfg.topk,
                                      adapter.vocab_size, {"model": model_path})
        D.generate_store(adapter, ids, store, gcfg, stop_ids, "g", _progress("greedy"))
        if recipe.sampled_fraction > 0:
            step = max(1, round(1 / recipe.sampled_fraction))
            scfg = D.GenConfig(max_new_tokens=recipe.max_new_tokens, temperature=1.0,
                               batch_size=recipe.gen_batch, seed=recipe.seed + 1)
            D.generate_store(adapter, ids[::step], store, scfg, stop_ids, "s",
                             _progress("sampled"))
    log(f"data: {store.stats()} in {', '.join(str(f) for f in store.folders)}")
    if recipe.stop_after == "data":
        return run

    # ---- train
    args = drafter_args_for(plain, layers=recipe.layers, block_size=recipe.block_size,
                            target_layer_ids=recipe.target_layer_ids, mask_token_id=mask_id,
                            conv=recipe.conv, selector=recipe.selector,
                            selector_rank=recipe.selector_rank)
    drafter = (init_drafter(args, plain, copy_layers, seed=recipe.seed)
               if recipe.init_from is None else drafter_to_continue(recipe.init_from, args, plain))
    cfg = TrainConfig(steps=recipe.steps, lr=recipe.lr, seqs=recipe.seqs, anchors=recipe.anchors,
                      gamma=recipe.gamma, soft=recipe.soft, copy_weight=recipe.copy_weight,
                      ckpt_every=recipe.ckpt_every,
                      snapshot_every=recipe.snapshot_every, max_minutes=recipe.max_minutes,
                      seed=recipe.seed)
    seqs = D.dedupe(store)
    train(drafter, plain, store, run, cfg, seqs, progress=_progress("train"))
    ckpt = latest_checkpoint(run)
    done = load_checkpoint(ckpt, drafter, None)["step"]
    log(f"training at step {done}/{cfg.steps} ({ckpt})"
        + ("" if done == cfg.steps else "; run the same command again to continue"))
    if recipe.stop_after == "train":
        return run

    # ---- export
    out = Path(recipe.out or run / "drafter")
    export_drafter(drafter, out, bits=recipe.bits)
    log(f"exported {out} ({folder_megabytes(out):.1f} MB) after "
        f"{(time.perf_counter() - t_start) / 60:.1f} min in this session")
    mx.clear_cache()
    return out


def _by_source(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
