"""Images on vision-language targets: tiny random-weight checkpoints of each family in the real
format (`vision_fixtures.write_vlm`), loaded by `dflash2_mlx.load` (mlx-lm's text model, mlx-vlm's
processor and tower). Greedy output with an image equals mlx-vlm's own `generate` on the same
rendered chat, token for token: plain, with a drafter and lookup, with a drafter double that
forces partial acceptance (rollback under Qwen's multimodal rope), and batched beside text-only
requests; seeded sampling is the same alone and batched; text-only requests equal mlx-lm's text
model. The prefix cache's keys tell images apart; the limits and refusals name what they
refuse."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (the `vision` extra)")

from mlx_lm.generate import generate_step  # noqa: E402

import vision_fixtures as vf  # noqa: E402
from dflash2_mlx.decode.engine import stream_tokens  # noqa: E402
from dflash2_mlx.decode.state import common_prefix  # noqa: E402
from dflash2_mlx.model.sampling import Sampling  # noqa: E402
from dflash2_mlx.model.vision import (KEY_BASE, ImageError, ImageLimits,  # noqa: E402
                                      open_images)
from dflash2_mlx.pair import load  # noqa: E402
from dflash2_mlx.pipeline import EXAMPLE_VLM  # noqa: E402
from dflash2_mlx.policy.adaptive import FixedWidth  # noqa: E402
from dflash2_mlx.policy.planner import Planner  # noqa: E402
from fixtures import drafter_args, write_drafter  # noqa: E402
from test_exactness import OracleDrafter  # noqa: E402

SERVED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "mistral3", "gemma3",
          "gemma4")
TEXT = "Describe this image."


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (target folder, drafter folder), written on first use."""
    made = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            folder = vf.write_vlm(root / "target", family, seed=0)
            text = json.loads((folder / "config.json").read_text())
            text = text.get("text_config", text)
            vocab, layers = text["vocab_size"], text["num_hidden_layers"]
            args = drafter_args(vocab_size=vocab, mask_token_id=vocab - 1,
                                num_target_layers=layers, layer_ids=(0, layers - 1),
                                hidden_size=text["hidden_size"])
            made[family] = folder, write_drafter(root / "drafter", args, seed=1,
                                                 dtype=mx.float32)
        return made[family]
    return get


def user_turn(n_images: int, text: str = TEXT) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images
             + [{"type": "text", "text": text}]}]


def mlx_vlm_greedy(folder, pipe, messages, images, n: int) -> list[int]:
    """mlx-vlm's own generation on the chat as our tokenizer renders it."""
    from mlx_vlm import generate
    from mlx_vlm import load as vlm_load

    model, processor = vlm_load(str(folder))
    text = pipe.tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    out = generate(model, processor, text, image=images, max_tokens=n, temperature=0.0,
                   verbose=False)
    return [int(t) for t in out.token_ids]


def until_stop(tokens: list[int], pipe) -> list[int]:
    stops = pipe.stop_ids()
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("family", SERVED)
def test_greedy_with_an_image_equals_mlx_vlm(folders, family):
    target, drafter = folders(family)
    image = vf.test_image(0)
    pipe = load(str(target), str(drafter))
    assert pipe.vision is not None and pipe.image_refusal() is None
    ref = mlx_vlm_greedy(target, pipe, user_turn(1), [image], 24)
    assert len(set(ref)) > 3, f"{family}: fixture too degenerate"
    for options in ({"block_size": 1, "lookup": False}, {"block_size": 5, "lookup": False},
                    {"block_size": 5, "lookup": True}, {"block_size": "auto"}):
        got = pipe.generate(TEXT, images=[image], max_tokens=24, **options).tokens
        assert got == until_stop(ref, pipe)[: len(got)] and len(got) >= min(24, len(
            until_stop(ref, pipe))), (family, options)
    # forced partial acceptance: every rollback under the image's positions
    ids, media = pipe.encode_images(user_turn(1), [image])
    truth = ref + [0] * 8
    oracle = OracleDrafter(len(ids), truth, pipe.adapter.vocab_size, seed=2)
    out = [t for s in stream_tokens(pipe.adapter, oracle, ids, max_tokens=len(ref),
                                    sampling=Sampling(), planner=Planner(),
                                    policy=FixedWidth(6), stop_ids=set(), media=media)
           for t in s]
    assert out == ref, family


