"""The published drafter of a target: a table of the DFlash, DFlash 2 and DSpark drafters their
publishers list, matched on the target's own config.json (family, hidden size, vocabulary,
layer count), so a quantized or renamed copy of a target finds its drafter and a look-alike name
does not.

Each row comes from the publisher's model card or README (`card`); the target's fields from the
target's published config.json. Several targets may share a shape (a family's versions do): the
target the model's id names wins, else the first in the table. One target may have several
drafters: the kind `PREFERENCE` puts first wins (`--draft` picks another).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

NONE = "none"              # --draft none / draft="none": no drafter, and no look-up
ZLAB = "https://github.com/z-lab/dflash#supported-models"
DEEPSPEC = "https://github.com/deepseek-ai/DeepSpec#released-checkpoints"
DFLASH, DFLASH2, DSPARK = "DFlash", "DFlash 2", "DSpark"
# Among one target's drafters: DFlash 2 over DSpark (Qwen3.8-27B on an M-series Mac, 3.79x vs
# 3.74x at 8 bits, 2.72x vs 2.63x at 4), DSpark over DFlash (every M-series head-to-head):
# mlx-dspark 0.20.3's measurements (docs/decisions.md). No publisher reports acceptance for
# both kinds on one target.
PREFERENCE = (DFLASH2, DSPARK, DFLASH)


@dataclass(frozen=True)
class Published:
    """One published drafter and the target shape it serves."""

    target: str                     # the target it was trained for, as its card names it
    model_types: tuple[str, ...]    # mlx-lm `model_type`s of that target
    hidden_size: int
    vocab_size: int
    num_layers: int
    drafter: str                    # Hugging Face repository
    block_size: int
    card: str                       # where the row comes from
    note: str = ""
    kind: str = DFLASH

    def fits(self, shape: "Shape") -> bool:
        return (shape.model_type in self.model_types and shape.hidden_size == self.hidden_size
                and shape.vocab_size == self.vocab_size and shape.num_layers == self.num_layers)

    def named_by(self, model: str) -> bool:
        """The model's id or folder names this row's target ("Qwen3-8B" in
        "mlx-community/Qwen3-8B-4bit"), ignoring case and the organization."""
        base = self.target.rsplit("/", 1)[-1].lower()
        name = Path(str(model).rstrip("/")).name.lower()
        return name == base or name.startswith((base + "-", base + "_", base + "."))


# Rows: z-lab's README table (`ZLAB`), DeepSpec's released checkpoints (`DEEPSPEC`) and the
# drafters' model cards. Block sizes: the "-b16" names; Qwen3.5's from the README's own serving
# examples (15 speculative tokens = block 16 for Qwen3.5-27B, 16 draft tokens for
# Qwen3.5-35B-A3B); LLaMA3.1's from its card (9 speculative tokens = block 10); the DSpark
# drafters' from their config.json (`block_size`; a DSpark block predicts from its first slot
# on, so its widest verify is one more). Target fields: the targets' published config.json
# (Qwen3.5's and Qwen3.6's under `text_config`). The published drafters not here, and why:
# docs/cli.md.
QWEN3 = ("qwen3",)
TABLE: tuple[Published, ...] = (
    Published("Qwen/Qwen3-4B", QWEN3, 2560, 151936, 36, "z-lab/Qwen3-4B-DFlash-b16", 16,
              "https://huggingface.co/z-lab/Qwen3-4B-DFlash-b16",
              "trained without thinking traces: best with thinking off"),
    Published("Qwen/Qwen3-4B", QWEN3, 2560, 151936, 36, "deepseek-ai/dspark_qwen3_4b_block7", 7,
              DEEPSPEC, kind=DSPARK),
    Published("Qwen/Qwen3-4B", QWEN3, 2560, 151936, 36, "deepseek-ai/dflash_qwen3_4b_block7", 7,
              DEEPSPEC, "DeepSpec's packaging, without the DSpark heads"),
    Published("Qwen/Qwen3-8B", QWEN3, 4096, 151936, 36, "z-lab/Qwen3-8B-DFlash-b16", 16,
              "https://huggingface.co/z-lab/Qwen3-8B-DFlash-b16",
              "trained without thinking traces: best with thinking off"),
    Published("Qwen/Qwen3-8B", QWEN3, 4096, 151936, 36, "deepseek-ai/dspark_qwen3_8b_block7", 7,
              DEEPSPEC, kind=DSPARK),
    Published("Qwen/Qwen3-8B", QWEN3, 4096, 151936, 36, "deepseek-ai/dflash_qwen3_8b_block7", 7,
              DEEPSPEC, "DeepSpec's packaging, without the DSpark heads"),
    Published("Qwen/Qwen3-14B", QWEN3, 5120, 151936, 40, "deepseek-ai/dspark_qwen3_14b_block7",
              7, DEEPSPEC, kind=DSPARK),
    Published("Qwen/Qwen3-14B", QWEN3, 5120, 151936, 40, "deepseek-ai/dflash_qwen3_14b_block7",
              7, DEEPSPEC, "DeepSpec's packaging, without the DSpark heads"),
    Published("meta-llama/Llama-3.1-8B-Instruct", ("llama",), 4096, 128256, 32,
              "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", 10,
              "https://huggingface.co/z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    Published("openbmb/MiniCPM5-2B", ("llama",), 2048, 130560, 42, "openbmb/MiniCPM5-2B-DSpark",
              7, "https://huggingface.co/openbmb/MiniCPM5-2B-DSpark",
              "the target's embedding and head", kind=DSPARK),
    Published("Qwen/Qwen3.5-27B", ("qwen3_5",), 5120, 248320, 64, "z-lab/Qwen3.5-27B-DFlash", 16,
              "https://huggingface.co/z-lab/Qwen3.5-27B-DFlash"),
    Published("Qwen/Qwen3.6-27B", ("qwen3_5",), 5120, 248320, 64, "satgeze/Qwen3.6-27B-DSpark",
              15, "https://huggingface.co/satgeze/Qwen3.6-27B-DSpark", kind=DSPARK),
    Published("Qwen/Qwen3.8-27B", ("qwen3_5",), 5120, 248320, 64, "incoai/Qwen3.8-27B-DFlash2",
              8, "https://huggingface.co/incoai/Qwen3.8-27B-DFlash2",
              "z-lab/Qwen3.8-27B-DFlash2 mirrors it", kind=DFLASH2),
    Published("Qwen/Qwen3.8-27B", ("qwen3_5",), 5120, 248320, 64,
              "RedHatAI/Qwen3.8-27B-speculator.dspark", 8,
              "https://huggingface.co/RedHatAI/Qwen3.8-27B-speculator.dspark",
              "vLLM speculators' packaging: a causal sliding-window block, the target's "
              "embedding and head", kind=DSPARK),
    Published("Qwen/Qwen3.8-27B", ("qwen3_5",), 5120, 248320, 64, "RadixArk/Qwen3.8-27B-DSpark",
              7, "https://huggingface.co/RadixArk/Qwen3.8-27B-DSpark",
              "SpecForge's packaging, YaRN rope", kind=DSPARK),
    Published("Qwen/Qwen3.5-35B-A3B", ("qwen3_5_moe",), 2048, 248320, 40,
              "z-lab/Qwen3.5-35B-A3B-DFlash", 16,
              "https://huggingface.co/z-lab/Qwen3.5-35B-A3B-DFlash"),
    Published("Qwen/Qwen3.6-35B-A3B", ("qwen3_5_moe",), 2048, 248320, 40,
              "incoai/Qwen3.6-35B-A3B-DFlash2", 8,
              "https://huggingface.co/incoai/Qwen3.6-35B-A3B-DFlash2", kind=DFLASH2),
    Published("Qwen/Qwen3.6-35B-A3B", ("qwen3_5_moe",), 2048, 248320, 40,
              "RedHatAI/Qwen3.6-35B-A3B-speculator.dspark", 8,
              "https://huggingface.co/RedHatAI/Qwen3.6-35B-A3B-speculator.dspark",
              "vLLM speculators' packaging", kind=DSPARK),
    Published("google/gemma-4-26B-A4B-it", ("gemma4",), 2816, 262144, 30,
              "makora-ai/gemma4-26b-a4b-dspark", 7,
              "https://huggingface.co/makora-ai/gemma4-26b-a4b-dspark",
              "vLLM speculators' packaging, a draft vocabulary of 32000", kind=DSPARK),
    Published("LiquidAI/LFM2.5-1.2B-Instruct", ("lfm2",), 2048, 65536, 16,
              "LiquidAI/LFM2.5-1.2B-Instruct-DSpark", 9,
              "https://huggingface.co/LiquidAI/LFM2.5-1.2B-Instruct-DSpark",
              "LiquidAI's packaging, the target's embedding and head", kind=DSPARK),
    Published("LiquidAI/LFM2.5-2.6B", ("lfm2",), 2048, 128000, 30, "LiquidAI/LFM2.5-2.6B-DSpark",
              9, "https://huggingface.co/LiquidAI/LFM2.5-2.6B-DSpark",
              "LiquidAI's packaging, the target's embedding and head", kind=DSPARK),
    Published("LiquidAI/LFM2.5-8B-A1B", ("lfm2_moe",), 2048, 128000, 24,
              "LiquidAI/LFM2.5-8B-A1B-DSpark", 9,
              "https://huggingface.co/LiquidAI/LFM2.5-8B-A1B-DSpark",
              "LiquidAI's packaging, the target's embedding and head", kind=DSPARK),
    Published("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B", ("nemotron_h",), 2688, 131072, 52,
              "mlx-community/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-DSpark-bf16", 8,
              "https://huggingface.co/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-NVFP4-DSpark",
              "a bf16 copy of NVIDIA's head (whose NVFP4 weights are not read): a causal "
              "sliding-window block with attention sinks, the target's head", kind=DSPARK),
    Published("Nanbeige/Nanbeige4.2-3B", ("nanbeige",), 3072, 166144, 22,
              "Nanbeige/Nanbeige4.2-3B-DSpark", 7,
              "https://huggingface.co/Nanbeige/Nanbeige4.2-3B-DSpark",
              "SpecForge's packaging, the target's embedding and head; its layer ids count "
              "the twice-run stack's 44 steps", kind=DSPARK),
)


@dataclass(frozen=True)
class Shape:
    """What a drafter must agree with, read from a target's config.json."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, config: dict) -> "Shape | None":
        """The shape of a config (a multimodal one's text model: `text_config`); None when a
        field is missing."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

        def field(key):
            value = text.get(key, config.get(key))
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        values = [field(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers")]
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or None in values:
            return None
        return cls(model_type, *values)

    def __str__(self) -> str:
        return (f"{self.model_type}, hidden size {self.hidden_size}, vocabulary "
                f"{self.vocab_size}, {self.num_layers} layers")


@dataclass(frozen=True)
class Choice:
    """The drafter a look-up chose (None: none) and why, in words for the start line."""

    drafter: str | None
    why: str
    row: Published | None = None


def find(config: dict, model: str = "", table: tuple[Published, ...] = TABLE) -> Choice:
    """The published drafter for a target with this config.json (`model`: its id or folder,
    which breaks ties between rows of one shape)."""
    shape = Shape.of(config)
    if shape is None:
        return Choice(None, "its config.json lacks model_type, hidden_size, vocab_size or "
                      "num_hidden_layers")
    rows = [row for row in table if row.fits(shape)]
    if not rows:
        return Choice(None, f"no published drafter in the table serves its shape ({shape})")
    named = [row for row in rows if row.named_by(model)]
    target = (named or rows)[0].target
    row = min((r for r in rows if r.target == target), key=lambda r: PREFERENCE.index(r.kind))
    how = (f"{row.kind}, published for {row.target}, whose shape it has ({shape})" if named else
           f"{row.kind}, published for {row.target}; the target has its shape ({shape}) under "
           "another name")
    return Choice(row.drafter, how, row)


def target_config(model: str) -> tuple[dict, str]:
    """(config.json of target `model`, where it was read): a local folder's, else the Hub's
    (that one file; `hub.HubError` when it cannot be had)."""
    path = Path(model).expanduser()
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"target model '{model}': no config.json in {path}")
    else:
        from .checkpoint import is_hub_id
        from .hub import file as hub_file

        if path.exists():
            raise FileNotFoundError(f"target model '{model}': expected an mlx-lm model folder "
                                    "or a .gguf file")
        if not is_hub_id(str(model)):
            raise FileNotFoundError(f"target model '{model}': no such file or folder")
        file = hub_file(str(model), "config.json", "target model")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not a readable config.json ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config, str(file)


def choose(model: str) -> Choice:
    """The published drafter for target `model` (a folder or Hub id; only its config.json is
    read). A .gguf file has no config.json to match: none."""
    if str(model).endswith(".gguf"):
        return Choice(None, "a .gguf target has no config.json to match (pass --draft)")
    config, _ = target_config(model)
    return find(config, model)
