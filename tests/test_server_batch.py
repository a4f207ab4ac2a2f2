"""The server's continuous batching (`server.scheduler.Scheduler` on `engine.Engine`): every
request's text is the text it gives alone, whichever requests share its steps and whenever it
joined; a client that leaves, a stop string, seeded sampling, the prefix cache, a full queue
and a shutdown, all while others run; a hybrid GatedDeltaNet target batched too; and when
the scheduler runs one request at a time. In process (`test_server.in_process`: the app under
httpx.ASGITransport, the worker on the main thread), plus one test over a real socket with the
openai client.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import dflash2_mlx  # noqa: E402
from fixtures import BLOCK, write_target  # noqa: E402
from test_server import (ENDLESS, LIMIT, _sse_lines, _until, asgi_completion,  # noqa: E402
                         chat_ids, in_process)

from dflash2_mlx import settings as check  # noqa: E402
from dflash2_mlx.decode.state import common_prefix  # noqa: E402
from dflash2_mlx.server import Scheduler, ServerConfig  # noqa: E402


@pytest.fixture(scope="module")
def pipe(llama_dir, dflash2_dir):
    p = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    p.default_block_size = BLOCK          # a fixed width: seeded runs do not depend on timing
    return p


def _chat(content, max_tokens, stream=False, **extra):
    return ("/v1/chat/completions", {"model": "llama", "max_tokens": max_tokens,
                                     "temperature": 0, "stream": stream,
                                     "messages": [{"role": "user", "content": content}],
                                     **extra})


def _completion(prompt, max_tokens, stream=False, **extra):
    return ("/v1/completions", {"model": "llama", "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "stream": stream, **extra})


async def _running_beside(http, scheduler, max_tokens: int) -> asyncio.Future:
    """An ENDLESS completion of `max_tokens`, posted and running (a batch of one) -> its
    response, to come."""
    path, body = _completion(ENDLESS, max_tokens)
    running = asyncio.ensure_future(http.post(path, json=body))
    await _until(lambda: scheduler.batch_figures["running"] == 1)
    return running


def _text(path, r) -> tuple[str, str]:
    """(text, finish_reason) of a chat or completions reply, streamed or not."""
    assert r.status_code == 200, r.text
    key = "message" if path.endswith("chat/completions") else None
    if not r.headers["content-type"].startswith("text/event-stream"):
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if key else choice["text"]), choice["finish_reason"]
    events = [json.loads(x[6:]) for x in _sse_lines(r.text) if x.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e.get("choices")]
    text = "".join((c["delta"].get("content") or "") if key else c["text"] for c in choices)
    return text, [c["finish_reason"] for c in choices if c["finish_reason"]][-1]


class Peak:
    """The most sequences /health reported running, polled while the test's requests run."""

    def __init__(self, http):
        self.http, self.most, self.seen = http, 0, []

    async def watch(self, done: asyncio.Event):
        while not done.is_set():
            batch = (await self.http.get("/health")).json()["batch"]
            self.most = max(self.most, batch["running"])
            if batch["running"]:
                self.seen.append(batch)
            await asyncio.sleep(0.01)


