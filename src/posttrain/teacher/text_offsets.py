"""Where each token ends in its decoded text: the tokenizer side of cross-tokenizer alignment (DPCA).

:func:`token_end_offsets` maps a token id sequence to, per token, the character offset in
``decode(ids)`` where that token ends, or ``None`` where the token is no boundary of the text.
The definition is the one the slow, generic method computes: decode every prefix ``ids[:i+1]``;
if that decode is a prefix of the full decode, token ``i`` ends at its length, else ``None``
(e.g. the token ends inside a multi-byte UTF-8 character, so the prefix decodes to a replacement
character where the full text has the real one). Every decode is
``decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)``.

Byte-level BPE tokenizers (GPT-2 / Llama-3 / Qwen / SmolLM2 style, a ``ByteLevel`` decoder) get a
linear fast path with the same result: each token maps to its bytes, the bytes are decoded
incrementally, and a token ends at a boundary exactly when no incomplete UTF-8 sequence is pending
after it (or when the replacement characters those pending bytes decode to on their own are also
what the full text has there, as for invalid UTF-8 the student may sample). The fast path checks
its full text against the tokenizer's own decode and falls back to the generic method when they
differ.

Special tokens decode to their literal text here. DPCA's caller strips a trailing EOS from both
sides before computing offsets and pairs the two EOS tokens as their own chunk
(:func:`posttrain.algorithm.dpca.eos_chunk`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal

Method = Literal["auto", "bytes", "prefix"]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


def prefix_end_offsets(tokenizer: Any, ids: Sequence[int]) -> list[int | None]:
    """The generic definition: decode every prefix (quadratic in ``len(ids)``; any tokenizer)."""
    text = _decode(tokenizer, ids)
    offsets: list[int | None] = []
    for i in range(len(ids)):
        prefix = _decode(tokenizer, ids[: i + 1])
        offsets.append(len(prefix) if text.startswith(prefix) else None)
    return offsets


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, NBSP, soft hyphen) for ``chr(256 + n)`` in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _token_bytes(token: str, table: dict[str, int]) -> bytes:
    """A byte-level token's bytes; a token with a character outside the alphabet (an added token
    such as ``<|im_end|>`` with a space or accents) is taken as its own UTF-8 text, as the decoder does."""
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the fast tokenizer decodes with a ``ByteLevel`` decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def byte_level_end_offsets(tokenizer: Any, ids: Sequence[int]) -> list[int | None] | None:
    """The fast path for a byte-level tokenizer, or ``None`` when its full text disagrees with the
    tokenizer's decode (then the byte model does not describe this tokenizer)."""
    table = _byte_level_chars()
    pieces = [_token_bytes(tok, table) for tok in tokenizer.convert_ids_to_tokens(list(ids))]
    text = _decode(tokenizer, ids)
    if b"".join(pieces).decode("utf-8", errors="replace") != text:
        return None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    committed = 0  # characters the decoder has emitted: always a prefix of `text`
    offsets: list[int | None] = []
    for piece in pieces:
        committed += len(decoder.decode(piece))
        pending, _ = decoder.getstate()
        # The prefix alone decodes to the committed text plus its pending bytes decoded on their own
        # (replacement characters: pending bytes never complete a character by themselves). It is a
        # prefix of the full text when the full text has those same replacements there.
        tail = bytes(pending).decode("utf-8", errors="replace")
        if text.startswith(tail, committed):
            offsets.append(committed + len(tail))
        else:
            offsets.append(None)
    return offsets


def token_end_offsets(tokenizer: Any, ids: Sequence[int], *, method: Method = "auto") -> list[int | None]:
    """Per token of ``ids``, the character offset in its decoded text where the token ends, or
    ``None`` where the token is no boundary (see the module docstring for the exact definition).

    ``method``: ``prefix`` is the generic quadratic definition; ``bytes`` the byte-level fast path
    (``ValueError`` when it does not apply); ``auto`` (default) the fast path when the tokenizer has
    a ``ByteLevel`` decoder and its text matches, else ``prefix``. The last token (if any) ends at
    ``len(text)``.
    """
    if method not in ("auto", "bytes", "prefix"):
        raise ValueError(f"method={method!r} is not one of 'auto', 'bytes', 'prefix'")
    ids = [int(i) for i in ids]
    if method == "prefix":
        return prefix_end_offsets(tokenizer, ids)
    fast = byte_level_end_offsets(tokenizer, ids) if is_byte_level(tokenizer) else None
    if fast is not None:
        return fast
    if method == "bytes":
        raise ValueError(
            f"{type(tokenizer).__name__} is not a byte-level tokenizer whose decode matches its token bytes; "
            "use method='prefix'"
        )
    return prefix_end_offsets(tokenizer, ids)
