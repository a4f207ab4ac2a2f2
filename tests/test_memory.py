"""The memory budget (issue 49, points 4-6): bytes per token from config.json against the caches
mlx-lm actually holds (float, 8-bit, 4-bit; full, sliding-window and GatedDeltaNet layers);
`--memory-budget` parsing; the scheduler admitting only what fits (others wait, nothing is
lost), refusing at once what never fits in each API's words, and ending only the sequence
that must end when a step fails to allocate; /health's figures; a prefill step's peak.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import gc
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes

import dflash2_mlx
from dflash2_mlx import settings as check
from dflash2_mlx.model import memory
from dflash2_mlx.decode.state import _flat
from dflash2_mlx.server.budget import MemoryBudget, model_config

from fixtures import BLOCK
from test_families import COMMON, CONFIGS, head_dim_32

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
            "quantization": {"group_size": 64, "bits": 4}}


# --------------------------------------------------------------------------- bytes per token

@pytest.mark.parametrize("family", ["llama", "llama-sliding", "gemma3_text", "qwen3_next", "qwen3_5_moe", "gemma4_text", "gemma4_text-moe", "lfm2", "lfm2_moe", "minicpm", "nanbeige", "nemotron_h"])
def test_bytes_per_token_from_config_match_the_caches(family):
    """512 tokens (a whole number of mlx-lm's 256-token steps) in mlx-lm's own caches, float
    and quantized from token 0 on the full-attention layers: the bytes they hold equal the
    formula's, to the byte."""
    cfg = (head_dim_32(family) if family in CONFIGS
           else dict(model_type="llama", **{**COMMON, "head_dim": 32}))
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    config = model_config(model)
    # Gemma 4's KV-shared layers do not take mlx-lm's quantized cache (refused at load:
    # test_families)
    for bits in (None,) if cfg.get("num_kv_shared_layers") else (None, 8, 4):
        cache = make_prompt_cache(model)
        if bits:
            cache = [QuantizedKVCache(32, bits) if type(c) is KVCache else c for c in cache]
        model(mx.arange(511)[None] % 300, cache=cache)
        model(mx.array([[5]]), cache=cache)              # a sliding window trims to its size
        held = sum(a.nbytes for c in cache for a in _flat(c.state))
        assert held == memory.kv_cost(config, bits, 32, itemsize=4).bytes(512), (family, bits)


def test_qwen3_8b_per_token_and_what_quantizing_buys():
    """docs/agents.md's example: 144 KiB a token in float16; 8-bit and 4-bit hold 1.88x and
    3.56x the tokens in the same bytes (the issue asks >= 1.8x and >= 3.4x)."""
    kinds = memory.layer_kinds(QWEN3_8B)
    assert kinds == [memory.FULL] * 36
    f16, q8, q4 = (memory.kv_cost(QWEN3_8B, bits, 64, itemsize=2).per_token
                   for bits in (None, 8, 4))
    assert f16 == 144 * 1024 == 2 * 8 * 128 * 2 * 36
    assert q8 == 36 * 2 * 8 * (128 + 2 * 2 * 2) and q4 == 36 * 2 * 8 * (64 + 2 * 2 * 2)
    assert f16 / q8 >= 1.8 and f16 / q4 >= 3.4
    # float32 (this CPU): the same ratios hold at least as well
    f32, q8_32 = (memory.kv_cost(QWEN3_8B, b, 64, itemsize=4).per_token for b in (None, 8))
    assert f32 / q8_32 >= 1.8


def test_layer_kinds_per_family():
    assert memory.layer_kinds(CONFIGS["gemma3_text"]) == [memory.SLIDING, memory.FULL] * 2
    assert memory.layer_kinds(CONFIGS["llama-sliding"]) == [memory.SLIDING, memory.FULL] * 2
    assert memory.layer_kinds(CONFIGS["qwen3_next"]) == [memory.RECURRENT, memory.FULL] * 2
    wrapped = {"model_type": "qwen3_5", "text_config": {
        **CONFIGS["qwen3_5"], "layer_types": ["linear_attention", "full_attention"] * 2}}
    assert memory.layer_kinds(wrapped) == [memory.RECURRENT, memory.FULL] * 2
    F, S, R, N = memory.FULL, memory.SLIDING, memory.RECURRENT, memory.NONE
    assert memory.layer_kinds(CONFIGS["nemotron_h"]) == [R, N, F, N, R]
    assert memory.layer_kinds(CONFIGS["gemma4_text"]) == [S, F, N, N]
    assert memory.layer_kinds(CONFIGS["lfm2"]) == [R, F] * 2
    assert memory.layer_kinds(CONFIGS["nanbeige"]) == [F] * 8
    # Gemma 4's config.json may leave out mlx-lm's defaults: 20 shared layers, head_dim 512
    gemma4 = {**CONFIGS["gemma4_text"], "num_hidden_layers": 30,
              "layer_types": ["sliding_attention", "full_attention"] * 15}
    del gemma4["num_kv_shared_layers"], gemma4["global_head_dim"]
    assert memory.layer_kinds(gemma4) == [S, F] * 5 + [N] * 20
    assert memory.kv_cost(gemma4, itemsize=2).per_token == 5 * 2 * 2 * 512 * 2
    cost = memory.kv_cost(CONFIGS["llama-sliding"], itemsize=4)
    assert cost.bytes(10_000) - cost.bytes(9_000) == 1000 * cost.per_token   # windows are full
    with pytest.raises(ValueError, match="num_hidden_layers"):
        memory.kv_cost({"num_attention_heads": 4})


def test_cost_inverse_and_a_ragged_batch_pads_to_its_longest():
    cost = memory.KVCost(((100, None), (50, 10)), fixed=7)
    assert cost.bytes(0) == 7 and cost.bytes(20) == 7 + 2000 + 500
    assert cost.tokens_within(cost.bytes(1234)) == 1234
    assert cost.tokens_within(cost.bytes(1234) - 1) == 1233
    assert memory.KVCost(((0, 5),)).tokens_within(1) > 2**30        # it stops growing
    fp = memory.Footprint(memory.KVCost(((10, None),)), memory.KVCost(((1, None),)))
    # rows padded to the longest with its holes and free slots; the drafter's own
    assert fp.bytes([256, 1024]) == 2 * 10 * memory.buffer_slots(1024) + (256 + 1024)
    assert memory.buffer_slots(1024) == 1024 + 69 + 64 + 256
    solo = memory.Footprint(memory.KVCost(((10, None),)), batched=False)
    assert solo.bytes([256, 1024]) == 10 * (256 + 1024)
    assert solo.bytes([1]) == solo.bytes([256])                      # the caches' growth step
    assert fp.most_tokens(fp.bytes([4096])) == 4096


# --------------------------------------------------------------------------- the setting

def test_memory_budget_setting_and_its_bytes():
    assert check.memory_budget(None) is None
    assert check.memory_budget("12GB") == check.memory_budget("12GiB") == 12 * 2**30
    assert check.memory_budget(2**30) == 2**30
    assert check.memory_budget(" 70 %") == "70%" and check.memory_budget("12.5%") == "12.5%"
    for bad in ("0%", "101%", "lots", "-1G", 0, True, "x%"):
        with pytest.raises(check.SettingError, match="--memory-budget.*percentage"):
            check.memory_budget(bad, "--memory-budget")
    device = 32 * 2**30
    assert memory.budget_bytes("50%", device) == 16 * 2**30
    assert memory.budget_bytes("1G", device) == 2**30
    assert memory.budget_bytes(None, device) == device - memory.margin(device)
    from dflash2_mlx.server import ServerConfig

    assert ServerConfig("m", memory_budget="8G").memory_budget == 8 * 2**30
    with pytest.raises(check.SettingError, match="memory_budget"):
        ServerConfig("m", memory_budget="8 apples")


def test_device_memory_as_mlx_reports_it():
    """Metal reports its recommended working set; this CPU backend reports no size, so the
    machine's RAM stands in."""
    size, source = memory.device_memory()
    assert size > 2**28
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        assert size == info["max_recommended_working_set_size"]
    elif not info.get("memory_size") and not info.get("total_memory"):
        assert source == "the machine's RAM"


def test_out_of_memory_is_mlx_allocation_failures_only():
    assert memory.out_of_memory(RuntimeError("[malloc] Unable to allocate 1024 bytes."))
    assert memory.out_of_memory(RuntimeError("[metal::malloc] Resource limit (499000) exceeded."))
    assert memory.out_of_memory(RuntimeError(
        "[METAL] Command buffer execution failed: Insufficient Memory "
        "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)."))
    assert memory.out_of_memory(MemoryError())
    assert not memory.out_of_memory(RuntimeError("[matmul] shapes do not match"))
    assert not memory.out_of_memory(ValueError("Unable to allocate"))


def test_fit_lines_say_what_fits_beside_the_weights():
    weights = memory.estimate_weights(QWEN3_8B)
    assert 4.0 * 2**30 < weights[0] < 5.0 * 2**30 and "4-bit" in weights[1]   # 8.2 B params
    lines = memory.fit_lines(QWEN3_8B, device=32 * 2**30, source="test", itemsize=2,
                             weights=weights)
    text = "\n".join(lines)
    assert "144.0 KiB/token" in text and "76.5 KiB/token" in text and "40.5 KiB/token" in text
    room = memory.budget_bytes(None, 32 * 2**30) - weights[0]
    assert f"{room // (144 * 1024):,} tokens fit" in text


# --------------------------------------------------------------------------- the scheduler

@pytest.fixture(scope="module")
def pipe(llama_dir, dflash2_dir):
    p = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    p.default_block_size = BLOCK
    return p


PROMPTS = ["def add(a, b):", "for i in range(10):", "class Stack:", "The quick brown fox"]
MAX_TOKENS = 40


def _post(http, path, body):
    return http.post(path, json=body)


def _settled_active() -> int:
    """MLX's active bytes once they hold still: an earlier test's server thread may still be
    freeing its caches, and the budget below is measured against these bytes to half a
    sequence's reservation (a drop of more after it lets a third sequence in)."""
    last = None
    for _ in range(100):
        gc.collect()
        now = mx.get_active_memory()
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


def _fits(pipe, n: int, tokens: int) -> int:
    """A --memory-budget in bytes that holds n sequences of `tokens`, not n + 1, beside the
    arrays this process holds now (other tests' included: the scheduler measures them)."""
    active = _settled_active()
    b = MemoryBudget(pipe)
    two, three = ([tokens] * k for k in (n, n + 1))
    two, three = b.need(two) + b.join_bytes(two), b.need(three) + b.join_bytes(three)
    assert two < three
    return max(b.weights, active) + (two + three) // 2


def test_requests_beyond_the_budget_wait_and_all_finish_exact(llama_dir, dflash2_dir):
    """Four requests under a budget that holds two of them: never more than two run, the
    others wait in order (/health counts them), and every text is the text alone. In a process
    of its own (`budget_case`): the budget sits half a sequence's reservation above the arrays
    the process holds, and in a full run other tests' arrays in a shared worker came and went
    meanwhile (twice a third request got in)."""
    process = multiprocessing.get_context("spawn").Process(
        target=budget_case, args=(str(llama_dir), str(dflash2_dir), os.environ["DFLASH2_CACHE"]))
    process.start()
    process.join(300)
    assert process.exitcode == 0, "the budget case failed in its own process (see its output)"


def budget_case(llama_dir: str, dflash2_dir: str, cache: str) -> None:
    """The test above's body, in a fresh process: its assertions raise there."""
    os.environ["DFLASH2_CACHE"] = cache
    dflash2_mlx.use_fast_blas()
    from test_server import in_process
    from test_server_batch import _chat

    pipe = dflash2_mlx.load(llama_dir, dflash2_dir)
    pipe.default_block_size = BLOCK
    want = [pipe.generate(p, max_tokens=MAX_TOKENS).text for p in PROMPTS]
    tokens = max(len(pipe.encode(p)) for p in PROMPTS) + MAX_TOKENS
    seen = {"running": 0, "waiting_for_memory": 0, "cache": 0}

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        go.set()
        tasks = [asyncio.ensure_future(_post(http, *_chat(p, MAX_TOKENS))) for p in PROMPTS]
        while not all(t.done() for t in tasks):
            health = (await http.get("/health")).json()
            seen["running"] = max(seen["running"], health["batch"]["running"])
            seen["waiting_for_memory"] = max(seen["waiting_for_memory"],
                                             health["memory"]["waiting_for_memory"])
            seen["cache"] = max(seen["cache"], mx.get_cache_memory())
            await asyncio.sleep(0.005)
        return [await t for t in tasks], (await http.get("/health")).json(), scheduler

    mx.clear_cache()
    default = mx.set_cache_limit(0)
    mx.set_cache_limit(default)
    budget = _fits(pipe, 2, tokens)
    replies, health, scheduler = in_process(pipe, clients, memory_budget=budget)
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == want
    assert seen["running"] == 2 and seen["waiting_for_memory"] >= 1
    # MLX's cache of freed buffers stayed within what the budget leaves beside the weights;
    # the limit is MLX's default again once the server is gone
    assert seen["cache"] <= budget - scheduler.memory.weights
    assert mx.set_cache_limit(default) == default
    m = health["memory"]
    assert m["budget"] == budget and m["weights"] == scheduler.memory.weights
    assert m["kv_reserved"] == 0 and m["waiting_for_memory"] == 0 and m["failures"] == 0
    assert m["weights"] <= m["peak"] <= budget and m["kv_bytes_per_token"] > 0
    assert {"kv_in_use", "prompt_cache", "device", "active"} <= set(m)


def test_prefix_cache_entries_make_room_before_a_request_waits(pipe):
    """A budget that holds one sequence beside nothing else: the finished request's state in
    the prefix cache is evicted so that the next joins at once."""
    from test_server import in_process
    from test_server_batch import _chat

    tokens = len(pipe.encode(PROMPTS[0])) + MAX_TOKENS

    async def clients(app, http, go):
        go.set()
        first = await _post(http, *_chat(PROMPTS[0], MAX_TOKENS))
        cached = (await http.get("/health")).json()["prompt_cache"]["bytes"]
        second = await _post(http, *_chat(PROMPTS[1], MAX_TOKENS))
        return first, cached, second, (await http.get("/health")).json()

    # room beside one sequence for its state's copy as it leaves, not for that state and the
    # next sequence (the arrays other tests left in this process counted as held)
    gc.collect()
    b = MemoryBudget(pipe)
    budget = max(b.weights, mx.get_active_memory()) + b.need([tokens]) + \
        b.target.bytes(tokens) * 2
    first, cached, second, health = in_process(pipe, clients, memory_budget=budget)
    assert first.status_code == second.status_code == 200
    assert cached > 0                       # the first one's state was kept
    assert health["memory"]["kv_reserved"] + health["prompt_cache"]["bytes"] <= budget - b.weights


def test_a_finished_states_copy_is_made_only_where_the_budget_has_room(pipe):
    """Before a leaving sequence's state is copied out of the batch (`Engine.room_for_state`),
    the scheduler allows the copy where it fits beside MLX's active bytes; where it does not,
    prefix-cache entries go first (their arrays freed); with none left it refuses, and
    /health counts the state not kept."""
    from dflash2_mlx.cache.prompt import PromptCache
    from dflash2_mlx.decode.state import DecodeState
    from dflash2_mlx.server.scheduler import Scheduler

    MB = 2**20
    cache = PromptCache()
    cache.insert(DecodeState(_filled(2000), None, [], list(range(2000))))   # 8 MiB of arrays
    gc.collect()
    s = Scheduler(pipe, prompt_cache=cache,
                  memory=MemoryBudget(pipe, mx.get_active_memory() + 2 * MB))
    assert s._room_for_state(1 * MB) and len(cache) == 1
    assert s._room_for_state(5 * MB) and len(cache) == 0        # the entry made room
    assert not s._room_for_state(20 * MB)
    s._publish_memory()
    assert s.states_not_kept == 1 and s.memory_figures["states_not_kept"] == 1


def test_a_request_that_never_fits_is_refused_at_once_in_each_apis_words(pipe):
    """A prompt longer than the budget holds alone: a 400 worded as the API words a context
    overflow (agents compact on it), with the numbers and the flags that help."""
    from test_server import in_process

    long = "the quick brown fox jumps over the lazy dog. " * 30
    n = len(pipe.encode(long))
    b = MemoryBudget(pipe)
    budget = b.weights + b.need([n // 2])
    content = [{"role": "user", "content": long}]

    async def clients(app, http, go):
        go.set()
        return [await http.post("/v1/chat/completions", json={
                    "model": "llama", "messages": content, "max_tokens": 8}),
                await http.post("/v1/messages", json={
                    "model": "llama", "messages": content, "max_tokens": 8}),
                await http.post("/v1/responses", json={"model": "llama", "input": long,
                                                       "max_output_tokens": 8}),
                await http.post("/v1/chat/completions", json={
                    "model": "llama", "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}]})]

    openai_, anthropic_, responses, short = in_process(pipe, clients, memory_budget=budget)
    for r in (openai_, responses):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert "maximum context length" in err["message"]
    assert anthropic_.status_code == 400
    body = anthropic_.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long")
    for r in (openai_, anthropic_, responses):
        text = r.text
        assert "memory budget" in text and "--kv-bits 8" in text and "--memory-budget" in text
        assert "--context-length" in text and "KiB a token" in text
    assert short.status_code == 200            # the server keeps serving


class FailingTarget:
    """The pipeline's target (the `Target` interface), failing to allocate as `fail(tokens)`
    says: how a test reaches MLX's allocation error without patching MLX or mlx-lm."""

    def __init__(self, target, fail):
        self._target, self._fail = target, fail

    def forward(self, tokens, cache):
        if self._fail(tokens):
            raise RuntimeError(f"[malloc] Unable to allocate {tokens.size * 10**9} bytes.")
        return self._target.forward(tokens, cache)

    def __getattr__(self, name):
        return getattr(self._target, name)


@pytest.fixture
def failing(pipe):
    adapter = pipe.adapter
    yield lambda fail: setattr(pipe, "adapter", FailingTarget(adapter, fail))
    pipe.adapter = adapter


def test_a_prefill_that_fails_to_allocate_ends_only_its_request(pipe, failing):
    """The long prompt's prefill fails: its client gets a 503 naming memory; the request
    running beside it and one queued after it give their texts alone, exactly."""
    from test_server import in_process
    from test_server_batch import _chat

    long = "the quick brown fox jumps over the lazy dog. " * 6
    n = len(pipe.encode(long))
    want = [pipe.generate(p, max_tokens=MAX_TOKENS).text for p in PROMPTS[:2]]
    failing(lambda tokens: tokens.shape[1] > n // 2)

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        go.set()
        first = asyncio.ensure_future(_post(http, *_chat(PROMPTS[0], MAX_TOKENS)))
        while scheduler.batch_figures["running"] < 1:
            await asyncio.sleep(0.002)
        failed = await _post(http, *_chat(long, 4))
        after = await _post(http, *_chat(PROMPTS[1], MAX_TOKENS))
        return await first, failed, after, (await http.get("/health")).json()

    first, failed, after, health = in_process(pipe, clients)
    assert failed.status_code == 503 and "out of memory" in failed.json()["error"]["message"]
    assert [r.json()["choices"][0]["message"]["content"] for r in (first, after)] == want
    assert health["memory"]["failures"] == 1 and health["status"] == "ok"


def test_a_batch_step_that_fails_to_allocate_ends_the_newest_only(pipe, failing):
    """The first step with three rows fails: the newest of the three ends with a 503 naming
    memory, the two others finish (prefilled again from their tokens), as does a request
    queued behind them."""
    from test_server import in_process
    from test_server_batch import _chat

    want = [pipe.generate(p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    once = []

    def fail(tokens):
        if tokens.shape[0] == 3 and not once:
            once.append(True)
            return True
        return False

    failing(fail)

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        go.set()
        tasks = []
        for p in PROMPTS[:3]:
            tasks.append(asyncio.ensure_future(_post(http, *_chat(p, MAX_TOKENS))))
            n = len(tasks)
            while scheduler.batch_figures["running"] < n and not once:
                await asyncio.sleep(0.001)
        replies = [await t for t in tasks]
        return replies, await _post(http, *_chat(PROMPTS[3], MAX_TOKENS))

    replies, last = in_process(pipe, clients)
    assert once
    codes = [r.status_code for r in replies]
    assert codes == [200, 200, 503], codes
    assert "out of memory" in replies[2].json()["error"]["message"]
    for r, g in zip(replies[:2], want):
        assert r.json()["usage"]["completion_tokens"] == len(g.tokens)
        assert r.json()["choices"][0]["message"]["content"] == g.text
    assert last.json()["choices"][0]["message"]["content"] == want[3].text


def test_a_long_prompts_prefill_peaks_within_the_budget(pipe):
    """A 3k-token prompt under a budget that leaves ~24 MiB beside its cache: the steps are
    sized so that the attention scores fit, and MLX's peak stays within the budget; the same
    prompt prefilled in the pipeline's 2,048-token chunks peaks well past it."""
    from test_server import in_process

    text = "the quick brown fox jumps over the lazy dog. " * 250
    ids = pipe.encode(text, chat_template=False)[:3000]
    text = pipe.tokenizer.decode(ids)
    n = len(pipe.encode(text, chat_template=False))
    b = MemoryBudget(pipe)
    room = b.need([n + 4]) + 24 * 2**20
    seen = {}

    async def clients(app, http, go):
        go.set()
        mx.clear_cache()
        seen["before"] = mx.get_active_memory()
        mx.reset_peak_memory()
        r = await http.post("/v1/completions", json={"model": "llama", "prompt": text,
                                                     "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return (await http.get("/health")).json()["memory"]

    health = in_process(pipe, clients, memory_budget=b.weights + room, max_tokens=8,
                        prompt_cache_size=0)
    assert health["peak"] - seen["before"] <= room
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    pipe.generate(text, max_tokens=1, chat_template=False)
    assert mx.get_peak_memory() - before > 2 * room


def test_doctor_model_reads_the_config_alone(llama_dir, tmp_path):
    """`doctor --model M` on a folder holding only a config.json: bytes per token at each
    KV setting and the tokens that fit here, at the precision `load` would give it."""
    from dflash2_mlx.doctor import memory_rows

    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    lines = memory_rows(str(tmp_path))
    text = "\n".join(lines)
    assert str(tmp_path / "config.json") in lines[0] and "device memory" in text
    assert len([line for line in lines if "KiB/token" in line]) == 3
    assert "--kv-bits 8" in text and "--kv-bits 4" in text and "tokens fit" in text
    with pytest.raises(ValueError, match="config"):
        (tmp_path / "config.json").write_text("{")
        memory_rows(str(tmp_path))


def test_the_load_tests_outside_hold_limits_a_running_process():
    """memory_load --hold address: the limit lands on the running process, at its address
    space then plus the room given (an allocation past it then fails in that process)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from dflash2_mlx.bench.memory_load import hold

    code = ("import sys; print('ready', flush=True); sys.stdin.readline()\n"
            "try:\n    bytearray(64 << 20)\nexcept MemoryError:\n    print('refused')\n"
            "else:\n    print('allocated')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    limit = hold(SimpleNamespace(proc=proc), 8 << 20)
    with open(f"/proc/{proc.pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max address space"))
    out, _ = proc.communicate("go\n", timeout=30)
    assert line.split()[3:5] == [str(limit), str(limit)]
    assert out.strip() == "refused"


def test_the_load_tests_resident_hold_ends_a_process_past_it():
    """memory_load --hold resident: the running process goes into a memory cgroup of its
    resident bytes then plus the room given; touching less goes on, touching more ends it
    (the kernel's out-of-memory kill). Needs root and a memory cgroup controller."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from dflash2_mlx.bench.memory_load import hold_resident

    code = ("import sys\nprint('ready', flush=True)\nkept = []\nfor line in sys.stdin:\n"
            "    kept.append(b'x' * (int(line) << 20))\n    print('alive', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    try:
        limit, group = hold_resident(SimpleNamespace(proc=proc), 64 << 20)
    except SystemExit as e:
        proc.kill()
        pytest.skip(str(e))
    try:
        assert str(proc.pid) in (group / "cgroup.procs").read_text().split()
        proc.stdin.write("16\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "alive"
        proc.stdin.write("256\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == -9 and limit > 64 << 20
    finally:
        proc.kill()
        proc.wait()
        group.rmdir()


def _filled(n: int, layers: int = 2) -> list:
    caches = [KVCache() for _ in range(layers)]
    for c in caches:
        c.update_and_fetch(mx.random.normal((1, 4, n, 64)), mx.random.normal((1, 4, n, 64)))
    mx.eval([c.state for c in caches])
    return caches


def test_a_released_row_holds_its_own_bytes_only():
    """A row released from a batch (its state goes to the prefix cache) owns its arrays: with
    the batch gone, MLX holds that row's bytes, not the batch buffer a lazy copy would keep."""
    from types import SimpleNamespace

    from dflash2_mlx.model.row_caches import RaggedRows

    gc.collect()
    base = mx.get_active_memory()
    rows = RaggedRows()
    rows.join([SimpleNamespace(cache=_filled(n)) for n in (900, 1000, 1100)])
    out = SimpleNamespace(cache=None)
    rows.release(0, out)
    rows.filter([])
    del rows
    gc.collect()
    own = sum(a.nbytes for c in out.cache for a in (c.keys, c.values))
    assert 0 < mx.get_active_memory() - base <= own * 1.05


def test_a_batch_row_never_takes_more_slots_than_its_reservation_counts():
    """A ragged batch's buffer, through joins and verifies of random widths that keep a
    random part of their slots (the rest are holes), never holds more slots than
    `buffer_slots` of its longest row: the reservation a budget admits against covers the
    holes short of a compaction and the free slots of a growth step."""
    from dflash2_mlx.model.row_caches import RaggedKVCache

    rng = np.random.default_rng(0)

    def row(n: int) -> RaggedKVCache:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
        return RaggedKVCache.from_single(c)

    cache, most = row(300), 0
    for step in range(600):
        if step in (40, 150):
            cache.extend(row(int(rng.integers(100, 900))))
        T = int(rng.integers(1, 17))
        kv = mx.zeros((cache.batch, 2, T, 8))
        cache.update_and_fetch(kv, kv)
        cache.commit(rng.integers(1, T + 1, size=cache.batch))
        slots = cache.keys.shape[2]
        assert slots <= memory.buffer_slots(int(cache.lengths.max())), step
        most = max(most, slots - int(cache.lengths.max()))
    assert most > memory.STEP             # holes were there to count


def test_a_join_holds_no_more_than_join_layers_of_the_new_batch_beyond_it():
    """`RaggedRows.join` copies a layer at a time: for a moment it holds the new buffer beside
    the old one, the joiner's and their padded copies. What it holds beyond the larger of
    before and after stays within `budget.JOIN_LAYERS` layers of the batch it makes, which
    admission leaves room for (`MemoryBudget.join_bytes`)."""
    from types import SimpleNamespace

    from dflash2_mlx.model.row_caches import RaggedRows
    from dflash2_mlx.server.budget import JOIN_LAYERS

    layers = 8
    rows = RaggedRows()
    rows.join([SimpleNamespace(cache=_filled(n, layers)) for n in (1500, 1200)])
    joiner = [SimpleNamespace(cache=_filled(1700, layers))]
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    rows.join(joiner)
    del joiner
    gc.collect()
    after = mx.get_active_memory()
    batch = sum(a.nbytes for c in rows.cache for a in (c.keys, c.values))
    assert 0 < mx.get_peak_memory() - max(before, after) <= JOIN_LAYERS * batch / layers