def test_concurrent_requests_each_give_exactly_their_text_alone(pipe):
    """Five requests of different lengths, streamed and not, chat and completions, joining a
    running batch at three different points; /health shows the batch meanwhile."""
    first = [_completion(ENDLESS, 60)]
    second = [_chat("def add(a, b):", 24, stream=True), _chat("for i in range(10):", 12)]
    third = [_completion("class Stack:", 30, stream=True),
             _chat("The quick brown fox", 16, stream=True)]
    want = {}
    for path, body in first + second + third:
        prompt = body.get("prompt") or body["messages"][0]["content"]
        g = pipe.generate(prompt, max_tokens=body["max_tokens"],
                          chat_template=path.endswith("chat/completions"))
        want[prompt] = (g.text, "stop" if g.finish_reason == "stop" else "length", len(g.tokens))

    async def clients(app, http, go):
        scheduler, peak, done = app.state.scheduler, Peak(http), asyncio.Event()
        watcher = asyncio.ensure_future(peak.watch(done))
        go.set()
        tasks = [asyncio.ensure_future(http.post(p, json=b)) for p, b in first]
        await _until(lambda: any(s["tokens"] >= 4 for s in
                                 scheduler.batch_figures["sequences"]))
        tasks += [asyncio.ensure_future(http.post(p, json=b)) for p, b in second]
        await _until(lambda: scheduler.batch_figures["running"] >= 2)
        tasks += [asyncio.ensure_future(http.post(p, json=b)) for p, b in third]
        replies = await asyncio.gather(*tasks)
        done.set()
        await watcher
        return replies, peak, (await http.get("/health")).json()

    replies, peak, health = in_process(pipe, clients)
    for (path, body), r in zip(first + second + third, replies):
        prompt = body.get("prompt") or body["messages"][0]["content"]
        text, finish = _text(path, r)
        assert (text, finish) == want[prompt][:2], prompt
        if not body["stream"]:
            usage = r.json()["usage"]
            assert usage["completion_tokens"] == want[prompt][2]
            assert usage["dflash2"]["block_size"] == BLOCK and usage["dflash2"]["cycles"] > 0
    assert peak.most >= 3, peak.most
    batch = health["batch"]
    assert batch["mode"] == "batch" and batch["why"] is None
    assert batch["max_batch"] == check.MAX_BATCH
    assert batch["prefill_chunk"] == check.PREFILL_CHUNK
    assert (batch["running"], batch["prefilling"], batch["waiting"]) == (0, 0, 0)
    busy = max(peak.seen, key=lambda b: b["running"])
    assert len(busy["sequences"]) >= busy["running"]
    assert all(set(s) == {"prompt_tokens", "cached_tokens", "tokens"}
               for s in busy["sequences"])
    assert any(s["tokens"] > 0 for s in busy["sequences"])
    assert busy["last_step"]["sequences"] >= 1 and busy["last_step"]["rows"] >= 1
    assert health["served"] == 5 and health["cancelled"] == 0


def test_a_long_prompt_joins_in_chunks_while_a_stream_keeps_flowing(pipe):
    """--prefill-chunk 16: a prompt of ~200 tokens joining a running stream prefills over many
    steps, and the stream commits tokens at each of them; both texts are exact."""
    long = "the quick brown fox jumps over the lazy dog. " * 20
    assert len(pipe.encode(long)) > 10 * 16
    want = [pipe.generate(ENDLESS, max_tokens=200, chat_template=False).text,
            pipe.generate(long, max_tokens=12).text]
    seen = []

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        go.set()
        running = await _running_beside(http, scheduler, 200)
        path, body = _chat(long, 12)
        joining = asyncio.ensure_future(http.post(path, json=body))
        while not joining.done():
            batch = scheduler.batch_figures
            if batch["prefilling"] == 1 and batch["running"] == 1:
                seen.append(batch["sequences"][0]["tokens"])
            await asyncio.sleep(0.002)
        return await running, await joining

    replies = in_process(pipe, clients, max_tokens=LIMIT, context_length=2 * LIMIT,
                         prefill_chunk=16)
    assert [r.json()["choices"][0].get("text") or r.json()["choices"][0]["message"]["content"]
            for r in replies] == want
    assert len(set(seen)) >= 3, seen            # the stream advanced during the prefill


def test_a_client_that_leaves_mid_batch_leaves_the_others_exact(pipe):
    others = [_chat("def add(a, b):", 30, stream=True), _completion("for i in range(10):", 40)]
    want = [pipe.generate("def add(a, b):", max_tokens=30).text,
            pipe.generate("for i in range(10):", max_tokens=40, chat_template=False).text]

    async def clients(app, http, go):
        scheduler, gone, sent = app.state.scheduler, asyncio.Event(), []
        go.set()
        leaving = asgi_completion(app, {"model": "llama", "prompt": ENDLESS, "max_tokens": LIMIT,
                                     "temperature": 0, "stream": True}, gone, sent)
        await _until(lambda: scheduler.batch_figures["running"] == 1)
        tasks = [asyncio.ensure_future(http.post(p, json=b)) for p, b in others]
        await _until(lambda: scheduler.batch_figures["running"] >= 2)
        gone.set()                                 # the streaming client leaves mid-batch
        await asyncio.wait_for(leaving, 30)
        replies = await asyncio.gather(*tasks)
        return replies, (await http.get("/health")).json()

    replies, health = in_process(pipe, clients, max_tokens=LIMIT, context_length=2 * LIMIT)
    assert [_text(p, r)[0] for (p, _), r in zip(others, replies)] == want
    assert health["served"] == 3 and health["cancelled"] == 1
    assert health["batch"]["running"] == 0 and not health["busy"]