@pytest.mark.parametrize("family", SERVED)
def test_images_batch_with_text_requests(folders, family):
    """Two image requests (different images) and a text-only one on one batch engine: each
    equals its own generation alone, greedy and seeded."""
    target, drafter = folders(family)
    pipe = load(str(target), str(drafter))
    prompts = [TEXT, "Write a short story.", "What is in the picture?"]
    images = [[vf.test_image(1)], [], [vf.test_image(2)]]
    for options in ({}, {"temperature": 1.0, "seed": 5}):
        alone = [pipe.generate(p, images=im, max_tokens=16, block_size=4,
                               **({**options, "seed": options["seed"] + i} if options
                                  else {})).tokens
                 for i, (p, im) in enumerate(zip(prompts, images))]
        batched = pipe.generate_batch(prompts, images=images, max_tokens=16, block_size=4,
                                      **options)
        assert [g.tokens for g in batched] == alone, (family, options)


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen3_5", "gemma3"))
def test_text_only_requests_equal_the_text_model(folders, family):
    from mlx_lm.utils import load as mlx_lm_load

    target, drafter = folders(family)
    pipe = load(str(target), str(drafter))
    model, tokenizer = mlx_lm_load(str(target))
    ids = pipe.encode("Write a short story.")
    ref = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=20):
        ref.append(int(tok))
    got = pipe.generate("Write a short story.", max_tokens=20, block_size=4).tokens
    assert got == until_stop(ref, pipe)[: len(got)], family


def test_image_keys_tell_images_apart(folders):
    target, _ = folders("qwen2_vl")
    pipe = load(str(target), None)
    a, b = vf.test_image(1), vf.test_image(2)
    one, _ = pipe.encode_images(user_turn(1), [a])
    same, _ = pipe.encode_images(user_turn(1), [a.copy()])
    other, media = pipe.encode_images(user_turn(1), [b])
    assert one == same
    first = int(media.image_rows.argmax())
    assert common_prefix(one, other) == first            # they part at the image's first row
    assert all(t >= KEY_BASE for t in other[first: first + int(media.image_rows.sum())])
    # two images: a changed second image keeps the first one's rows
    ab, _ = pipe.encode_images(user_turn(2), [a, b])
    aa, m2 = pipe.encode_images(user_turn(2), [a, a])
    runs = [i for i in range(1, len(ab)) if m2.image_rows[i] and not m2.image_rows[i - 1]]
    assert len(runs) == 2 and common_prefix(ab, aa) == runs[1]


def test_limits_and_refusals(folders, tmp_path):
    image = vf.test_image(0, (40, 30))
    png = tmp_path / "a.png"
    image.save(png)
    with pytest.raises(ImageError, match="max_images 1") as e:
        open_images([png, png], ImageLimits(images=1))
    assert e.value.status == 413
    with pytest.raises(ImageError, match="max_image_bytes 10") as e:
        open_images([png], ImageLimits(image_bytes=10))
    assert e.value.status == 413
    with pytest.raises(ImageError, match="40x30 = 1200 pixels, more than max_image_pixels 100"):
        open_images([png.read_bytes()], ImageLimits(pixels=100))
    with pytest.raises(ImageError, match=r"images\[0\]: not a readable image") as e:
        open_images([b"\x89PNG\r\n\x1a\nnot really"])
    assert e.value.status == 400
    assert open_images([png])[0].size == (40, 30)
    # a text-only target names a model that takes images
    from fixtures import write_target

    text_pipe = load(str(write_target(tmp_path / "text", "llama")), None)
    with pytest.raises(ValueError, match=f"text-only model and takes no images.*{EXAMPLE_VLM}"):
        text_pipe.generate("hi", images=[image], max_tokens=2)
    # a served family with a count mismatch; the families whose image rows we do not run
    target, _ = folders("qwen2_vl")
    with pytest.raises(ValueError, match="1 image part.*2 image"):
        load(str(target), None).encode_images(user_turn(1), [image, image])
    # a family mlx-vlm loads but whose image rows are not checked here: refused, named
    from types import SimpleNamespace

    from dflash2_mlx.model.vision import Vision

    pipe = load(str(target), None)
    pipe.vision = Vision(SimpleNamespace(config=SimpleNamespace(image_token_id=5)), None,
                         "llava", {})
    with pytest.raises(ValueError, match="images on llava targets are not served: its image "
                       "rows have not been checked.*served: gemma3, gemma4, mistral3"):
        pipe.generate(TEXT, images=[image], max_tokens=2)
    assert pipe.generate(TEXT, max_tokens=3).tokens               # text is still served
    pipe = load(str(target), None)
    pipe.stage = object()             # a pipeline-sharded target's stage: its images refused
    assert "pipeline-sharded" in pipe.image_refusal()


