"""Random-weight checkpoints in the real formats, for the tests and the benchmarks.

- targets: tiny mlx-lm model folders (config.json, model.safetensors, tokenizer.json + config),
  with a small byte-level BPE tokenizer trained here;
- drafters: DFlash / DFlash 2 folders in the published layout (BF16 safetensors,
  `dflash_config`, bare selector codebook tensors): tiny ones for the tiny targets
  (`drafter_args`), and ones shaped for the embedded SmolLM2-135M-Instruct target
  (`smollm2_drafter_args`).

Not imported by the package itself; needs `tokenizers` (a dependency) for the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash2_mlx.model.config import DFLASH, DFLASH2, DSPARK, DrafterArgs
from dflash2_mlx.model.drafter import Drafter, DraftVocab
from dflash2_mlx.loading.checkpoint import save_drafter

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Hello! How can I help you today? I am a small assistant.",
    "import math\nprint(math.sqrt(2))\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 384
HIDDEN = 64
TARGET_LAYERS = 4
# A DFlash 2 drafter for SmolLM2-135M-Instruct (30 layers, hidden 576, vocabulary 49,152):
# block 8, the features of 5 target layers spread over its depth.
SMOLLM2_DRAFTER = dict(hidden_size=576, vocab_size=49152, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                       layer_ids=(1, 8, 15, 22, 29), mask_token_id=0, num_target_layers=30,
                       block_size=8)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}))


def target_config(family: str, **overrides) -> dict:
    cfg = {"model_type": family, "hidden_size": HIDDEN, "num_hidden_layers": TARGET_LAYERS,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 4096,
           "rope_theta": 10000.0, "tie_word_embeddings": False,
           "eos_token_id": 2}
    if family in ("qwen3", "qwen2"):
        cfg["head_dim"] = 16
    cfg.update(overrides)
    return cfg


def write_target(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """An mlx-lm model folder with random weights (scaled up so greedy output varies)."""
    from mlx_lm.utils import _get_classes

    folder.mkdir(parents=True, exist_ok=True)
    cfg = target_config(family, **overrides)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    # Untied head and larger embeddings: a random model whose greedy output varies (a tied
    # random model mostly repeats its input token).
    params = dict(tree_flatten(model.parameters()))
    params = {k: (v * 4 if "embed_tokens" in k else v) for k, v in params.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), params)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(folder)
    return folder


# --------------------------------------------------------------------------- a tool caller

TOOL_CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
TOOL_SEEN = "<|tool_seen|>"        # ends the generation prompt after a tool result (`reply`)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% set tool_call = tool_call.function %}<tool_call>{\"name\":\"{{ tool_call.name }}\","
    "\"arguments\":{{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_REPLY_PROMPT = ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if messages[-1]['role'] == 'tool' %}" + TOOL_SEEN + "{% endif %}{% endif %}")


def write_tool_target(folder: Path, call: str = TOOL_CALL, reply: str | None = None,
                      **overrides) -> Path:
    """A llama whose greedy answer to any chat prompt is `<tool_call>call</tool_call>` then
    <|im_end|>; with `reply`, a prompt whose last message is a tool result is answered `reply`
    instead (an agent's tool round trip ends). Every layer adds nothing (o_proj, down_proj
    zero), so the next token depends on the current one only, and the head maps a chain of
    tokens one to the next. overrides: the config's (e.g. one layer and head for long
    prompts)."""
    from tokenizers import Tokenizer

    write_target(folder, "llama", seed=5, **overrides)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<tool_call>", "</tool_call>", call] + ([TOOL_SEEN, reply] if reply else []))
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (TOOL_TEMPLATE if reply is None else
                            TOOL_TEMPLATE.replace(TOOL_TEMPLATE[TOOL_TEMPLATE.index(
                                "{% if add_generation_prompt %}"):], _REPLY_PROMPT))
    cfg["model_max_length"] = overrides.get("max_position_embeddings", 4096)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))

    newline = tok.encode("<|im_start|>assistant\n").ids[-1]   # every chat prompt ends so
    links = _chain(tok, ["<tool_call>", call, "</tool_call>", "<|im_end|>"], newline)
    if reply:
        links += _chain(tok, [reply, "<|im_end|>"], tok.token_to_id(TOOL_SEEN))
    _wire(folder, links)
    return folder


def _chain(tok, tokens: list[str], start: int) -> list[tuple[int, int]]:
    """(token, next token) pairs: `start`, then `tokens` in order."""
    ids = [start] + [tok.token_to_id(t) for t in tokens]
    return list(zip(ids[:-1], ids[1:]))


def _wire(folder: Path, links: list[tuple[int, int]]) -> None:
    """The target's weights rewired so that greedy decoding follows `links`: every layer adds
    nothing (o_proj, down_proj zero), so the next token depends on the current one only, and
    the head maps each link's token to its next (one embedding dimension per link)."""
    w = dict(mx.load(str(folder / "model.safetensors")))
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = mx.zeros_like(w[k])
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    dims = len(links)
    head = head * (mx.arange(head.shape[1]) >= dims)        # no other token reads these dims
    for d, (src, dst) in enumerate(links):
        one = (mx.arange(embed.shape[1]) == d).astype(embed.dtype)
        embed[src] = one * 4.0
        head[dst] = head[dst] + one * 10.0            # <|im_end|> ends several chains
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    mx.save_safetensors(str(folder / "model.safetensors"), w)