def test_stop_strings_and_seeded_sampling_under_batching(pipe):
    """A stop string ends its request beside others (streamed and not); seeded sampling gives
    the sample it gives alone; a greedy request between them stays exact."""
    full = pipe.generate("def add(a, b):", max_tokens=40).text
    stop = full[5:7]
    assert stop and full.index(stop) >= 1
    seeded = [pipe.generate("def add(a, b):", max_tokens=24, temperature=1.0, seed=s).text
              for s in (7, 11)]
    greedy = pipe.generate("for i in range(10):", max_tokens=32).text
    asks = [_chat("for i in range(10):", 32),
            _chat("def add(a, b):", 40, stop=[stop, "never-there"]),
            _chat("def add(a, b):", 40, stream=True, stop=stop),
            _chat("def add(a, b):", 24, temperature=1.0, seed=7),
            _chat("def add(a, b):", 24, stream=True, temperature=1.0, seed=11)]

    async def clients(app, http, go):
        scheduler, peak, done = app.state.scheduler, Peak(http), asyncio.Event()
        watcher = asyncio.ensure_future(peak.watch(done))
        go.set()
        tasks = [asyncio.ensure_future(http.post(asks[0][0], json=asks[0][1]))]
        await _until(lambda: scheduler.batch_figures["running"] == 1)
        tasks += [asyncio.ensure_future(http.post(p, json=b)) for p, b in asks[1:]]
        replies = await asyncio.gather(*tasks)
        done.set()
        await watcher
        return replies, peak.most

    replies, most = in_process(pipe, clients)
    assert most >= 3, most
    got = [_text(p, r) for (p, _), r in zip(asks, replies)]
    assert got[0][0] == greedy
    assert got[1] == got[2] == (full[: full.index(stop)], "stop")
    assert [t for t, _ in got[3:]] == seeded


def test_block_size_auto_batched_stays_exact(pipe):
    """--block-size auto: each request gets the batch-aware policy (widths chosen per step
    against the batch's cost); greedy text is still the text alone."""
    asks = [_chat("def add(a, b):", 24, stream=True), _completion(ENDLESS, 40),
            _chat("class Stack:", 20)]
    want = [pipe.generate("def add(a, b):", max_tokens=24, block_size="auto").text,
            pipe.generate(ENDLESS, max_tokens=40, chat_template=False, block_size="auto").text,
            pipe.generate("class Stack:", max_tokens=20, block_size="auto").text]

    async def clients(app, http, go):
        go.set()
        return await asyncio.gather(*(http.post(p, json=b) for p, b in asks))

    replies = in_process(pipe, clients, block_size="auto")
    assert [_text(p, r)[0] for (p, _), r in zip(asks, replies)] == want
    assert all(r.json()["usage"]["dflash2"]["block_size"] == "auto"
               for (_, b), r in zip(asks, replies) if not b["stream"])


def test_a_prefix_cache_hit_while_batched_gives_the_same_text(pipe):
    msgs = [{"role": "system", "content": "You are a small assistant, turn by turn."},
            {"role": "user", "content": "def add(a, b):"}]
    first = pipe.generate(chat_ids(pipe, msgs), max_tokens=16).text
    turn = msgs + [{"role": "assistant", "content": first},
                   {"role": "user", "content": "class Stack:"}]
    want = pipe.generate(chat_ids(pipe, turn), max_tokens=16).text      # no cache at all
    beside = pipe.generate(ENDLESS, max_tokens=60, chat_template=False).text

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        go.set()
        body = {"model": "llama", "max_tokens": 16, "temperature": 0}
        one = await http.post("/v1/chat/completions", json={**body, "messages": msgs})
        other = await _running_beside(http, scheduler, 60)
        two = await http.post("/v1/chat/completions", json={**body, "messages": turn})
        return one, two, await other

    one, two, other = in_process(pipe, clients)
    assert one.json()["choices"][0]["message"]["content"] == first
    assert two.json()["choices"][0]["message"]["content"] == want
    cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= common_prefix(chat_ids(pipe, msgs), chat_ids(pipe, turn)[:-1]) > 0, cached
    assert two.json()["usage"]["dflash2"]["cached_tokens"] == cached
    assert other.json()["choices"][0]["text"] == beside