def test_memory_counts_the_tower_and_the_rows(folders):
    """A request's images count in the server's admission beside its caches (a budget with
    room for the caches but not for the tower's activations refuses it, saying so; the same
    prompt without them is admitted), in the budget's weights, and in `doctor --model`."""
    from dflash2_mlx.model import memory
    from dflash2_mlx.server.admission import ADMIT
    from dflash2_mlx.server.budget import MemoryBudget
    from dflash2_mlx.server.scheduler import GenerationRequest, Job, Scheduler

    target, _ = folders("qwen2_vl")
    pipe = load(str(target), None)
    ids, media = pipe.encode_images(user_turn(1), [vf.test_image(0)])
    assert media.transient_bytes > media.tower_bytes > 0
    whole = MemoryBudget(pipe)
    assert whole.weights >= memory.weights_bytes(pipe.target) + pipe.vision.weights_bytes > \
        memory.weights_bytes(pipe.target)
    tokens = len(ids) + 8
    limit = whole.weights + whole.need([tokens]) + media.transient_bytes // 2
    s = Scheduler(pipe, memory=MemoryBudget(pipe, limit))
    s._engine, s._decoding = s._new_engine(), {}      # as its worker thread sets them up
    why = s._room_for(Job(GenerationRequest(ids, 8, Sampling(), media=media), None))
    assert why != ADMIT and "its images need" in why and "--memory-budget" in why
    assert s._room_for(Job(GenerationRequest(ids, 8, Sampling()), None)) == ADMIT
    config = json.loads((target / "config.json").read_text())
    lines = memory.vision_lines(config, 4)
    assert lines[0].startswith("vision tower") and "while the tower runs" in lines[1]
    assert memory.vision_lines({"hidden_size": 8}, 4) == []


def test_bench_takes_a_vision_language_target(folders, tmp_path):
    """`dflash2-mlx bench` on a vision-language target (its text prompt sets), without a
    drafter (`--draft none`: mlx-lm against the lookup), writes its table."""
    from test_cli import run

    target, _ = folders("qwen3_5")
    out = run("bench", "--model", target, "--draft", "none", "--prompt-sets", "chat",
              "--prompts", 1, "--block-sizes", "auto", "--temperatures", 0, "--max-tokens", 4,
              "--no-reference", "--out", tmp_path / "b", check_rc=0)
    assert "| hybrid b=auto |" in out.stdout and "| mlx-lm |" in out.stdout


@pytest.mark.parametrize("family", ("qwen2_vl", "gemma3", "mistral3", "gemma4"))
def test_a_text_that_spells_an_image_marker_is_no_image(folders, family):
    """A text holding the family's image marker ("<|image_pad|>", "<start_of_image>", "[IMG]",
    ...: a file an agent read, a model's own output) in a request with an image: the processor
    places the one image, not more (it failed for want of a second)."""
    target, _ = folders(family)
    pipe = load(str(target), None)
    marks = [v for k, v in vars(pipe.vision.processor).items() if k.endswith("_token")
             and isinstance(v, str) and "image" in k]
    assert marks, family
    text = "This file says " + " and ".join(marks) + "."
    _, one = pipe.encode_images(user_turn(1), [vf.test_image(0)])
    _, media = pipe.encode_images(user_turn(1, text) + [
        {"role": "assistant", "content": text}, {"role": "user", "content": text}],
        [vf.test_image(0)])
    assert media.image_rows.sum() == one.image_rows.sum()
    assert pipe.generate(text, images=[vf.test_image(0)], max_tokens=2).tokens
