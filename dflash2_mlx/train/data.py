"""Target responses with their features, generated in batches and kept on disk.

`generate_store(...)` answers prompts with the TARGET (greedy and/or sampled) and writes, per
batch, one shard of a `FeatureStore` folder:

  NNNNN.tokens.npy   uint16 [sum T]        prompt + response ids of each sequence, concatenated
  NNNNN.index.npy    int64  [n, 3]         (start, prompt length, total length T) per sequence
  NNNNN.feats.npy    fp16   [sum (T-1), F] features of the chosen target layers at positions
                                           0..T-2 (the last token is never fed to the target)
  NNNNN.topk_ids.npy uint16 [sum R, k]     the target's top-k next-token ids for each response
  NNNNN.topk_lp.npy  fp16   [sum R, k]     token (R = T - prompt length) and their log-probs
  manifest.json      layer ids, hidden size, k, vocabulary size, the finished shards

Features are captured during generation (the prefill gives the prompt's, each decode step the
fed token's), never in a second pass. Shards are written atomically and skipped when present,
so an interrupted run continues where it stopped. `capture_store` fills a store from token ids
alone (one teacher-forced forward per sequence), for data committed as ids only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .. import log
from ..files import atomic_path, atomic_write

MANIFEST = "manifest.json"
SHARD_FILES = ("tokens", "index", "feats", "topk_ids", "topk_lp")


@dataclass
class GenConfig:
    """How the target answers: `temperature` 0 is greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 16
    topk: int = 16
    prefill_chunk: int = 128     # prompt rows per prefill forward (bounds the logits' memory)
    seed: int = 0


@dataclass
class Sequence_:
    tokens: np.ndarray       # uint16 [T]
    prompt_len: int
    feats: np.ndarray        # fp16 [T-1, F]
    topk_ids: np.ndarray     # uint16 [T-prompt_len, k]
    topk_lp: np.ndarray      # fp16 [T-prompt_len, k]


# --------------------------------------------------------------------------- generation

def _topk(logits, k: int):
    """logits [B, V] (mx) -> ids [B, k] uint16, log-probs [B, k] fp16, as numpy; descending."""
    import mlx.core as mx

    from ..model.topk import top_k_indices

    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = top_k_indices(logp, k)
    lp = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-lp, axis=-1)
    ids, lp = mx.take_along_axis(ids, order, -1), mx.take_along_axis(lp, order, -1)
    return ids.astype(mx.uint16), lp.astype(mx.float16), logp


def generate_batch(adapter, prompts: Sequence[Sequence[int]], cfg: GenConfig, stop_ids: set[int],
                   key=None) -> list[Sequence_]:
    """Answer `prompts` (token ids) in one batch with the target, capturing features.

    `adapter` is a `TargetAdapter` built with the layer ids to capture. Prompts are left-padded
    (mlx-lm's BatchKVCache masks the padding and offsets RoPE per row); a finished row leaves
    the batch. Greedy when cfg.temperature == 0, else sampling from softmax(logits / T).
    """
    import mlx.core as mx

    cache, pad, prompt_feats, last = _prefill_batch(adapter, prompts, cfg)
    key = mx.random.key(cfg.seed) if key is None else key
    out_tokens, out_feats, out_tk, out_lp = _answer_batch(adapter, cache, last, len(prompts),
                                                          cfg, stop_ids, key)
    result = []
    for i, prompt in enumerate(prompts):
        resp = out_tokens[i]
        tokens = np.array(list(prompt) + resp, dtype=np.uint16)
        pf = prompt_feats[i, pad[i]:]
        rf = np.stack(out_feats[i]) if out_feats[i] else np.zeros((0, pf.shape[1]), np.float16)
        result.append(Sequence_(tokens, len(prompt), np.concatenate([pf, rf])[: len(tokens) - 1],
                                np.stack(out_tk[i]), np.stack(out_lp[i])))
    return result