def test_a_stop_string_leaves_its_state_to_the_prefix_cache_while_batched(pipe):
    """A request ended by a stop string beside another (its sequence leaves the batch
    mid-generation, cancelled) leaves its state to the prefix cache as one ending by its
    length does: the conversation's next turn, holding the answer cut at the stop, reuses it
    and gives the text it gives without any cache."""
    msgs = [{"role": "system", "content": "You are a small assistant, turn by turn."},
            {"role": "user", "content": "def add(a, b):"}]
    full = pipe.generate(chat_ids(pipe, msgs), max_tokens=40).text
    stop = full[6:8]
    assert stop and full.index(stop) >= 1
    first = full[: full.index(stop)]
    turn = msgs + [{"role": "assistant", "content": first},
                   {"role": "user", "content": "class Stack:"}]
    want = pipe.generate(chat_ids(pipe, turn), max_tokens=16).text      # no cache at all

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        go.set()
        other = await _running_beside(http, scheduler, 60)
        body = {"model": "llama", "temperature": 0}
        one = await http.post("/v1/chat/completions",
                              json={**body, "max_tokens": 40, "messages": msgs, "stop": [stop]})
        two = await http.post("/v1/chat/completions",
                              json={**body, "max_tokens": 16, "messages": turn})
        return one, two, await other

    one, two, other = in_process(pipe, clients)
    assert _text("/v1/chat/completions", one) == (first, "stop")
    assert two.json()["choices"][0]["message"]["content"] == want
    cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= common_prefix(chat_ids(pipe, msgs), chat_ids(pipe, turn)) > 0, cached
    assert other.json()["choices"][0]["text"] == pipe.generate(
        ENDLESS, max_tokens=60, chat_template=False).text


def test_a_full_batch_and_queue_429_then_shutdown_gives_503s(pipe):
    """max_batch 2, queue 1, the worker not started yet: the free rows count as places, so
    three requests are taken and the fourth gets 429; then two streams run and one waits; the
    shutdown ends both running streams with an error event (never a finish) and gives the
    waiting one the 503 JSON."""
    endless = {"model": "llama", "prompt": ENDLESS, "max_tokens": LIMIT, "temperature": 0,
               "stream": True}
    chat = {"model": "llama", "messages": [{"role": "user", "content": "count:"}],
            "max_tokens": LIMIT, "temperature": 0}

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        # (both never end by themselves: a chat answer would, and free its row)
        running = [asyncio.ensure_future(http.post("/v1/completions", json=endless)),
                   asyncio.ensure_future(http.post("/v1/completions",
                                                   json={**endless, "seed": 1}))]
        await _until(lambda: scheduler.waiting == 2)
        queued = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat))
        await _until(lambda: scheduler.waiting == 3)
        refused = await http.post("/v1/chat/completions", json=chat)
        go.set()
        await _until(lambda: scheduler.batch_figures["running"] == 2)
        health = (await http.get("/health")).json()
        scheduler.stop()                           # what serve's deadline calls
        return await asyncio.gather(*running, queued), refused, health

    (a, b, plain), refused, health = in_process(pipe, clients, max_tokens=LIMIT,
                                                context_length=2 * LIMIT, max_batch=2,
                                                queue_size=1)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert health["batch"]["running"] == 2 and health["batch"]["waiting"] == 1
    for r in (a, b):
        lines = _sse_lines(r.text)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
        assert not any('"finish_reason": "stop"' in x or '"finish_reason": "length"' in x
                       for x in lines)
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]


@pytest.fixture(scope="module")
def hybrid_pipe(tmp_path_factory):
    """A tiny qwen3_next (GatedDeltaNet layers beside attention), no drafter: lookup only."""
    folder = write_target(tmp_path_factory.mktemp("hybrid") / "qwen3_next", "qwen3_next",
                          seed=4, head_dim=16, linear_num_value_heads=4,
                          linear_num_key_heads=2, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4,
                          full_attention_interval=2, num_experts=0, num_experts_per_tok=0,
                          decoder_sparse_step=1, shared_expert_intermediate_size=0,
                          mlp_only_layers=[], moe_intermediate_size=0,
                          partial_rotary_factor=0.5)
    p = dflash2_mlx.load(str(folder))
    p.default_block_size = 4              # lookup drafting, no cost calibration
    return p


