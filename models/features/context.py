"""N-gram index of a growing token context: what the `copy` group (and the node copy group) reads."""

from __future__ import annotations

from models.features.layout import COPY_MAX, LOOKUP_N

class ContextIndex:
    """N-grams of a growing token context, for the `copy` features; push/mark/rollback so a round's drafted tokens
    can be added and taken back in O(1) each (decode) while trace loading just pushes the whole continuation.

    copy_features(x) for a candidate next token x, with C the context so far:
    - copy_len: the largest L ≤ COPY_MAX such that the last L − 1 tokens of C followed by x occur in C (0: x does
      not occur in C) — how long a stretch of the context x would continue, as in code that repeats itself;
    - lookup_hit / lookup_len: prompt lookup (transformers' PromptLookupCandidateGenerator, without the model): the
      longest suffix of C of n ≤ LOOKUP_N tokens that occurred before; its proposal is the token that followed its
      most recent earlier occurrence; lookup_hit = 1[proposal = x], lookup_len = n (0 when no suffix recurs).
    """

    def __init__(self, tokens=(), counts: bool = False):
        self.toks: list[int] = []
        # with `counts`: n-gram (n ≤ LOOKUP_N) → {token: times it followed} (decode.lookup's confidence); off for
        # the features, which read only the latest follower
        self.counts: dict | None = {} if counts else None
        self.grams: set[tuple] = set()  # every n-gram of C, n = 1..COPY_MAX
        self.follow: dict[tuple, int] = {}  # n-gram (n ≤ LOOKUP_N) → token after its latest occurrence
        self.log: list = []  # undo entries: ("g", gram) added | ("f", key, old value or None)
        for t in tokens:
            self.push(int(t))

    def push(self, tok: int) -> None:
        toks, n0 = self.toks, len(self.toks)
        for n in range(1, min(COPY_MAX, n0 + 1) + 1):
            gram = (*toks[n0 - n + 1 :], tok) if n > 1 else (tok,)
            if gram not in self.grams:
                self.grams.add(gram)
                self.log.append(("g", gram))
        for n in range(1, min(LOOKUP_N, n0) + 1):
            key = tuple(toks[n0 - n :])
            self.log.append(("f", key, self.follow.get(key)))
            self.follow[key] = tok
            if self.counts is not None:
                after = self.counts.setdefault(key, {})
                after[tok] = after.get(tok, 0) + 1
                self.log.append(("c", key, tok))
        toks.append(tok)

    def mark(self) -> tuple[int, int]:
        return len(self.toks), len(self.log)

    def rollback(self, mark: tuple[int, int]) -> None:
        n_toks, n_log = mark
        while len(self.log) > n_log:
            entry = self.log.pop()
            if entry[0] == "g":
                self.grams.discard(entry[1])
            elif entry[0] == "c":
                self.counts[entry[1]][entry[2]] -= 1
            elif entry[2] is None:
                del self.follow[entry[1]]
            else:
                self.follow[entry[1]] = entry[2]
        del self.toks[n_toks:]

    def copy_features(self, x: int) -> list[float]:
        toks, n0 = self.toks, len(self.toks)
        length = 0
        for n in range(1, min(COPY_MAX, n0 + 1) + 1):  # monotone: a matching n-gram's suffixes all match
            gram = (*toks[n0 - n + 1 :], x) if n > 1 else (x,)
            if gram not in self.grams:
                break
            length = n
        prop, lookup = self.lookup()
        return [float(length), float(prop is not None and prop == x), float(lookup)]

    def lookup(self) -> tuple[int | None, int]:
        """Prompt lookup's proposal for the next token and its match length n (None, 0 when no suffix recurs)."""
        toks, n0 = self.toks, len(self.toks)
        for n in range(min(LOOKUP_N, n0), 0, -1):
            prop = self.follow.get(tuple(toks[n0 - n :]))
            if prop is not None:
                return prop, n
        return None, 0

    def followers(self, n: int) -> dict[int, int]:
        """{token: times it followed} for the context's last n tokens (an index built with `counts=True`)."""
        return self.counts.get(tuple(self.toks[len(self.toks) - n :]), {})

