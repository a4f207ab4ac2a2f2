"""The tests' fixtures: the random-weight checkpoints of `dflash2_mlx.testing` (shared with the
benchmarks; a target that always calls a tool among them), re-exported under the names the test
files import; for the tests only, `Server`, a `dflash2-mlx serve` subprocess on loopback
(conftest.py's `server` fixture runs one with the limits below); and the batch engine's helpers
that test_engine.py and test_batch_hybrid.py share (`run` drives an `Engine`).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.utils import _get_classes

from dflash2_mlx.decode.engine import CANCELLED, Engine, Request, stream_tokens
from dflash2_mlx.policy.planner import Planner
from dflash2_mlx.decode.lookup import LookupConfig
from dflash2_mlx.model.sampling import Sampling
from dflash2_mlx.model.target import TargetAdapter
from dflash2_mlx.policy.adaptive import FixedWidth
from dflash2_mlx.testing import (CHAT_TEMPLATE, HIDDEN, SMOLLM2_DRAFTER, TARGET_LAYERS,
                                 TOOL_CALL, TOOL_TEMPLATE, VOCAB, drafter_args, random_drafter,
                                 smollm2_drafter_args, target_config, write_drafter,
                                 write_target, write_tool_target)

__all__ = ["CHAT_TEMPLATE", "HIDDEN", "SMOLLM2_DRAFTER", "TARGET_LAYERS", "VOCAB", "drafter_args",
           "random_drafter", "smollm2_drafter_args", "target_config", "write_drafter",
           "write_target", "write_tool_target", "Server", "TOOL_CALL", "TOOL_TEMPLATE", "KEY",
           "CAP", "CONTEXT", "BODY", "BLOCK", "tiny", "Oracles", "run",
           "assert_seeded_batch_equals_alone", "assert_burst_returns_to_idle"]


# --------------------------------------------------------------------------- servers

KEY = "test-key-123"
CAP = 96                 # --max-tokens
CONTEXT = 512            # --context-length
BODY = 64 * 1024         # --max-body-bytes
BLOCK = 8                # a fixed width: "auto" would time cycles, so seeded runs could differ


class Server:
    """A `dflash2-mlx serve` subprocess; `url` once it printed its address."""

    def __init__(self, *args):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash2_mlx.cli", "serve", "--port", "0", "--block-size",
             str(BLOCK), *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        deadline = time.time() + 120
        self.url = None
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited before it was ready:\n" + "".join(self.log))
            self.log.append(line)
            if m := re.search(r"serving \S+ on (http://\S+)", line):
                self.url = m.group(1)
            if time.time() > deadline:
                raise RuntimeError("the server did not get ready:\n" + "".join(self.log))
        self._drain = threading.Thread(target=lambda: self.log.extend(self.proc.stderr),
                                       daemon=True)
        self._drain.start()

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._drain.join(5)
        return rc

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()


# --------------------------------------------------------------------------- the batch engine

def tiny(name: str):
    """A random-weight target of test_families' configs, as a TargetAdapter."""
    from test_families import CONFIGS, EMBED_SCALE    # here: test_families imports this module

    cfg = CONFIGS[name]
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(7)
    model = model_class(args_class.from_dict(cfg))
    embed = TargetAdapter(model).embed_tokens
    embed.weight = embed.weight * EMBED_SCALE.get(name, 4)
    mx.eval(model.parameters())
    return TargetAdapter(model)


class Oracles:
    """One `OracleDrafter` per sequence behind the engine's one drafter: a sequence's drafter
    cache (made when it is added) says whose oracle drafts for it."""

    def __init__(self, vocab):
        self.vocab, self.next, self.seed = vocab, [], 0
        self.context_window, self.args = None, SimpleNamespace(block_size=16, max_width=16)

    def expect(self, prompt_len, truth):
        """The oracle of the next sequence added."""
        from test_exactness import OracleDrafter     # here: test_exactness imports this module

        self.seed += 1
        self.next.append(OracleDrafter(prompt_len, truth, self.vocab, seed=self.seed))

    def make_cache(self):
        return [self.next.pop(0)]

    @staticmethod
    def skip_context(cache, n):
        cache[0].skip_context(cache, n)

    def propose(self, target, anchor, feats, cache, width, sampling, key):
        return cache[0].propose(target, anchor, feats, cache, width, sampling, key)

    def propose_batch(self, target, drafts):
        return [self.propose(target, *d) for d in drafts]