def test_a_hybrid_gated_delta_net_target_is_batched_exactly(hybrid_pipe):
    """Three requests at once on a qwen3_next target (lookup drafting, fixed width 4): they
    share the batch, and each text is the one it gives alone."""
    asks = [_chat("def add(a, b):", 20, stream=True), _completion("for i in range(10):", 24),
            _chat("class Stack:", 16)]
    want = [hybrid_pipe.generate("def add(a, b):", max_tokens=20).text,
            hybrid_pipe.generate("for i in range(10):", max_tokens=24,
                                 chat_template=False).text,
            hybrid_pipe.generate("class Stack:", max_tokens=16).text]

    async def clients(app, http, go):
        peak, done = Peak(http), asyncio.Event()
        watcher = asyncio.ensure_future(peak.watch(done))
        go.set()
        tasks = [asyncio.ensure_future(http.post(p, json=b)) for p, b in asks]
        replies = await asyncio.gather(*tasks)
        done.set()
        await watcher
        return replies, peak

    replies, peak = in_process(hybrid_pipe, clients, block_size=None)    # its default
    assert [_text(p, r)[0] for (p, _), r in zip(asks, replies)] == want
    assert all(len(t) > 8 for t in want) and len(set(want)) == 3, want
    assert all(b["mode"] == "batch" and b["why"] is None for b in peak.seen)
    assert peak.most >= 2, peak.most


def test_the_mode_and_the_batch_settings(pipe, monkeypatch):
    from mlx_lm.models.cache import ChunkedKVCache

    from dflash2_mlx.model.row_caches import batch_refusal

    assert Scheduler(pipe).mode == "batch" and Scheduler(pipe).max_batch == check.MAX_BATCH
    single = Scheduler(pipe, max_batch=1)
    assert (single.mode, single.why, single.rows) == ("single", "max_batch is 1", 1)
    # the engine decides from the target: one with chunked caches refuses ragged rows
    monkeypatch.setattr(pipe.adapter, "batch_refusal",
                        lambda: batch_refusal([ChunkedKVCache(8)]))
    chunked = Scheduler(pipe)
    assert (chunked.mode == "single" and "ChunkedKVCache" in chunked.why
            and chunked.rows == 1)
    assert pipe.engine(8).max_batch == 1
    monkeypatch.undo()
    for field, value, words in (("max_batch", 0, "integer >= 1"),
                                ("prefill_chunk", 0, "integer >= 1"),
                                ("ping_interval", 0, "seconds > 0"),
                                ("read_timeout", float("nan"), "seconds > 0"),
                                ("max_batch", True, "integer >= 1")):
        with pytest.raises(check.SettingError, match=words) as e:
            ServerConfig("llama", **{field: value})
        assert e.value.name == field


def test_concurrent_openai_clients_over_a_socket_are_batched_and_exact(server, pipe, oa):
    """The real server (--max-batch default) and the real openai client: four clients at once,
    two streaming, of different lengths; /health says batch."""
    asks = [("def add(a, b):", 24, False), ("for i in range(10):", 12, True),
            ("class Stack:", 32, True), ("The quick brown fox", 8, False)]
    want = [pipe.generate(p, max_tokens=n).text for p, n, _ in asks]

    def client(ask):
        prompt, n, stream = ask
        msgs = [{"role": "user", "content": prompt}]
        r = oa.chat.completions.create(model="llama", messages=msgs, max_tokens=n,
                                       temperature=0, stream=stream)
        if not stream:
            return r.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(client, asks)) == want
    batch = server.health()["batch"]
    assert batch["mode"] == "batch" and batch["max_batch"] == check.MAX_BATCH
    assert batch["running"] == 0 and batch["waiting"] == 0


