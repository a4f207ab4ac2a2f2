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
    if row.model_types[0].startswith("qwen3_5"):
        return {"model_type": row.model_types[0],
                "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"model_type": row.model_types[0] + "_text", **shape},
                "vision_config": {"depth": 27}}
    return {"model_type": row.model_types[0], **shape, "num_attention_heads": 32}


@pytest.mark.parametrize("row", TABLE, ids=[row.target for row in TABLE])
def test_each_row_is_found_from_its_targets_config(row, tmp_path):
    config = published_config(row)
    base = row.target.split("/")[1]
    for name in (row.target, f"mlx-community/{base}-4bit", f"/models/{base}-MLX-8bit"):
        choice = find(config, name)
        assert (choice.drafter, choice.row) == (row.drafter, row), name
        assert f"published for {row.target}, whose shape it has" in choice.why
    renamed = find(config, "me/my-finetune")                    # by shape, under another name
    assert renamed.drafter == row.drafter and "under another name" in renamed.why
    folder = tmp_path / base
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert choose(str(folder)).drafter == row.drafter           # a local folder's config.json
    assert row.block_size in (8, 10, 16) and row.card.startswith("https://")


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