def _prefill_batch(adapter, prompts: Sequence[Sequence[int]], cfg: GenConfig):
    """The prompts left-padded and prefilled in chunks -> (the caches, each prompt's padding,
    the prompt features [n, P, F] as float16, the logits after the last prompt token)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    lens = [len(p) for p in prompts]
    P = max(lens)
    pad = [P - l for l in lens]
    ids = mx.array([[0] * p + list(map(int, q)) for p, q in zip(pad, prompts)], dtype=mx.uint32)
    cache = [BatchKVCache(pad) for _ in range(adapter.num_layers)]
    feats_chunks = []
    for s in range(0, P, cfg.prefill_chunk):
        logits, feats = adapter.forward(ids[:, s: s + cfg.prefill_chunk], cache)
        feats_chunks.append(feats.astype(mx.float16))
        last = logits[:, -1]
        mx.eval(feats_chunks[-1], last)
    prompt_feats = np.array(mx.concatenate(feats_chunks, axis=1))          # [n, P, F]
    return cache, pad, prompt_feats, last


def _answer_batch(adapter, cache, logits, n: int, cfg: GenConfig, stop_ids: set[int], key):
    """Decode the `n` prefilled rows until each stops -> per row its tokens, features,
    top-k ids and log-probabilities."""
    import mlx.core as mx

    out_tokens = [[] for _ in range(n)]
    out_feats = [[] for _ in range(n)]
    out_tk = [[] for _ in range(n)]
    out_lp = [[] for _ in range(n)]
    active = list(range(n))            # original index of each batch row
    while active:
        tk_ids, tk_lp, logp = _topk(logits, cfg.topk)
        if cfg.temperature > 0:
            key, sub = mx.random.split(key)
            nxt = mx.random.categorical(logp / cfg.temperature, key=sub)
        else:
            nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt, tk_ids, tk_lp)
        nxt_np, tk_ids_np, tk_lp_np = np.array(nxt), np.array(tk_ids), np.array(tk_lp)
        keep = []
        for row, i in enumerate(active):
            t = int(nxt_np[row])
            out_tokens[i].append(t)
            out_tk[i].append(tk_ids_np[row])
            out_lp[i].append(tk_lp_np[row])
            if t not in stop_ids and len(out_tokens[i]) < cfg.max_new_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(active):
            idx = mx.array(keep)
            for c in cache:
                c.filter(idx)
            nxt = nxt[idx]
            active = [active[r] for r in keep]
        logits, feats = adapter.forward(nxt[:, None].astype(mx.uint32), cache)
        logits = logits[:, -1]
        f16 = feats[:, 0].astype(mx.float16)
        mx.eval(f16)
        f16 = np.array(f16)
        for row, i in enumerate(active):
            out_feats[i].append(f16[row])
    return out_tokens, out_feats, out_tk, out_lp


# --------------------------------------------------------------------------- the on-disk store

def _store_folder(folder: Path) -> Path:
    """A run folder stands for its store (`train --run R --stop-after data` writes R/data)."""
    inner = folder / "data"
    if not (folder / MANIFEST).is_file() and (inner / MANIFEST).is_file():
        return inner
    return folder


class FeatureStore:
    """A folder of shards (see the module docstring); arrays are memory-mapped on read.

    `FeatureStore(a, b, ...)` reads several stores of one target as one (more data without
    regenerating): sequences are numbered across them in order, the layers are those every
    store holds, and new shards are written to the first."""

    def __init__(self, folder: str | Path, *more: str | Path):
        self.folders = [_store_folder(Path(f)) for f in (folder, *more)]
        self.folder = self.folders[0]
        manifests = []
        for f in self.folders:
            if not (f / MANIFEST).is_file():
                raise FileNotFoundError(f"{f}: not a feature store ({MANIFEST} missing); "
                                        "expected a folder written by `dflash2-mlx train`")
            manifests.append(json.loads((f / MANIFEST).read_text()))
        self.manifest = manifests[0]
        for f, m in zip(self.folders[1:], manifests[1:]):
            for k in ("hidden_size", "topk", "vocab_size"):
                if m[k] != self.manifest[k]:
                    raise ValueError(f"{f}: {k}={m[k]} but {self.folder} has "
                                     f"{self.manifest[k]}; stores read together must come "
                                     "from the same target and settings")
        self.layer_ids = tuple(l for l in self.manifest["layer_ids"]
                               if all(l in m["layer_ids"] for m in manifests))
        self.hidden = int(self.manifest["hidden_size"])
        self.shards, self._shard_layers = [], []
        for f, m in zip(self.folders, manifests):
            for name in m["shards"]:
                self.shards.append({k: np.load(f / f"{name}.{k}.npy", mmap_mode="r")
                                    for k in SHARD_FILES})
                self._shard_layers.append(tuple(m["layer_ids"]))
        self.entries = []               # (shard, row) for every sequence
        for s, arrays in enumerate(self.shards):
            self.entries += [(s, r) for r in range(len(arrays["index"]))]
        self._feat_off = [self._offsets(a["index"], 1) for a in self.shards]
        self._resp_off = [self._offsets(a["index"], 0) for a in self.shards]

    @staticmethod
    def _offsets(index: np.ndarray, minus: int) -> np.ndarray:
        if not len(index):
            return np.zeros(1, np.int64)
        lengths = index[:, 2] - (minus if minus else index[:, 1])
        return np.concatenate([[0], np.cumsum(lengths)])

    @staticmethod
    def create(folder: str | Path, layer_ids: Sequence[int], hidden_size: int, topk: int,
               vocab_size: int, extra: dict | None = None) -> "FeatureStore":
        """Create an empty store, or open an existing one after checking it matches."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / MANIFEST
        want = {"layer_ids": [int(i) for i in layer_ids], "hidden_size": int(hidden_size),
                "topk": int(topk), "vocab_size": int(vocab_size)}
        if path.exists():
            have = json.loads(path.read_text())
            for k, v in want.items():
                if have.get(k) != v:
                    raise ValueError(f"{path}: existing store has {k}={have.get(k)}, this run "
                                     f"asks for {v}; use another folder or the same settings")
        else:
            _write_json(path, {**want, **(extra or {}), "shards": []})
        return FeatureStore(folder)

    def __len__(self) -> int:
        return len(self.entries)

    def has_shard(self, name: str) -> bool:
        return name in self.manifest["shards"]

    def write_shard(self, name: str, seqs: list[Sequence_]) -> None:
        arrays = {
            "tokens": np.concatenate([s.tokens for s in seqs]).astype(np.uint16),
            "index": np.array(_index([len(s.tokens) for s in seqs],
                                     [s.prompt_len for s in seqs]), np.int64),
            "feats": np.concatenate([s.feats for s in seqs]).astype(np.float16),
            "topk_ids": np.concatenate([s.topk_ids for s in seqs]).astype(np.uint16),
            "topk_lp": np.concatenate([s.topk_lp for s in seqs]).astype(np.float16),
        }
        for k, v in arrays.items():
            with atomic_path(self.folder / f"{name}.{k}.npy") as tmp:
                np.save(tmp, v)
        manifest = json.loads((self.folder / MANIFEST).read_text())
        manifest["shards"].append(name)
        _write_json(self.folder / MANIFEST, manifest)
        self.__init__(*self.folders)

    # ---- reading
    def tokens(self, i: int) -> np.ndarray:
        s, r = self.entries[i]
        start, _, T = self.shards[s]["index"][r]
        return self.shards[s]["tokens"][start: start + T]

    def prompt_len(self, i: int) -> int:
        s, r = self.entries[i]
        return int(self.shards[s]["index"][r][1])

    def feats(self, i: int, layers: Sequence[int] | None = None) -> np.ndarray:
        """fp16 [T-1, len(layers) * H]: features of the stored layers `layers` (default all)."""
        s, r = self.entries[i]
        a, b = self._feat_off[s][r], self._feat_off[s][r + 1]
        f = self.shards[s]["feats"][a:b]
        own = self._shard_layers[s]
        layers = self.layer_ids if layers is None else tuple(layers)
        if layers == own:
            return f
        H = self.hidden
        cols = [own.index(l) for l in layers]
        return np.concatenate([f[:, c * H:(c + 1) * H] for c in cols], axis=1)

    def topk(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """([R, k] ids, [R, k] log-probs) of the target's distribution for each response token."""
        s, r = self.entries[i]
        a, b = self._resp_off[s][r], self._resp_off[s][r + 1]
        return self.shards[s]["topk_ids"][a:b], self.shards[s]["topk_lp"][a:b]

    def check_layers(self, layers: Sequence[int]) -> None:
        missing = sorted(set(layers) - set(self.layer_ids))
        if missing:
            where = ", ".join(str(f) for f in self.folders)
            raise ValueError(f"{where}: target layers {missing} were not captured (the "
                             f"store holds {list(self.layer_ids)}); regenerate or pick those")

    def stats(self) -> dict:
        T = sum(int(a["index"][:, 2].sum()) for a in self.shards if len(a["index"]))
        P = sum(int(a["index"][:, 1].sum()) for a in self.shards if len(a["index"]))
        return {"sequences": len(self), "tokens": T, "prompt_tokens": P,
                "response_tokens": T - P}


def _index(lengths: list[int], prompt_lens: list[int]) -> list[tuple[int, int, int]]:
    out, start = [], 0
    for T, p in zip(lengths, prompt_lens):
        out.append((start, p, T))
        start += T
    return out


def _write_json(path: Path, obj) -> None:
    with atomic_write(path) as f:
        f.write(json.dumps(obj, indent=1) + "\n")


# --------------------------------------------------------------------------- driving it

def encode_chat(tokenizer, text: str) -> list[int]:
    """One user turn through the target's chat template, as `Pipeline.encode` renders it."""
    msgs = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def plan_batches(prompt_ids: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar prompt length (little padding), stable order."""
    order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def generate_store(adapter, prompt_ids: list[list[int]], store: FeatureStore, cfg: GenConfig,
                   stop_ids: set[int], tag: str = "g", desc: str = "generate") -> FeatureStore:
    """Answer every prompt (ids) with the target and add the results to `store`, one shard per
    batch named `{tag}{batch:05d}`; shards already there are skipped (resume). The batches
    show as the progress bar `desc`."""
    import mlx.core as mx

    batches = plan_batches(prompt_ids, cfg.batch_size)
    todo = [(b, idx) for b, idx in enumerate(batches) if not store.has_shard(f"{tag}{b:05d}")]
    bar = log.progress(todo, desc)
    tokens_done, t0 = 0, time.perf_counter()
    for b, idx in bar:
        key = mx.random.key(cfg.seed * 100003 + b)
        seqs = generate_batch(adapter, [prompt_ids[i] for i in idx], cfg, stop_ids, key)
        store.write_shard(f"{tag}{b:05d}", seqs)
        tokens_done += sum(len(s.tokens) - s.prompt_len for s in seqs)
        bar.set_postfix(tok_s=f"{tokens_done / (time.perf_counter() - t0):.0f}",
                        seqs=len(store))
        mx.clear_cache()
    return store


def sample_user_turns(adapter, tokenizer, n: int, cfg: GenConfig, stop_ids: set[int],
                      min_chars: int = 20, max_chars: int = 600,
                      exclude: Iterable[str] = ()) -> list[str]:
    """User turns sampled from the target's own chat template: the rendered prefix up to
    `<|im_start|>user\\n` is continued by sampling (T = cfg.temperature or 1) until the end of
    the turn; de-duplicated, length-filtered."""
    marker = "\x00USER\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                             tokenize=False, add_generation_prompt=False)
    prefix = tokenizer.encode(rendered.split(marker)[0], add_special_tokens=False)
    gcfg = GenConfig(max_new_tokens=min(cfg.max_new_tokens, 160),
                     temperature=cfg.temperature or 1.0, batch_size=cfg.batch_size, topk=1,
                     seed=cfg.seed + 7)
    import mlx.core as mx

    out, seen, b = [], set(exclude), 0
    while len(out) < n and b < 4 * (n // gcfg.batch_size + 1):
        seqs = generate_batch(adapter, [prefix] * gcfg.batch_size, gcfg, stop_ids,
                              mx.random.key(gcfg.seed * 7919 + b))
        b += 1
        for s in seqs:
            text = tokenizer.decode([int(t) for t in s.tokens[s.prompt_len:]
                                     if int(t) not in stop_ids]).strip()
            if min_chars <= len(text) <= max_chars and text not in seen:
                seen.add(text)
                out.append(text)
    return out[:n]


def dedupe(store: "FeatureStore | str | Path") -> list[int]:
    """Indices of the sequences to train on: the first of each identical token sequence."""
    store = store if isinstance(store, FeatureStore) else FeatureStore(store)
    seen, keep = set(), []
    for i in range(len(store)):
        key = store.tokens(i).tobytes()
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


# --------------------------------------------------------------------------- the data stage

def load_prompt_file(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def build_prompts(path: str | Path, counts: dict[str, int], adapter=None, tokenizer=None,
                  cfg: GenConfig | None = None, stop_ids: set[int] = frozenset(),
                  seed: int = 0, exclude: Sequence[str | Path] = ()) -> list[dict]:
    """Write (once) and return the prompt list `[{"source", "text"}]` at `path` (jsonl).

    `counts` maps a source of `prompts.offline_prompts` to a count; "self_chat" asks for user
    turns sampled from the target (needs `adapter`, `tokenizer`, `cfg`). `exclude`: prompt files
    of earlier runs; their texts are not drawn again (more data, no repeats)."""
    from .prompts import offline_prompts

    path = Path(path)
    if path.exists():
        return load_prompt_file(path)
    counts = dict(counts)
    n_chat = counts.pop("self_chat", 0)
    known = set()
    for f in exclude:
        if not Path(f).is_file():
            raise FileNotFoundError(f"prompt file to exclude not found: {f} (expected a "
                                    "prompts.jsonl written by an earlier run)")
        known |= {r["text"] for r in load_prompt_file(Path(f))}
    rows = [{"source": p.source, "text": p.text}
            for p in offline_prompts(counts, seed, exclude=known)]
    if n_chat:
        turns = sample_user_turns(adapter, tokenizer, n_chat, cfg or GenConfig(), set(stop_ids),
                                  exclude=known)
        rows += [{"source": "self_chat", "text": t} for t in turns]
    with atomic_write(path) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def encode_prompts(tokenizer, rows: list[dict], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated ids of each prompt; prompts over `max_prompt_tokens` are dropped."""
    ids = [encode_chat(tokenizer, r["text"]) for r in rows]
    return [i for i in ids if len(i) <= max_prompt_tokens]


# --------------------------------------------------------------------------- compact token data

def save_token_ids(store: FeatureStore, path: str | Path,
                   seqs: Sequence[int] | None = None) -> Path:
    """The token ids of a store (prompt + response, uint16) and the prompt lengths, as one
    small `.npz`: enough to rebuild the features with `capture_store` (no generation)."""
    seqs = list(range(len(store))) if seqs is None else list(seqs)
    tokens = [np.asarray(store.tokens(i)) for i in seqs]
    np.savez_compressed(path, tokens=np.concatenate(tokens).astype(np.uint16),
                        lengths=np.array([len(t) for t in tokens], np.int32),
                        prompt_lens=np.array([store.prompt_len(i) for i in seqs], np.int32),
                        layer_ids=np.array(store.layer_ids, np.int32))
    return Path(path)


def load_token_ids(path: str | Path) -> list[tuple[np.ndarray, int]]:
    """[(tokens uint16 [T], prompt length)] from `save_token_ids`."""
    z = np.load(path)
    ends = np.cumsum(z["lengths"])
    starts = ends - z["lengths"]
    return [(z["tokens"][s:e], int(p)) for s, e, p in zip(starts, ends, z["prompt_lens"])]


def capture_store(adapter, seqs: list[tuple[np.ndarray, int]], store: FeatureStore,
                  topk: int = 16, per_shard: int = 16, tag: str = "c", desc: str = "capture"
                  ) -> FeatureStore:
    """Features and top-k of known sequences (teacher forcing, one forward per sequence) into
    `store`, one shard per `per_shard` sequences; existing shards are skipped (resume). The
    shards show as the progress bar `desc`."""
    import mlx.core as mx

    groups = [seqs[i: i + per_shard] for i in range(0, len(seqs), per_shard)]
    todo = [(g, grp) for g, grp in enumerate(groups) if not store.has_shard(f"{tag}{g:05d}")]
    for g, grp in log.progress(todo, desc):
        out = []
        for tokens, P in grp:
            ids = mx.array(np.asarray(tokens[:-1], np.int32))[None]
            logits, feats = adapter.forward(ids, adapter.make_cache())
            tk_ids, tk_lp, _ = _topk(logits[0, P - 1:], topk)
            f16 = feats[0].astype(mx.float16)
            mx.eval(tk_ids, tk_lp, f16)
            out.append(Sequence_(np.asarray(tokens, np.uint16), P, np.array(f16),
                                 np.array(tk_ids), np.array(tk_lp)))
        store.write_shard(f"{tag}{g:05d}", out)
        mx.clear_cache()
    return store