def random_prompt(rng: random.Random, vocab: int, k: int, longest: int, repeat: int) -> list[int]:
    """Sequence k's prompt in a random-arrivals test: 2..longest ids; every third is
    repetitive (its first 6 ids `repeat` times), so that the lookup finds matches."""
    n = rng.randint(2, longest)
    prompt = [rng.randrange(vocab - 1) for _ in range(n)]
    return (prompt[:6] * repeat)[:n + 6] if k % 3 == 0 else prompt


def run(engine, arrivals: dict, budget=None, cancel_at: dict | None = None, before_add=None):
    """Drive `engine`: arrivals[step] = [(key, Request)] join before that step (after
    `before_add(key)`); cancel_at[step] = [key] are cancelled then -> {key: (tokens, finish)}."""
    ids, out, step = {}, {}, 0
    while step <= max(arrivals, default=0) or engine.running or engine.waiting:
        for key, req in arrivals.get(step, []):
            if before_add is not None:
                before_add(key)
            ids[engine.add(req)] = key
            out[key] = ([], None)
        for key in (cancel_at or {}).get(step, []):
            rid = next(r for r, k in ids.items() if k == key)
            assert engine.cancel(rid)
            out[key] = (out[key][0], CANCELLED)
        for ev in engine.step(prefill_budget=budget):
            toks, _ = out[ids[ev.id]]
            toks.extend(ev.tokens)
            out[ids[ev.id]] = (toks, ev.finish)
        step += 1
        assert step < 2000
    return out


def assert_seeded_batch_equals_alone(adapter, drafter, max_tokens: int) -> Engine:
    """Four seeded sampled requests (plain, width 4, width 6 with lookup, lookup alone) in two
    waves give the tokens each gives alone -> the engine, for more checks."""
    rng = random.Random(8)
    vocab = adapter.vocab_size
    sampling = Sampling(temperature=0.9, top_p=0.95)
    specs = [(FixedWidth(1), False), (FixedWidth(4), False), (FixedWidth(6), True),
             (FixedWidth(1), True)]
    arrivals, refs = {}, {}
    for k, (policy, lookup) in enumerate(specs):
        prompt = [rng.randrange(vocab - 1) for _ in range(5 + 7 * k)]
        refs[k] = [t for new in stream_tokens(
            adapter, drafter, prompt, max_tokens=max_tokens, sampling=sampling,
            planner=Planner(),
            policy=policy, stop_ids=set(), lookup=LookupConfig() if lookup else None,
            seed=100 + k) for t in new]
        arrivals.setdefault(k % 2, []).append(
            (k, Request(prompt, max_tokens, sampling, policy=policy, lookup=lookup,
                        seed=100 + k)))
    engine = Engine(adapter, drafter, planner=Planner())
    out = run(engine, arrivals)
    for k, ref in refs.items():
        assert out[k] == (ref, "length"), k
    assert len({tuple(r) for r in refs.values()}) == len(refs)
    return engine


def assert_burst_returns_to_idle(adapter, drafter, prompt_len: int, max_tokens: int) -> None:
    """Two waves of 8 sequences (plain, widths 2-5, half with lookup) leave no batch state and
    the active memory at its level after a first such burst (which allocates for good)."""
    rng = random.Random(9)
    vocab = adapter.vocab_size

    def burst():
        engine = Engine(adapter, drafter, planner=Planner())
        arrivals = {s: [(8 * s + k, Request([rng.randrange(vocab - 1)
                                             for _ in range(prompt_len)], max_tokens,
                                            policy=FixedWidth(1 + k % 5), lookup=k % 2 == 1))
                        for k in range(8)] for s in range(2)}
        run(engine, arrivals)
        return engine

    burst()                                  # the first use compiles and allocates for good
    mx.clear_cache()
    idle = mx.get_active_memory()
    engine = burst()
    mx.clear_cache()
    assert engine.caches.cache is None and not engine.states
    assert mx.get_active_memory() <= idle + 64 * 1024, (idle, mx.get_active_memory())