# --------------------------------------------------------------------------- a thinker

REASONING = "\nThe user greets me. A short greeting back will do.\n"
ANSWER = "\n\nHello! How can I help?"
# Qwen3's template in small: earlier turns' reasoning is dropped (kept after the last user
# query: a tool round trip), an assistant turn's `reasoning_content` (or a <think> block in
# its content) is what it renders, tool results are user turns; the generation prompt opens
# the think block (Qwen3.5's) unless enable_thinking is false, which writes an empty one.
THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}Tools:\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}Call one as <tool_call>{...}</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{% set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{% for message in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}"
    "{% if ns.multi_step_tool and message.role == 'user' %}"
    "{% set ns.multi_step_tool = false %}{% set ns.last_query_index = index %}"
    "{% endif %}{% endfor %}"
    "{% for message in messages %}{% set content = message.content or '' %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}{% set reasoning_content = '' %}"
    "{% if message.reasoning_content is string %}"
    "{% set reasoning_content = message.reasoning_content %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning_content = content.split('</think>')[0].rstrip('\n')"
    ".split('<think>')[-1].lstrip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query_index and reasoning_content %}"
    "<think>\n{{ reasoning_content.strip('\n') }}\n</think>\n\n{% endif %}"
    "{{ content.lstrip('\n') }}"
    "{% for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    "<tool_call>{\"name\":\"{{ tool_call.name }}\",\"arguments\":"
    "{{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ content }}\n"
    "</tool_response><|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    "{% else %}<think>{% endif %}"
    "{% if messages[-1].role == 'tool' %}" + TOOL_SEEN + "{% endif %}{% endif %}"
)


def write_thinking_target(folder: Path, reasoning: str = REASONING, answer: str = ANSWER,
                          call: str | None = None, reply: str | None = None,
                          family: str = "llama", **overrides) -> Path:
    """A llama with a thinking tokenizer (`<think>`, `</think>`) and a Qwen3-like template
    (`THINK_TEMPLATE`), wired as `write_tool_target`'s: after the `<think>` that ends its
    generation prompt it writes `reasoning`, `</think>`, `answer`, then with `call`
    `<tool_call>call</tool_call>`, then <|im_end|>; thinking off (the prompt ends `</think>`),
    `answer` alone. With `reply`, a prompt whose last message is a tool result is answered
    `reply` (one token, whatever it holds: `</think>` in it ends its reasoning). Another
    `family` (with its config in `overrides`) keeps its random weights: the tokenizer and
    template only."""
    from tokenizers import Tokenizer

    write_target(folder, family, seed=6, **overrides)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = ["<think>", "</think>", "<tool_call>", "</tool_call>", reasoning, answer]
    tok.add_tokens(words + ([call] if call else []) + ([TOOL_SEEN, reply] if reply else []))
    tok.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINK_TEMPLATE
    cfg["model_max_length"] = overrides.get("max_position_embeddings", 4096)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if family != "llama":
        return folder
    tail = ["<tool_call>", call, "</tool_call>"] if call else []
    links = _chain(tok, [reasoning, "</think>", answer, *tail, "<|im_end|>"],
                   tok.token_to_id("<think>"))
    if reply:
        links += _chain(tok, [reply, "<|im_end|>"], tok.token_to_id(TOOL_SEEN))
    _wire(folder, links)
    return folder


def drafter_args(*, dflash2: bool = True, dspark: bool = False, block_size: int = 16,
                 layer_ids=(0, 2), layers: int = 2, **overrides) -> DrafterArgs:
    """A tiny drafter for the tiny targets: DFlash 2 (default), DFlash (dflash2=False) or, with
    `dspark`, a DSpark drafter in DeepSpec's layout: its own embedding and head, a Markov head
    of rank 16 and a confidence head reading it, predicting from the anchor's slot."""
    base = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=VOCAB,
                block_size=block_size, target_layer_ids=tuple(layer_ids), mask_token_id=VOCAB - 1,
                rms_norm_eps=1e-6, rope_theta=1e6, layer_types=("full_attention",) * layers,
                num_target_layers=TARGET_LAYERS, architecture=DFLASH2 if dflash2 else DFLASH)
    if dspark:
        dflash2 = False
        base.update(architecture=DSPARK, logits_start=0, markov_rank=16, confidence_head=True,
                    confidence_with_markov=True, own_embed=True, own_head=True)
    if dflash2:
        base.update(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=16)
    base.update(overrides)
    return DrafterArgs(**base)


