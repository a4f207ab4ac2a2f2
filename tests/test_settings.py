"""One validator per setting (`dflash2_mlx.settings`), and the errors users met before it:
each is one ValueError naming the argument, raised before anything runs."""

import math

import pytest

import dflash2_mlx
from dflash2_mlx import settings as check


@pytest.mark.parametrize("fn, bad", [
    (check.seed, -1), (check.seed, 2**64), (check.seed, 1.5), (check.seed, True),
    (check.temperature, math.inf), (check.temperature, math.nan), (check.temperature, -0.1),
    (check.temperature, "hot"), (check.top_p, 0), (check.top_p, math.nan), (check.top_k, -1),
    (check.max_tokens, 0), (check.block_size, True), (check.block_size, 0),
    (check.block_size, "eight"), (check.draft_bits, 3), (check.draft_group_size, 48),
    (check.dtype, "float8"), (check.prompt, 123), (check.prompt, ""), (check.prompt, [1, "a"]),
    (check.prompt, "caf\udce9"), (check.prompt, b"bytes"), (check.prompt, []),
])
def test_each_validator_refuses_and_names_the_setting(fn, bad):
    with pytest.raises(check.SettingError) as e:
        fn(bad, "the-name")
    assert str(e.value).startswith("the-name: ") and e.value.problem in str(e.value)


def test_validators_normalise():
    assert check.block_size("8") == 8 and check.block_size("auto") == "auto"
    assert check.block_size(None) is None and check.seed(2**64 - 1) == 2**64 - 1
    assert check.draft_bits("16") == 16 and check.dtype("bf16") == "bfloat16"
    assert check.prompt((1, 2)) == [1, 2] and check.temperature(1) == 1.0


@pytest.fixture(scope="module")
def pipe(llama_dir, dflash2_dir):
    return dflash2_mlx.load(str(llama_dir), str(dflash2_dir))


@pytest.mark.parametrize("options, words", [
    (dict(seed=-1), ["seed", "-1", "0..2**64-1"]),
    (dict(seed=2**70), ["seed", "0..2**64-1"]),
    (dict(block_size=True), ["block_size", "True"]),
    (dict(temperature=math.inf), ["temperature", "inf", "finite"]),
    (dict(prompt=123), ["prompt", "123", "string"]),
    (dict(prompt=""), ["prompt", "non-empty"]),
    (dict(prompt="caf\udce9"), ["prompt", "UTF-8"]),
    (dict(max_tokens=0), ["max_tokens", "0"]),
])
def test_api_errors_name_the_argument(pipe, options, words):
    """seed=-1 used to fail inside MLX with a TypeError; prompt=123 inside the tokenizer;
    block_size=True ran as width 1; temperature=inf sampled noise."""
    options = {"prompt": "hi", **options}
    with pytest.raises(ValueError) as e:
        pipe.generate(options.pop("prompt"), max_tokens=options.pop("max_tokens", 2), **options)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_omlx_uses_the_shared_validators():
    from dflash2_mlx.omlx import OmlxSettingsError, parse_entry

    for entry in ({"dflash_block_size": True}, {"dflash_draft_quant_group_size": 48}):
        with pytest.raises(OmlxSettingsError, match="is not allowed"):
            parse_entry(entry, "m")
    assert parse_entry({"dflash_block_size": 4}, "m").block_size == 4



def test_a_prompt_beyond_the_context_is_announced(llama_dir, capfd):
    """8.6k tokens into a model made for 8k: no note, minutes of silent prefill and a leaked
    transformers warning. Now: a DFlashNotice, a progress line, and no transformers line."""
    pipe = dflash2_mlx.load(str(llama_dir))
    lines = []
    pipe.progress = lines.append
    pipe.prefill_step_size = 1024
    assert pipe.context_length == 4096                 # the fixture's max_position_embeddings
    with pytest.warns(dflash2_mlx.DFlashNotice, match=r"more than the model's context of 4096"):
        gen = pipe.generate("hello world " * 470, max_tokens=1, chat_template=False)
    assert gen.stats.prompt_tokens > 4096
    (prefill,) = [line for line in lines if "prefill of" in line]  # (and auto's calibration)
    assert "chunks of 1024" in prefill
    n = gen.stats.prompt_tokens
    steps = [line for line in lines if line.startswith("prefill ") and "/" in line]
    assert steps == [f"prefill {d}/{n} prompt tokens ({100 * d // n}%)"
                     for d in (1024, 2048, 3072, 4096, n - 1)]
    assert "Token indices sequence length" not in capfd.readouterr().err
