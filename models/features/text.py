"""The `text` group's token classes (per token id: space, newline, digit, ...) and line position, and their packed
form in a head checkpoint."""

from __future__ import annotations

import functools

from models.features.layout import CLASSES


def token_classes(tokenizer):
    """(V, 6) float32 per token id (CLASSES): leading space, contains a newline, digits only, letters only,
    punctuation only, characters — read from byte-level BPE token strings (Ġ = space, Ċ = newline, ĉ = tab)."""
    import string

    import numpy as np

    out = np.zeros((len(tokenizer), len(CLASSES)), np.float32)
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        tok = tok or ""
        core = tok.replace("Ġ", "").replace("Ċ", "").replace("ĉ", "")
        punct = bool(core) and all(ch in string.punctuation for ch in core)
        out[i] = [tok.startswith("Ġ"), "Ċ" in tok or "\n" in tok, core.isdigit(), core.isalpha(), punct, len(core)]
    return out


def pack_classes(table) -> str:
    """`token_classes` as a short string for a head checkpoint: one flag byte + one length byte per id, base64."""
    import base64

    import numpy as np

    flags = (table[:, :5] > 0).astype(np.uint8) @ (1 << np.arange(5, dtype=np.uint8))
    chars = np.clip(table[:, 5], 0, 255).astype(np.uint8)
    return base64.b64encode(np.stack([flags, chars], 1).tobytes()).decode()


@functools.lru_cache(maxsize=4)
def unpack_classes(packed: str):
    """`pack_classes`' string back to the (V, 6) float32 table (cached: decode reads it once per policy)."""
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(packed), np.uint8).reshape(-1, 2)
    bits = (raw[:, :1] >> np.arange(5, dtype=np.uint8)) & 1
    return np.concatenate([bits, raw[:, 1:]], 1).astype(np.float32)


def classes_of(table, token: int):
    """The row of `token` in a class table (zeros for an id past the tokenizer: a padded logit row)."""
    return table[token] if 0 <= token < len(table) else table[0] * 0


def advance_line(line: int, tokens, table) -> int:
    """The `text` group's line position (tokens after the last newline token, the column the next token would start
    at, in tokens) after `tokens` follow a context whose position was `line`; `advance_line(0, ctx, table)` for a
    whole context. One rule for trace columns and decode, which advances it by the tokens each round commits."""
    for tok in tokens:
        line = 0 if classes_of(table, tok)[1] else line + 1
    return line

