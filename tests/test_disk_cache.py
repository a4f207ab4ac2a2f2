"""The prefix cache's disk tier: exact round trips (dense, sliding-window and hybrid
GatedDeltaNet targets), LRU by bytes across restarts, corrupt and foreign files deleted, writes
off the caller's thread, and a second `dflash2-mlx serve` process answering from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes

import dflash2_mlx
from dflash2_mlx.cache import disk_file, disk_state
from dflash2_mlx import settings
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.cache.disk import DiskCache
from dflash2_mlx.cache.disk_file import entry_name, read_header, write_file
from dflash2_mlx.model.drafter import Drafter
from dflash2_mlx.decode.state import DecodeState
from dflash2_mlx.decode.engine import stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.decode.lookup import LookupConfig
from dflash2_mlx.cache.prompt import PromptCache
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from fixtures import drafter_args, random_drafter, write_target
from test_families import CONFIGS

PROMPT = [5, 17, 99, 3, 250, 7, 42, 11, 5, 17, 99, 3, 60, 61]


class Model:
    """A target and a drafter, generating with a fixed width and lookup (stop tokens off)."""

    def __init__(self, adapter: TargetAdapter, drafter: Drafter | None):
        self.adapter, self.drafter = adapter, drafter

    def gen(self, prompt, state=None, n=10, width=4, **sampling):
        seed = sampling.pop("seed", None)
        out = stream_tokens(self.adapter, self.drafter, prompt, max_tokens=n,
                            sampling=Sampling(**sampling), planner=Planner(),
                                                           policy=FixedWidth(width),
                            lookup=LookupConfig(), stop_ids=set(), seed=seed, state=state)
        return [t for new in out for t in new]

    def turn(self, prompt, n=10):
        """Generate from scratch -> (answer, the state it leaves)."""
        state = DecodeState.new(self.adapter, self.drafter)
        return self.gen(prompt, state, n), state

    def disk(self, folder, max_bytes=2**30, **kw) -> DiskCache:
        return DiskCache(folder, max_bytes, target=self.adapter, drafter=self.drafter, **kw)


@pytest.fixture(scope="module")
def dense(llama_dir, dflash2_dir):
    pipe = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    return Model(pipe.adapter, pipe.drafter)


def family_model(name: str) -> Model:
    cfg = CONFIGS[name]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    sliding = name == "llama-sliding"        # a sliding-window drafter too (window 8)
    args = drafter_args(block_size=8, layer_ids=(1, 3), **(
        {"layer_types": ("sliding_attention",) * 2, "sliding_window": 8} if sliding else {}))
    drafter = random_drafter(args, seed=3)
    adapter = TargetAdapter(model, args.target_layer_ids)
    adapter.embed_tokens.weight = adapter.embed_tokens.weight * 4
    mx.eval(model.parameters(), drafter.parameters())
    return Model(adapter, drafter)


def files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if disk_file.NAME.match(p.name))


# --------------------------------------------------------------------------- exact round trips

@pytest.mark.parametrize("name", ["llama", "llama-sliding", "qwen3_5"])
def test_a_turn_from_disk_after_a_restart_equals_no_cache(name, dense, tmp_path):
    m = dense if name == "llama" else family_model(name)
    answer, state = m.turn(PROMPT)
    first = PromptCache(2, disk=m.disk(tmp_path))
    first.insert(state)
    first.close()                                   # the server stops: queued writes land
    assert len(files(tmp_path)) == 1

    cache = PromptCache(2, disk=m.disk(tmp_path))   # a new process: RAM empty, disk indexed
    nxt = PROMPT + answer + [9, 8, 30]
    hit, n = cache.fetch(nxt)
    assert n == len(PROMPT) + len(answer) - 1 and hit.tokens == nxt[:n]
    assert cache.stats.disk_hits == 1 and cache.stats.hits == 1
    want = m.gen(nxt)
    assert m.gen(nxt, hit) == want
    again, _ = cache.fetch(nxt)                     # seeded sampling from a disk hit
    assert m.gen(nxt, again, temperature=1.0, seed=5) == m.gen(nxt, temperature=1.0, seed=5)

    branch = PROMPT[:6] + [1, 2, 3]
    short, k = cache.fetch(branch)
    if name == "llama":                             # trimmable: the common prefix is reused
        assert k == 6 and short.tokens == PROMPT[:6]
        assert m.gen(branch, short) == m.gen(branch)
    else:           # a recurrent layer, or a sliding window past 6 rows: recomputed
        assert (short, k) == (None, 0) and cache.stats.recomputed >= 1
    assert len(files(tmp_path)) == 1                # a miss does not delete anything
    cache.close()


def test_files_are_safetensors_with_a_checked_header(dense, tmp_path):
    answer, state = dense.turn(PROMPT)
    disk = dense.disk(tmp_path)
    assert disk.put(state)
    disk.close()
    (name,) = files(tmp_path)
    assert name == entry_name(state.tokens)
    arrays, meta = mx.load(str(tmp_path / name), return_metadata=True)   # MLX reads it too
    body = json.loads(meta["dflash2"])
    assert body["tokens"] == state.tokens and body["package"] == dflash2_mlx.__version__
    assert body["identity"] == disk.identity and body["identity"]["dtype"] == "float32"
    assert set(arrays) == {n for n, _, _ in body["tensors"]}
    # KV caches keep only the rows in use
    assert arrays["t0.keys"].shape[2] == len(state.tokens)


# --------------------------------------------------------------------------- LRU by bytes

def test_lru_by_bytes_survives_a_restart_and_longer_states_replace_shorter(dense, tmp_path):
    states = {}
    for first in (10, 20, 30, 40):       # no common prefix; same lengths, so the same sizes
        states[first] = dense.turn([first] + PROMPT[1:], n=6)[1]
    disk = dense.disk(tmp_path)
    disk.put(states[10])
    disk.flush()
    one = disk.nbytes
    disk.close()
    bound = int(2.5 * one)

    disk = dense.disk(tmp_path, bound)
    cache = PromptCache(0, disk=disk)               # disk only: every insert goes to disk
    cache.insert(states[20])
    disk.flush()
    assert cache.fetch(states[10].tokens + [1])[1] > 0     # 10 is now the most recent
    cache.insert(states[30])                                # evicts 20
    disk.flush()
    assert files(tmp_path) == sorted(entry_name(states[k].tokens) for k in (10, 30))
    assert disk.nbytes <= bound and disk.stats.evicted == 1
    disk.close()

    disk = dense.disk(tmp_path, bound)              # restart: the order comes from the files
    disk.put(states[40])                            # evicts 10 (used before 30 was written)
    disk.flush()
    assert files(tmp_path) == sorted(entry_name(states[k].tokens) for k in (30, 40))
    disk.close()
    smaller = dense.disk(tmp_path, int(1.2 * one))              # a smaller bound at start
    assert len(smaller) == 1 and files(tmp_path) == [entry_name(states[40].tokens)]
    smaller.close()

    # a state that extends an entry replaces it (it serves the same prompts)
    disk = dense.disk(tmp_path)
    answer, state = dense.turn(PROMPT)
    disk.put(state)
    disk.flush()
    hit, n = PromptCache(0, disk=disk).fetch(state.tokens + [4, 4])
    dense.gen(state.tokens + [4, 4], hit)
    disk.put(hit)
    disk.flush()
    assert entry_name(state.tokens) not in files(tmp_path)
    assert entry_name(hit.tokens) in files(tmp_path)
    disk.close()


# --------------------------------------------------------------------------- bad files

def _rewrite(path, change):
    """The file with its JSON body changed and a valid checksum (a well-formed foreign file)."""
    head = read_header(path, json.loads(mx.load(str(path), return_metadata=True)[1]["dflash2"])
                       ["identity"], 10**9)
    data = path.read_bytes()[head.data_start:]
    tensors = [(n, d, np.frombuffer(data, disk_state.DTYPES[d][1], offset=b,
                                    count=(e - b) // np.dtype(disk_state.DTYPES[d][1]).itemsize)
                .reshape(s)) for n, d, s, b, e in head.tensors]
    meta = head.meta
    change(meta)
    write_file(path, meta, tensors)


def _flip(path, where):
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    i = {"data": 8 + n + (len(raw) - 8 - n) // 2, "header": 8 + n // 2}[where]
    raw[i] ^= 0x10
    path.write_bytes(bytes(raw))


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "truncated-header": lambda p: p.write_bytes(p.read_bytes()[:50]),
    "bit-flip-data": lambda p: _flip(p, "data"),
    "bit-flip-header": lambda p: _flip(p, "header"),
    "garbage": lambda p: p.write_bytes(os.urandom(4096)),
    "empty": lambda p: p.write_bytes(b""),
    "other-version": lambda p: _rewrite(p, lambda m: m.update(package="0.0.1")),
    "other-format": lambda p: _rewrite(p, lambda m: m.update(format=99)),
    "other-layout": lambda p: _rewrite(p, lambda m: m["layout"]["target"][0].update(offset=3)),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupt_or_foreign_file_is_deleted_never_used(kind, dense, tmp_path):
    answer, state = dense.turn(PROMPT)
    disk = dense.disk(tmp_path)
    disk.put(state)
    disk.close()
    (name,) = files(tmp_path)
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / "model.safetensors").write_bytes(b"not ours either")
    CORRUPTIONS[kind](tmp_path / name)

    disk = dense.disk(tmp_path)                     # the index: headers checked at start
    cache = PromptCache(2, disk=disk)
    nxt = PROMPT + answer + [9, 8]
    hit, n = cache.fetch(nxt)                       # the data: checked when read
    assert (hit, n) == (None, 0)
    assert files(tmp_path) == [] and disk.stats.rejected == 1
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "model.safetensors").exists()
    cache.insert(state)                             # and the tier still works
    disk.close()
    assert files(tmp_path) == [name]


@pytest.mark.parametrize("other", ["model", "dtype", "drafter"])
def test_files_of_another_model_drafter_or_dtype_are_deleted(other, dense, llama_dir,
                                                             dflash2_dir, dflash_dir, tmp_path):
    answer, state = dense.turn(PROMPT)
    disk = dense.disk(tmp_path)
    disk.put(state)
    disk.close()
    if other == "model":
        pipe = dflash2_mlx.load(str(write_target(tmp_path / "other", "llama", seed=5)),
                                str(dflash2_dir))
    elif other == "dtype":
        pipe = dflash2_mlx.load(str(llama_dir), str(dflash2_dir), dtype="float16")
    else:
        pipe = dflash2_mlx.load(str(llama_dir), str(dflash_dir))
    foreign = Model(pipe.adapter, pipe.drafter).disk(tmp_path)
    assert len(foreign) == 0 and files(tmp_path) == []
    what = "target" if other == "model" else other
    assert foreign.stats.reasons == {f"written for another {what}": 1}
    foreign.close()


def test_states_with_unknown_caches_are_not_written(dense, tmp_path):
    from mlx_lm.models.cache import ConcatenateKVCache

    disk = dense.disk(tmp_path)
    odd = DecodeState([ConcatenateKVCache()], None, [], [1, 2, 3])
    assert not disk.put(odd)
    disk.close()
    assert files(tmp_path) == []


# --------------------------------------------------------------------------- off the request path

class SlowDisk(DiskCache):
    """A writer that waits for `release` before each file, and says which thread wrote."""

    def __init__(self, *args, **kw):
        self.release, self.threads = threading.Event(), []
        super().__init__(*args, **kw)

    def write_file(self, path, meta, tensors):
        self.threads.append(threading.current_thread().name)
        assert self.release.wait(60)
        return super().write_file(path, meta, tensors)


@pytest.mark.parametrize("name", ["llama", "llama-sliding"])
def test_writes_happen_on_the_writer_thread_and_never_block(name, dense, tmp_path):
    m = dense if name == "llama" else family_model(name)
    disk = SlowDisk(tmp_path, 2**30, target=m.adapter, drafter=m.drafter, queue_size=1)
    cache = PromptCache(4, disk=disk)
    a, b, c = (m.turn(p)[1] for p in (PROMPT, PROMPT[::-1], [40, 41, 42]))
    took = []
    for state in (a, b, c):     # a: taken by the stuck writer; b: queued; c: dropped
        tic = time.perf_counter()
        cache.insert(state)
        took.append(time.perf_counter() - tic)
        time.sleep(0.2)
    assert max(took) < 1.0 and disk.stats.dropped == 1 and len(cache) == 3
    # fetch and generation go on while the writer is stuck
    nxt = b.tokens + [7, 7]
    hit, n = cache.fetch(nxt)
    assert n == len(b.tokens) and m.gen(nxt, hit) == m.gen(nxt)
    # the state written is the state as it was given, though it changed in place since
    # (plain steps: the sliding-window cache writes its buffer in place)
    before = list(b.tokens)
    m.gen(nxt, b, width=1)
    assert b.tokens != before
    disk.release.set()
    disk.flush()
    assert set(disk.threads) == {"dflash2-disk-cache"} != {threading.current_thread().name}
    assert files(tmp_path) == sorted(entry_name(s) for s in (a.tokens, before))
    disk.close()
    reread = PromptCache(0, disk=m.disk(tmp_path))
    hit, n = reread.fetch(before + [7, 7])
    assert n == len(before) and m.gen(before + [7, 7], hit) == m.gen(before + [7, 7])
    reread.close()


def test_entries_pushed_out_of_ram_go_to_disk_and_ram_wins_ties(dense, tmp_path):
    disk = SlowDisk(tmp_path, 2**30, target=dense.adapter, drafter=dense.drafter,
                    queue_size=2)
    cache = PromptCache(1, disk=disk)
    states = [dense.turn([first] + PROMPT[1:], n=4)[1] for first in (10, 20, 30, 40, 50)]
    for s in states[:4]:        # 10 is being written, 20 and 30 wait, 40's write is dropped
        cache.insert(s)
        time.sleep(0.2)
    assert disk.stats.dropped == 1 and len(cache) == 1
    disk.release.set()
    disk.flush()
    assert entry_name(states[3].tokens) not in files(tmp_path)
    cache.insert(states[4])     # pushes 40 out of RAM: written now
    disk.flush()
    assert files(tmp_path) == sorted(entry_name(s.tokens) for s in states)
    hit, n = cache.fetch(states[3].tokens + [1])
    assert n == len(states[3].tokens) and cache.stats.disk_hits == 1
    hit, n = cache.fetch(states[4].tokens + [1])       # in RAM and on disk: RAM
    assert n == len(states[4].tokens) and cache.stats.disk_hits == 1 and disk.stats.loads == 1
    cache.close()


# --------------------------------------------------------------------------- settings, CLI

def test_byte_size_setting():
    assert settings.byte_size("8GiB") == 8 * 2**30 == settings.PROMPT_CACHE_DISK_BYTES
    assert settings.byte_size("512M") == settings.byte_size(512 * 2**20) == 512 * 2**20
    assert settings.byte_size(" 1.5 g ") == 3 * 2**29
    for bad in (0, -1, "0", "lots", "1e9", "", True, 2.0, "5 PB"):
        with pytest.raises(settings.SettingError, match="a size in bytes"):
            settings.byte_size(bad, "--prompt-cache-disk-bytes")


@pytest.mark.server
def test_serve_flags_are_checked_before_the_model_loads(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "dflash2_mlx.cli", "serve"]
    bad = subprocess.run(cli + ["--prompt-cache-disk-bytes", "lots"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "--prompt-cache-disk-bytes" in bad.stderr
    alone = subprocess.run(cli + ["--prompt-cache-disk-bytes", "1G"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert alone.returncode != 0 and "add --prompt-cache-dir" in alone.stderr
    (tmp_path / "file").write_text("")
    nodir = subprocess.run(cli + ["--prompt-cache-dir", tmp_path / "file" / "sub"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert nodir.returncode != 0 and "--prompt-cache-dir" in nodir.stderr


# --------------------------------------------------------------------------- two processes

@pytest.mark.slow  # 11 s: two servers, one after the other
@pytest.mark.server
def test_a_second_server_process_answers_the_next_turn_from_disk(llama_dir, dflash2_dir,
                                                                tmp_path):
    openai = pytest.importorskip("openai")
    from test_server import BLOCK, Server, chat_ids

    pipe = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    pipe.default_block_size = BLOCK
    folder = tmp_path / "prompts"
    args = ("--model", llama_dir, "--draft", dflash2_dir, "--prompt-cache-dir", folder,
            "--prompt-cache-disk-bytes", "64MiB", "--context-length", 512)
    msgs = [{"role": "system", "content": "You are a small assistant."},
            {"role": "user", "content": "def add(a, b):"}]

    def ask(server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=60)
        return client.chat.completions.create(model="llama", messages=msgs, max_tokens=16,
                                              temperature=0)

    first = Server(*args)
    try:
        one = ask(first)
        assert one.choices[0].message.content == pipe.generate(chat_ids(pipe, msgs),
                                                               max_tokens=16).text
    finally:
        assert first.stop() == 0, "".join(first.log)
    assert len(files(folder)) == 1
    (folder / ("0" * 32 + ".safetensors")).write_bytes(b"garbage")    # never trusted

    msgs += [{"role": "assistant", "content": one.choices[0].message.content},
             {"role": "user", "content": "for i in range(10):"}]
    second = Server(*args)
    try:
        two = ask(second)
        health = second.health()["prompt_cache"]
    finally:
        assert second.stop() == 0, "".join(second.log)
    log = "".join(first.log + second.log)
    assert "Traceback" not in log, log
    prompt = chat_ids(pipe, msgs)
    assert two.choices[0].message.content == pipe.generate(prompt, max_tokens=16).text
    assert two.usage.prompt_tokens_details.cached_tokens > 0
    assert health["disk_hits"] == 1 and health["disk"]["rejected"] == 1
    assert health["disk"]["loads"] == 1 and health["disk"]["entries"] >= 1
