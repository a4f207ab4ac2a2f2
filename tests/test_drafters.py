"""The published drafter of a target (`loading.drafters`): every row of the table is found from
a config.json shaped like its target's published one, under the names people download it by;
another shape finds none; a drafter that does not fit its target is an error naming both."""

import json

import pytest

import dflash2_mlx
from dflash2_mlx.loading import drafters
from dflash2_mlx.loading.drafters import TABLE, Shape, choose, find
from dflash2_mlx.model.config import CheckpointError
from fixtures import VOCAB, drafter_args, write_drafter


def published_config(row: drafters.Published) -> dict:
    """A config.json laid out as the row's target publishes it: Qwen3.5's text model under
    `text_config` (a multimodal checkpoint), the others flat."""
    shape = {"hidden_size": row.hidden_size, "vocab_size": row.vocab_size,
             "num_hidden_layers": row.num_layers}
    if row.model_types[0].startswith(("qwen3_5", "gemma4")):      # multimodal checkpoints
        return {"model_type": row.model_types[0], "architectures": ["ForConditionalGeneration"],
                "text_config": {"model_type": row.model_types[0] + "_text", **shape},
                "vision_config": {"depth": 27}}
    return {"model_type": row.model_types[0], **shape, "num_attention_heads": 32}


TARGETS = sorted({row.target for row in TABLE})


def preferred(target: str) -> drafters.Published:
    """The drafter of `target` the table's rule picks: DFlash 2, else DSpark, else DFlash."""
    rows = [row for row in TABLE if row.target == target]
    for kind in (drafters.DFLASH2, drafters.DSPARK, drafters.DFLASH):
        if any(row.kind == kind for row in rows):
            return next(row for row in rows if row.kind == kind)
    raise AssertionError(f"{target}: a row of no known kind")


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_finds_its_preferred_drafter_from_its_config(target, tmp_path):
    row = preferred(target)
    config = published_config(row)
    base = row.target.split("/")[1]
    for name in (row.target, f"mlx-community/{base}-4bit", f"/models/{base}-MLX-8bit"):
        choice = find(config, name)
        assert (choice.drafter, choice.row) == (row.drafter, row), name
        assert f"{row.kind}, published for {row.target}, whose shape it has" in choice.why
    renamed = find(config, "me/my-finetune")      # by shape, under another name: the first
    first = next(r for r in TABLE if r.fits(Shape.of(config)))     # target of that shape
    assert renamed.drafter == preferred(first.target).drafter
    assert "under another name" in renamed.why
    folder = tmp_path / base
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert choose(str(folder)).drafter == row.drafter           # a local folder's config.json


def test_every_row_says_its_kind_block_and_card():
    assert {row.kind for row in TABLE} == {drafters.DFLASH, drafters.DFLASH2, drafters.DSPARK}
    for row in TABLE:
        assert row.block_size in (7, 8, 9, 10, 15, 16) and row.card.startswith("https://"), row
    assert len({(row.target, row.drafter) for row in TABLE}) == len(TABLE)


def test_one_targets_drafters_in_the_rules_order():
    """Qwen3.8-27B: DFlash 2 over DSpark (measured); Qwen3-8B: DSpark over DFlash."""
    assert find(published_config(preferred("Qwen/Qwen3.8-27B")), "Qwen3.8-27B-4bit").drafter \
        == "incoai/Qwen3.8-27B-DFlash2"
    assert find(published_config(preferred("Qwen/Qwen3-8B")), "Qwen/Qwen3-8B").drafter \
        == "deepseek-ai/dspark_qwen3_8b_block7"
    qwen35 = published_config(preferred("Qwen/Qwen3.5-27B"))        # one shape, three targets
    assert find(qwen35, "Qwen3.6-27B-8bit").drafter == "satgeze/Qwen3.6-27B-DSpark"
    assert find(qwen35, "Qwen3.5-27B-8bit").drafter == "z-lab/Qwen3.5-27B-DFlash"


@pytest.mark.parametrize("change", [
    {"hidden_size": 1024}, {"vocab_size": 32000}, {"num_hidden_layers": 28},
    {"model_type": "mistral"},
])
def test_another_shape_finds_none(change):
    for row in TABLE:
        config = published_config(row)
        where = config if "model_type" in change else config.get("text_config", config)
        where.update(change)
        choice = find(config, row.target)          # its name alone does not make it a match
        assert choice.drafter is None and "no published drafter" in choice.why, row.target


def test_a_config_without_the_fields_or_a_gguf_finds_none():
    assert find({"model_type": "qwen3"}).drafter is None
    assert "lacks model_type" in find({"hidden_size": 4096}).why
    assert "no config.json to match" in choose("model.Q4_K_M.gguf").why
    assert Shape.of({"model_type": "qwen3", "hidden_size": True, "vocab_size": 5,
                     "num_hidden_layers": 2}) is None


def test_load_without_draft_looks_up_and_none_skips(llama_dir):
    pipe = dflash2_mlx.load(str(llama_dir))              # the tiny llama: no row has its shape
    assert pipe.drafter is None and "no published drafter" in pipe.info["draft_why"]
    assert "llama, hidden size 64" in pipe.info["draft_why"]
    none = dflash2_mlx.load(str(llama_dir), "none")
    assert none.drafter is None and none.info["draft_why"] == "--draft none"


def test_a_drafter_that_does_not_fit_names_both(llama_dir, tmp_path):
    wide = write_drafter(tmp_path / "wide", drafter_args(vocab_size=VOCAB + 16,
                                                         mask_token_id=VOCAB))
    with pytest.raises(CheckpointError) as e:
        dflash2_mlx.load(str(llama_dir), str(wide))
    message = str(e.value)
    assert str(wide / "config.json") in message and f"target model '{llama_dir}'" in message
    assert f"'vocab_size' is {VOCAB + 16}" in message and f"{VOCAB} entries" in message


def test_the_start_line_says_why_there_is_no_drafter(llama_dir, capsys):
    from dflash2_mlx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(llama_dir), "--max-tokens", "2", "--block-size", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert ("note: no drafter (no published drafter in the table serves its shape (llama, "
            "hidden size 64, vocabulary 384, 4 layers)): lookup drafting from the context only"
            ) in err
