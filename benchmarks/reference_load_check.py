"""Check an exported drafter against the z-lab reference (`dflash==0.1.0`, installed with
`--no-deps` in a benchmark environment only): it loads with `dflash.model_mlx.load_draft`, and
its greedy `propose` drafts the same blocks as ours from stored target features.

    python benchmarks/reference_load_check.py runs/ship_bf16 --eval-store runs/eval_he/greedy

The reference has no quantization support: check the BF16 export of a drafter shipped 4-bit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import dflash2_mlx
import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

import dflash.model_mlx as ref_mod
from dflash2_mlx.loading.checkpoint import assets, checkpoint as loading
from dflash2_mlx.decode.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.train.data import FeatureStore


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--eval-store", type=Path, required=True)
    a = p.parse_args(argv)
    # load_draft only takes hub ids (it calls snapshot_download): hand it the local folder.
    ref_mod.snapshot_download = lambda repo_id, **kw: str(Path(repo_id).resolve())
    ref = ref_mod.load_draft(str(a.folder))
    model, _, _ = loading.load_target(str(assets.smollm2_gguf()), mx.float32)
    adapter = TargetAdapter(model)
    ours = loading.load_drafter(a.folder, hidden_size=adapter.hidden_size,
                                vocab_size=adapter.vocab_size, num_layers=adapter.num_layers,
                                dtype=mx.float32)
    # the reference knows no draft vocabulary: compare the same model over the full vocabulary
    ours.draft_vocab = None
    ref.bind(model)
    ref.update(tree_map(lambda x: x.astype(mx.float32), ref.parameters()))
    store = FeatureStore(a.eval_store)
    B, mask = ours.args.block_size, ours.args.mask_token_id
    same = total = 0
    for i in range(0, len(store), max(1, len(store) // 6)):
        toks, P = store.tokens(i), store.prompt_len(i)
        feats = mx.array(np.asarray(store.feats(i, ours.args.target_layer_ids), np.float32))
        for anchor_pos in (P, P + 20, P + 60):
            if anchor_pos >= len(toks) - 1:
                continue
            anchor = mx.array([[int(toks[anchor_pos])]], dtype=mx.uint32)
            mine = ours.propose(adapter, anchor, feats[None, :anchor_pos], ours.make_cache(), B,
                                Sampling(0.0), mx.random.key(0))
            inputs = mx.concatenate([anchor, mx.full((1, B - 1), mask, mx.uint32)], axis=1)
            theirs = ref.propose(inputs, feats[None, :anchor_pos], ref.make_cache(), 0.0,
                                 logits_start=1)
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs
            same += np.array(mine.tokens).ravel().tolist() == np.array(theirs).ravel().tolist()
            total += 1
    print(f"{type(ref).__name__} loaded by the reference; greedy blocks identical: {same}/{total}")
    return 0 if same == total else 1


if __name__ == "__main__":
    dflash2_mlx.use_fast_blas()      # MLX's float32 matmuls on MKL / OpenBLAS (Linux)
    raise SystemExit(main())
