"""One validator per setting (`dflash2_mlx.settings`), and the errors users met before it:
each is one ValueError naming the argument, raised before anything runs."""

import math

import pytest

import dflash2_mlx
from dflash2_mlx import settings as check
from dflash2_mlx.decode.state import DecodeState


@pytest.mark.parametrize("fn, bad", [
    (check.seed, -1), (check.seed, 2**64), (check.seed, 1.5), (check.seed, True),
    (check.temperature, math.inf), (check.temperature, math.nan), (check.temperature, -0.1),
    (check.temperature, "hot"), (check.top_p, 0), (check.top_p, math.nan), (check.top_k, -1),
    (check.max_tokens, 0), (check.block_size, True), (check.block_size, 0),
    (check.block_size, "eight"), (check.draft_bits, 3), (check.draft_group_size, 48),
    (check.kernels, "cuda"), (check.kernels, 1), (check.dtype, "float8"), (check.prompt, 123), (check.prompt, ""), (check.prompt, [1, "a"]),
    (check.prompt, "caf\udce9"), (check.prompt, b"bytes"), (check.prompt, []),
    (check.port, -1), (check.port, 65536), (check.port, "80"), (check.context_length, 1),
    (check.max_body_bytes, 1023), (check.queue_size, 0), (check.prompt_cache_size, -1),
    (check.prompt_cache_bytes, -1), (check.shutdown_timeout, -0.5),
    (check.shutdown_timeout, math.inf), (check.pipeline_timeout, 0.5),
    (check.prompts_per_set, 0), (check.prompts_per_set, 165), (check.max_tokens, True),
])
def test_each_validator_refuses_and_names_the_setting(fn, bad):
    with pytest.raises(check.SettingError) as e:
        fn(bad, "the-name")
    assert str(e.value).startswith("the-name: ") and e.value.problem in str(e.value)


def test_validators_normalise():
    assert check.block_size("8") == 8 and check.block_size("auto") == "auto"
    assert check.block_size(None) is None and check.seed(2**64 - 1) == 2**64 - 1
    assert check.draft_bits("16") == 16 and check.dtype("bf16") == "bfloat16"
    assert check.kernels("ops") == "stock" and check.kernels(None) is None
    assert check.prompt((1, 2)) == [1, 2] and check.temperature(1) == 1.0
    assert check.port(0) == 0 and check.prompt_cache_size(0) == 0
    assert check.shutdown_timeout(0) == 0.0 and check.prompts_per_set(164) == 164


def test_one_validator_for_cli_api_and_server():
    """The CLI's typer bounds, the server's pydantic bounds and the API each checked `seed`,
    `max_tokens` and the server's limits their own way; now all call `settings`, so they agree
    on what is allowed and on the words."""
    import typer

    from dflash2_mlx.cli.common import flag

    server = pytest.importorskip("dflash2_mlx.server")      # the serve extra

    with pytest.raises(typer.BadParameter, match=r"-1 is not an integer in 0\.\.2\*\*64-1"):
        flag(check.seed)(-1)
    with pytest.raises(check.SettingError, match=r"^queue_size: 0 is not an integer >= 1"):
        server.ServerConfig("m", queue_size=0)        # 0 made the queue unbounded
    with pytest.raises(check.SettingError, match=r"^block_size: 'eight'"):
        server.ServerConfig("m", block_size="eight")
    for field, bad, validator in (("seed", -1, check.seed), ("max_tokens", 0, check.max_tokens),
                                  ("temperature", -1.0, check.temperature),
                                  ("top_k", -1, check.top_k)):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: bad}
        with pytest.raises(pytest.importorskip("pydantic").ValidationError) as e:
            server.ChatRequest.model_validate(body)
        with pytest.raises(check.SettingError) as want:
            validator(bad)
        err = server.validation_error(e.value)
        assert (err.status, err.param, err.message) == (400, field,
                                                        f"{field}: {want.value.problem}")


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
    from dflash2_mlx.loading.omlx import OmlxSettingsError, parse_entry

    for entry in ({"dflash_block_size": True}, {"dflash_draft_quant_group_size": 48}):
        with pytest.raises(OmlxSettingsError, match="is not allowed"):
            parse_entry(entry, "m")
    assert parse_entry({"dflash_block_size": 4}, "m").block_size == 4



class _Bar:
    """A stand-in for `log.progress`: records where a bar moved by hand went."""

    def __init__(self, items, desc, total=None, unit="it"):
        self.items, self.desc, self.total, self.unit = items, desc, total, unit
        self.at, self.closed = [], False
        bars.append(self)

    def __iter__(self):
        return iter(self.items)

    def update(self, n):
        self.at.append((self.at[-1] if self.at else 0) + n)

    def set_postfix_str(self, text, refresh=True):     # the calibration shows its spread
        pass

    def close(self):
        self.closed = True


bars: list[_Bar] = []


@pytest.mark.slow  # 10 s: a prefill past 4,096 tokens
def test_a_prompt_beyond_the_context_is_announced(llama_dir, capfd, caplog, monkeypatch):
    """8.6k tokens into a model made for 8k: no note, minutes of silent prefill and a leaked
    transformers warning. Now: a DFlashNotice, a logged line, a progress bar over the chunks,
    and no transformers line."""
    from dflash2_mlx import log

    pipe = dflash2_mlx.load(str(llama_dir))
    pipe.prefill_step_size = 1024
    assert pipe.context_length == 4096                 # the fixture's max_position_embeddings
    caplog.set_level("INFO", logger="dflash2_mlx")
    monkeypatch.setattr(log, "progress", _Bar)
    bars.clear()
    state = DecodeState.new(pipe.adapter, pipe.drafter)
    with pytest.warns(dflash2_mlx.DFlashNotice, match=r"more than the model's context of 4096"):
        gen = pipe.generate("hello world " * 470, max_tokens=1, chat_template=False,
                            state=state)
    assert gen.stats.prompt_tokens > 4096
    (prefill,) = [m for m in caplog.messages if "prefill of" in m]  # (and auto's calibration)
    assert "chunks of 1024" in prefill
    n = gen.stats.prompt_tokens
    (bar,) = [b for b in bars if b.desc == "prefill"]
    assert (bar.total, bar.unit, bar.closed) == (n, "tok", True)
    assert bar.at == [1024, 2048, 3072, 4096, n - 1]
    assert "Token indices sequence length" not in capfd.readouterr().err
    # the same prompt again from the state that holds it: nothing to prefill, no such line
    caplog.clear()
    with pytest.warns(dflash2_mlx.DFlashNotice):
        pipe.generate("hello world " * 470, max_tokens=1, chat_template=False, state=state)
    assert not [m for m in caplog.messages if "prefill of" in m]