def test_health_is_read_on_no_other_thread_than_the_workers(pipe):
    """The engine's figures come from what the worker published: /health never iterates the
    engine's state from the HTTP thread."""
    threads = set()

    async def clients(app, http, go):
        scheduler = app.state.scheduler
        original = scheduler._figures

        def recording(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return original(*args, **kwargs)
        scheduler._figures = recording
        go.set()
        path, body = _chat("def add(a, b):", 8)
        r = await http.post(path, json=body)
        assert r.status_code == 200
        return (await http.get("/health")).json()

    health = in_process(pipe, clients)
    assert health["batch"]["mode"] == "batch" and health["served"] == 1
    assert threads == {threading.main_thread().name}, threads


def test_server_prefill_budget_grows_with_the_joiners(pipe):
    """Beside running streams, a step prefills `prefill_chunk` tokens per request that can
    join (at most one pipeline chunk); alone, a prompt prefills in the pipeline's chunks."""
    s = Scheduler(pipe, max_batch=4, prefill_chunk=100)
    assert s.prefill_budget(0, 3, 2048) == 2048
    assert s.prefill_budget(2, 1, 2048) == 100
    assert s.prefill_budget(1, 3, 2048) == 300
    assert s.prefill_budget(2, 2, 2048) == 200          # two rows free
    assert s.prefill_budget(1, 3, 250) == 250           # at most one chunk
    assert s.prefill_budget(4, 0, 2048) == 100


def test_a_steps_prefill_is_bounded_by_its_measured_seconds(pipe):
    """A client that leaves during a long prompt frees the model within a step: the budget
    holds what `PREFILL_SECONDS` prefill at the last step's rate (never below MIN_PREFILL)."""
    from dflash2_mlx.server.admission import FIRST_PREFILL, MIN_PREFILL, PREFILL_SECONDS

    s = Scheduler(pipe, max_batch=4, prefill_chunk=100)
    assert s.prefill_budget(0, 1, 2048) == 2048                         # no timing given
    assert s.prefill_budget(0, 1, 2048, (0, 0.0)) == FIRST_PREFILL      # none measured yet
    slow = (1000, 4.0 * PREFILL_SECONDS)                                # 250 tokens a second
    assert s.prefill_budget(0, 1, 2048, slow) == 250
    assert s.prefill_budget(2, 3, 2048, slow) == 200                    # two rows free, 100 each
    assert s.prefill_budget(0, 1, 2048, (1000, 0.01 * PREFILL_SECONDS)) == 2048    # fast
    assert s.prefill_budget(0, 1, 2048, (10, 10.0)) == MIN_PREFILL      # at least a few


LONG_TEXT = "the quick brown fox jumps over the lazy dog, and then it runs away. " * 40


def test_a_prompt_cancelled_mid_prefill_is_resumed_by_its_retry_exactly(pipe):
    """An agent whose request timed out during a long prefill sends it again: what was
    prefilled went to the prefix cache, the retry resumes there, and its text is the text."""
    from dflash2_mlx.cache.prompt import PromptCache
    from dflash2_mlx.model.sampling import Sampling

    prompt = pipe.encode(LONG_TEXT, chat_template=False)
    assert len(prompt) > 300
    want = pipe.generate(prompt, max_tokens=12).tokens
    engine, cache = pipe.engine(2), PromptCache(4)
    greedy = Sampling(0.0, 1.0, 0)

    def add(state=None) -> int:
        return engine.add(pipe.request(engine, prompt, 12, greedy, BLOCK, lookup=False,
                                       stop_ids=pipe.stop_ids(), seed=0, state=state,
                                       keep_state=True))

    rid = add()
    engine.step(prefill_budget=len(prompt) // 3)            # a third of the prompt, then gone
    assert engine.waiting == 1 and engine.cancel(rid)
    cache.insert(engine.pop_state(rid))
    state, cached = cache.fetch(prompt)
    assert cached == len(prompt) // 3
    rid = add(state)
    tokens = []
    while engine.running or engine.waiting:
        tokens += [t for ev in engine.step() for t in ev.tokens]
    assert tokens == want
    assert engine.stats[rid].cached_tokens == cached


def test_a_client_that_leaves_mid_prefill_and_retries_resumes_from_the_cache(pipe):
    """An agent times out during a long prefill and sends the same request at once: the
    scheduler leaves the departed sequence (its prefill to the prefix cache) before it admits
    the retry, which then starts where the prefill stopped."""
    prompt = LONG_TEXT
    body = {"model": "llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    step = pipe.prefill_step_size

    async def clients(app, http, go):
        scheduler, gone, sent = app.state.scheduler, asyncio.Event(), []
        go.set()
        call = asgi_completion(app, {**body, "stream": True}, gone, sent)
        await _until(lambda: scheduler.batch_figures["prefilling"] == 1)
        await asyncio.sleep(0.3)                   # a few steps of the prefill
        gone.set()
        await asyncio.wait_for(call, 30)
        return await http.post("/v1/completions", json=body)

    pipe.prefill_step_size = 128                   # many steps: the client leaves among them
    try:
        retry = in_process(pipe, clients, context_length=8192)
    finally:
        pipe.prefill_step_size = step
    usage = retry.json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 1
    assert retry.json()["choices"][0]["text"] == pipe.generate(prompt, max_tokens=4,
                                                               chat_template=False).text
