"""Lookup drafting: propose what followed the most recent earlier occurrence of the context's
longest recurring suffix (prompt lookup / copy decoding).

The target copies from its context all the time (code it edits, tool output it quotes, its own
earlier lines); a small drafter that starts its block from token embeddings cannot. The index
needs no model and no training: one hash map per n-gram length, updated as tokens commit, so a
proposal costs O(max_n + width) whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_N = 2        # a single recurring token is too weak a cue (measured: see docs/lookup.md)
MAX_N = 8        # 8 vs 16: within 1.5% in the replay, and half the index updates
MAX_WIDTH = 16   # rows a lookup cycle may verify (proposals are width - 1 tokens)
# from this many tokens of context, one more token of match per doubling (docs/lookup.md: a
# recurring 2-gram in 2k tokens of code is mostly chance; measured by replay)
GROW_FROM = 1024


@dataclass(frozen=True)
class LookupConfig:
    """Suffix lengths tried, longest first, down to `shortest(context)`, and the widest block
    a lookup cycle verifies. grow_from: the context length from which the shortest match
    grows by one token per doubling (None: min_n at every length)."""

    min_n: int = MIN_N
    max_n: int = MAX_N
    max_width: int = MAX_WIDTH
    grow_from: int | None = GROW_FROM
    sticky: bool = True          # keep copying from the source that still agrees (`match`)

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"lookup n-gram lengths must satisfy 1 <= min_n <= max_n, got "
                             f"min_n={self.min_n}, max_n={self.max_n}")
        if self.max_width < 2:
            raise ValueError(f"lookup max_width must be >= 2, got {self.max_width}")
        if self.grow_from is not None and self.grow_from < 1:
            raise ValueError(f"lookup grow_from must be >= 1 or None, got {self.grow_from}")

    def shortest(self, context: int) -> int:
        """The shortest suffix that counts as a match after `context` tokens: min_n, plus one
        per doubling from `grow_from` (2, 3 from 1k, 4 from 2k, 5 from 4k ...), at most max_n."""
        if self.grow_from is None or context < self.grow_from:
            return self.min_n
        return min(self.min_n + (context // self.grow_from).bit_length(), self.max_n)


class LookupIndex:
    """The committed tokens and, per n, each n-gram's most recent occurrence that has a token
    after it: `last[n][gram] = i` means tokens[i - n : i] == gram and tokens[i] follows it.

    An n-gram is indexed only once the token after it commits, so the current suffix never
    matches itself.
    """

    def __init__(self, config: LookupConfig = LookupConfig(), tokens=()):
        self.config = config
        self.tokens: list[int] = []
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in
                                                  range(config.min_n, config.max_n + 1)}
        # the source being copied: where the last match's continuation stands now, and how
        # many tokens in a row (its match length, then every token since) agree with it
        self.source: int | None = None
        self.depth = 0
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Commit `tokens`; O(max_n - min_n + 1) dictionary updates per token."""
        seq = self.tokens
        for t in tokens:
            t = int(t)
            i = len(seq)                      # position of t: the n-grams ending at i - 1
            for n, last in self.last.items():
                if i >= n:
                    last[tuple(seq[i - n : i])] = i
            if self.source is not None:
                agrees = seq[self.source] == t
                self.source, self.depth = ((self.source + 1, self.depth + 1) if agrees
                                           else (None, 0))
            seq.append(t)

    def match(self) -> tuple[int, int] | None:
        """(n, i): the longest recurring suffix length (at most max_n) and where its
        continuation starts. Sticky: while the source copied from agrees with at least as
        many tokens as the longest suffix, it is that source, not the latest occurrence of
        the suffix (a log's or a file's lines share their openings: the latest occurrence
        of a line's first tokens is often another line; replayed on the long-context copy
        sets, a fixed 16-row lookup at 2k went from 1.63x to 1.82x plain, docs/lookup.md)."""
        seq = self.tokens
        found = None
        for n in range(min(self.config.max_n, len(seq) - 1),
                       self.config.shortest(len(seq)) - 1, -1):
            i = self.last[n].get(tuple(seq[-n:]))
            if i is not None:
                found = n, i
                break
        if not self.config.sticky:
            return found
        if self.source is not None and found is not None and self.depth >= found[0]:
            return min(self.depth, self.config.max_n), self.source
        self.source, self.depth = (found[1], found[0]) if found else (None, 0)
        return found

    def propose(self, k: int) -> tuple[int, list[int]] | None:
        """(n, tokens): the length of the longest recurring suffix, and the k tokens that
        followed its latest earlier occurrence; None when no suffix of shortest..max_n
        tokens recurs. A continuation that runs into the present copies on from what it proposed (a
        period-d repetition continues), so it is always k long."""
        found = self.match()
        if found is None or k < 1:
            return None
        n, start = found
        seq, out = self.tokens, []
        for j in range(k):
            src = start + j
            out.append(seq[src] if src < len(seq) else out[src - len(seq)])
        return n, out