def smollm2_drafter_args(layers: int = 2, **overrides) -> DrafterArgs:
    """A DFlash 2 drafter shaped for SmolLM2-135M-Instruct (`SMOLLM2_DRAFTER`), `layers`
    full-attention layers unless `layer_types` says otherwise."""
    shape = {**SMOLLM2_DRAFTER, "layer_types": ("full_attention",) * layers, **overrides}
    return drafter_args(dflash2=True, layers=layers, **shape)


def random_drafter(args: DrafterArgs, seed: int = 0) -> Drafter:
    mx.random.seed(seed)
    drafter = Drafter(args)
    if args.has_conv:   # non-trivial convolution: identity plus noise
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = mx.random.normal(conv.base_kernel.shape) * 0.3
                conv.base_kernel = base + mx.array([1.0, 0.0])[None, :, None]
                conv.kernel_projection.weight = conv.kernel_projection.weight * 3
    if args.markov_rank:      # a bias as large as the logits: a drafter that ignores it differs
        drafter.markov_head.markov_w2.weight = drafter.markov_head.markov_w2.weight * 8
    for layer in drafter.layers if args.attention_sinks else ():
        layer.self_attn.attention_sink_bias = mx.random.normal((args.num_attention_heads,))
    for i, layer in enumerate(drafter.layers if args.backbone == "gemma4" else ()):
        layer.layer_scalar = mx.array([0.5 + 0.25 * i])
    return drafter


def write_drafter(folder: Path, args: DrafterArgs | None = None, seed: int = 0,
                  dtype=mx.bfloat16, packaging: str = "DeepSpec") -> Path:
    """A drafter folder in the published layout (BF16 by default); a DSpark drafter in one
    of its packagings (`DSPARK_PACKAGINGS`). A reduced draft vocabulary (`draft_vocab_size`)
    gets the even ids and then the first odd ones, as its `d2t` table."""
    drafter = random_drafter(args or drafter_args(), seed)
    n = drafter.args.draft_vocab_size
    if n:
        drafter.draft_vocab = DraftVocab(sorted((list(range(0, VOCAB, 2)) +
                                                 list(range(1, VOCAB, 2)))[:n]))
    folder = save_drafter(drafter, folder, dtype)
    if packaging != "DeepSpec":
        path = folder / "config.json"
        path.write_text(json.dumps(packaged(json.loads(path.read_text()), packaging), indent=2))
    return folder


DSPARK_PACKAGINGS = ("DeepSpec", "speculators", "SpecForge", "LiquidAI")
BACKBONE = ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "attention_bias", "rope_theta")


def packaged(cfg: dict, packaging: str) -> dict:
    """A DSpark config.json of DeepSpec's layout in another packaging's, as published."""
    cfg = dict(cfg)
    start = cfg.pop("logits_start")
    if packaging == "speculators":          # the first slot said by the proposal's width
        layer = {"model_type": "qwen3", **{k: cfg[k] for k in BACKBONE}}
        if cfg.get("sliding_window"):
            layer.update(layer_types=["sliding_attention"] * cfg["num_hidden_layers"],
                         use_sliding_window=True, sliding_window=cfg["sliding_window"])
        out = {"speculators_model_type": "dspark",
               "speculators_config": {"algorithm": "dspark", "proposal_methods": [
                   {"proposal_type": "greedy",
                    "speculative_tokens": cfg["block_size"] - start}]},
               "transformer_layer_config": layer,
               "aux_hidden_state_layer_ids": cfg["target_layer_ids"],
               "sliding_window_non_causal": not cfg.get("dflash_query_causal", False)}
        for k in ("block_size", "mask_token_id", "markov_rank", "enable_confidence_head",
                  "confidence_head_with_markov", "final_logit_softcapping", "draft_vocab_size",
                  "attention_sink_bias"):
            if k in cfg:
                out[k] = cfg[k]
        return out
    nested = {k: cfg.pop(k) for k in ("target_layer_ids", "mask_token_id")}
    if packaging == "SpecForge":            # a Qwen3Config with a tagged dflash_config
        assert start == 0, "SpecForge heads predict from the anchor's slot"
        return {**cfg, "architectures": ["DSparkDraftModel"],
                "dflash_config": {"projector_type": "dspark", **nested}}
    if packaging == "LiquidAI":             # the taps nested, no tag
        assert start == 0, "LiquidAI's heads predict from the anchor's slot"
        return {**cfg, "architectures": ["Lfm2DSparkDraftModel"],
                "dflash_config": {**nested, "num_target_layers": cfg["num_target_layers"]}}
    raise ValueError(f"packaging: one of {DSPARK_PACKAGINGS}, got {packaging!r}")
