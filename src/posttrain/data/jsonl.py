"""JSONL prompt files, plus the row validation and epoch cursor every corpus-backed source shares.

A corpus source (JSONL, a dataset saved on disk, a custom factory) turns its rows into
``PromptSample``s once, at construction, so a malformed row fails before any model loads, and then
serves them through ``CorpusSource``: the same epoch/permutation cursor for all three, so resuming
is identical whatever the backing store.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from posttrain.data.base import ChatMessages, PromptSample
from posttrain.errors import DataError


def apply_system_prompt(prompt: str | ChatMessages, system_prompt: str | None) -> str | ChatMessages:
    """Put ``system_prompt`` in front of ``prompt``.

    A string becomes ``[system, user]`` messages; a message list gets the system message prepended
    unless it already opens with one (the row's own system message wins: it is more specific).
    """
    if system_prompt is None:
        return prompt
    system = {"role": "system", "content": system_prompt}
    if isinstance(prompt, str):
        return [system, {"role": "user", "content": prompt}]
    if prompt and prompt[0].get("role") == "system":
        return prompt
    return [system, *prompt]


def _check_messages(value: list[Any], column: str, where: str) -> ChatMessages:
    if not value:
        raise DataError(f"{where}: column {column!r} is an empty message list; give at least one message")
    for k, msg in enumerate(value):
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise DataError(
                f"{where}: column {column!r} message {k} must be an object with 'role' and 'content', got {_short(msg)}"
            )
        if not isinstance(msg["role"], str):
            raise DataError(f"{where}: column {column!r} message {k} has a non-string role {_short(msg['role'])}")
        # The chat renderer takes text only: a list of (multimodal) content parts would be refused
        # there, after the model loaded and without the row's file and line.
        content = msg["content"]
        if not isinstance(content, str):
            kind = "a list of content parts (multimodal; posttrain renders text only)"
            kind = kind if isinstance(content, list) else type(content).__name__
            raise DataError(
                f"{where}: column {column!r} message {k} content must be a string, got {kind} {_short(content)}"
            )
        _refuse_surrogates(msg["role"], f"{where}: column {column!r} message {k} role")
        _refuse_surrogates(content, f"{where}: column {column!r} message {k} content")
    return [dict(msg) for msg in value]


def _refuse_surrogates(text: str, what: str) -> None:
    """A lone UTF-16 surrogate (JSON ``"\\ud800"`` without its pair) is a str that no tokenizer
    and no UTF-8 file can hold; refused here rather than as a TypeError inside the tokenizer."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{what} holds a lone UTF-16 surrogate {text[exc.start]!r} at character {exc.start + 1} (an unpaired "
            "\\uXXXX escape, which no tokenizer can encode); fix the escape or drop the row"
        ) from None


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # a 5000-digit int from a factory (repr refuses it), a broken __repr__
        return "(not printable)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _columns(row: Mapping[Any, Any]) -> list[str]:
    # str() first: a factory dict may mix key types, which sorted() alone would refuse.
    return sorted(str(key) for key in row)


def check_prompt(value: Any, column: str, where: str) -> str | ChatMessages:
    """Validate one prompt value: a non-empty string or a list of ``{"role", "content"}`` messages."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: column {column!r} is an empty string; give the prompt text")
        _refuse_surrogates(value, f"{where}: column {column!r}")
        return value
    if isinstance(value, list):
        return _check_messages(value, column, where)
    raise DataError(
        f"{where}: column {column!r} must be a string or a list of chat messages, "
        f"got {type(value).__name__} {_short(value)}"
    )


ItemsFn = Callable[[dict[str, Any]], Any]
"""``rl.data.items_fn``: a pure function from one raw row to a row in the prompt / ground-truth shape."""


def map_row(items_fn: ItemsFn, row: Mapping[Any, Any], where: str) -> Mapping[Any, Any]:
    """``items_fn(row)`` (on a copy, so a transformer that edits its argument cannot alter the source),
    checked to be a row; whatever it raises becomes a ``DataError`` naming the row."""
    name = f"{getattr(items_fn, '__module__', '?')}:{getattr(items_fn, '__qualname__', repr(items_fn))}"
    try:
        mapped = items_fn(dict(row))
    except Exception as exc:  # user code: name the row it failed on, keep the cause
        raise DataError(f"{where}: rl.data.items_fn {name} raised {exc!r}") from exc
    if not isinstance(mapped, Mapping):
        raise DataError(
            f"{where}: rl.data.items_fn {name} returned {type(mapped).__name__} {_short(mapped)}, "
            "not a row (a dict with the prompt column)"
        )
    return mapped


def row_to_sample(
    row: Any,
    *,
    where: str,
    uid: str,
    prompt_column: str,
    response_column: str | None,
    system_prompt: str | None,
    items_fn: ItemsFn | None = None,
) -> PromptSample:
    """Turn one row (a JSON object / dataset row / factory dict) into a ``PromptSample``.

    ``where`` names the row in errors (``"data.jsonl line 3"``); every problem raises ``DataError``.
    ``items_fn`` maps the raw row first. Every column but the prompt's (the ground-truth column
    included, under its own name) is kept in ``metadata``, which reaches the reward as
    ``RewardInput.metadata``.
    """
    if not isinstance(row, Mapping):
        raise DataError(
            f"{where}: expected an object (JSON object / dict) per row, got {type(row).__name__} {_short(row)}"
        )
    if items_fn is not None:
        row = map_row(items_fn, row, where)
    if prompt_column not in row:
        raise DataError(
            f"{where}: missing prompt column {prompt_column!r} (row has {_columns(row)}); "
            "set rl.data.prompt_column to the column holding the prompt"
        )
    prompt = check_prompt(row[prompt_column], prompt_column, where)
    ground_truth = None
    if response_column is not None:
        if response_column not in row or row[response_column] is None:
            state = "missing" if response_column not in row else "null"
            raise DataError(
                f"{where}: response column {response_column!r} is {state} (row has {_columns(row)}); "
                "set rl.data.response_column to the ground-truth column, or to null when the reward "
                "needs none"
            )
        ground_truth = row[response_column]
    metadata = {str(key): value for key, value in row.items() if key != prompt_column}
    return PromptSample(
        prompt=apply_system_prompt(prompt, system_prompt), ground_truth=ground_truth, uid=uid, metadata=metadata
    )


def decode_json_row(text: str, where: str) -> Any:
    """``json.loads(text)``; every way it can fail is a ``DataError`` naming ``where`` (and the column).

    Besides malformed JSON, the decoder refuses integers longer than Python's int-conversion limit
    (``sys.get_int_max_str_digits()``, a ValueError) and nesting deeper than the recursion limit (a
    RecursionError); neither names a position, so the column is found here.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # json's "Unterminated string starting at" ends on its own "at"
        raise DataError(f"{where}: not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})") from None
    except ValueError:  # the int-conversion limit; JSONDecodeError (a ValueError too) is above
        match = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
        column = f" column {match.start() + 1}" if match else ""
        raise DataError(
            f"{where}{column}: a number with more than {sys.get_int_max_str_digits()} digits, over Python's "
            "integer-conversion limit (sys.get_int_max_str_digits()); store it as a JSON string"
        ) from None
    except RecursionError:
        raise DataError(
            f"{where}: nested too deeply for the JSON decoder (beyond about {sys.getrecursionlimit()} levels of "
            "[ and {); flatten the row"
        ) from None


def iter_jsonl_lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a JSONL file; ``DataError`` for what cannot be read.

    Lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r``, as text mode counts them, but never at U+2028 and
    the other separators ``str.splitlines`` would also split on inside JSON strings. The file is
    read as bytes and decoded line by line, so bytes that are not UTF-8 are reported at their line and
    column (a text-mode read reports an offset into its decode buffer). A leading BOM is dropped.
    """
    for lineno, text in jsonl_lines(path):
        if isinstance(text, DataError):
            raise text
        yield lineno, text


def jsonl_lines(path: str) -> Iterator[tuple[int, str | DataError]]:
    """Like ``iter_jsonl_lines``, but a line that is not UTF-8 comes as its ``DataError`` and reading
    goes on (the preflight reports every bad row, not only the first); an unreadable file still raises."""
    try:
        with open(path, "rb") as fh:
            lineno = 0
            for raw in fh:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield lineno + 1, DataError(_not_utf8(path, lineno, raw, exc))
                    # the lines this chunk holds: lone \r end lines too, as in _split_cr
                    lineno += raw.removesuffix(b"\n").removesuffix(b"\r").count(b"\r") + 1
                    continue
                if lineno == 0:
                    text = text.removeprefix("\ufeff")
                # a line without its end, so a row cut short is reported at its own end, not at column 1
                # of the "next line" the decoder would see after the newline
                for piece in _split_cr(text) if "\r" in text else (text.removesuffix("\n"),):
                    lineno += 1
                    if piece.strip():
                        yield lineno, piece
    except OSError as exc:
        raise DataError(f"rl.data.path: cannot read JSONL file {path}: {exc}") from exc


def _split_cr(text: str) -> list[str]:
    """A ``\\n``-terminated chunk split at lone ``\\r`` line ends (a final ``\\r\\n`` is one line end)."""
    text = text.removesuffix("\n")
    return text.removesuffix("\r").split("\r")


def _not_utf8(path: str, lines_before: int, raw: bytes, exc: UnicodeDecodeError) -> str:
    # Lone \r before the bad byte end lines too (as in iter_jsonl_lines).
    prefix = raw[: exc.start].decode("utf-8", errors="replace").split("\r")
    lineno = lines_before + len(prefix)
    return (
        f"{path} line {lineno} column {len(prefix[-1]) + 1}: not valid UTF-8 (byte 0x{raw[exc.start]:02x}: "
        f"{exc.reason}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )


def parse_jsonl_line(
    text: str,
    *,
    path: str,
    lineno: int,
    prompt_column: str,
    response_column: str | None,
    system_prompt: str | None = None,
    items_fn: ItemsFn | None = None,
) -> PromptSample:
    """Parse one non-blank JSONL line into a sample; a problem raises ``DataError`` naming file and line."""
    where = f"{path} line {lineno}"
    row = decode_json_row(text, where)
    return row_to_sample(
        row,
        where=where,
        uid=f"{os.path.basename(path)}:{lineno}",
        prompt_column=prompt_column,
        response_column=response_column,
        system_prompt=system_prompt,
        items_fn=items_fn,
    )


class CorpusSource:
    """A finite list of samples served endlessly, epoch after epoch.

    Epoch ``e`` visits the samples in file order, or, with ``shuffle``, in the order of a
    permutation seeded with ``seed + e``; the cursor is just ``(epoch, position)``.
    """

    def __init__(self, samples: Sequence[PromptSample], *, shuffle: bool, seed: int, provides: frozenset[str]) -> None:
        if not samples:
            raise DataError("the prompt source holds no rows")
        self._samples = list(samples)
        self.shuffle = shuffle
        self.seed = seed
        self.provides = provides
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self._samples)

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self._samples)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self, n: int) -> list[PromptSample]:
        """The next ``n`` samples; crosses into the next (reshuffled) epoch when the corpus ends."""
        if n < 0:
            raise ValueError(f"next_batch needs n >= 0, got {n}")
        out: list[PromptSample] = []
        while len(out) < n:
            order = self._epoch_order(self._epoch)
            take = min(n - len(out), len(order) - self._position)
            out.extend(self._samples[i] for i in order[self._position : self._position + take])
            self._position += take
            if self._position == len(order):
                self._epoch, self._position = self._epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """The cursor, plus the seed and corpus size so a resume onto other data is caught."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "num_rows": len(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was written; refuse a changed seed or corpus size."""
        if "seed" in state and state["seed"] != self.seed:
            raise DataError(
                f"the data cursor was saved with data seed {state['seed']} but this run uses {self.seed}; "
                "an exact resume needs the same rl.seed (or rollout.seed with "
                "rl.data_seed_follows_rollout_seed)"
            )
        if "num_rows" in state and state["num_rows"] != len(self):
            raise DataError(
                f"the data cursor was saved for {state['num_rows']} rows but the source now has "
                f"{len(self)}; resume with the same data"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self):
            raise DataError(f"invalid data cursor epoch={epoch} position={position} for {len(self)} rows")
        self._epoch, self._position = epoch, position


def corpus_provides(response_column: str | None) -> frozenset[str]:
    """What a corpus source carries: the prompt, and the ground truth when a response column is set."""
    return frozenset({"prompt", "ground_truth"}) if response_column is not None else frozenset({"prompt"})


class JsonlSource(CorpusSource):
    """Prompts from a JSONL file, read whole at construction (one JSON object per line)."""

    def __init__(
        self,
        path: str,
        *,
        prompt_column: str = "prompt",
        response_column: str | None = "answer",
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
        items_fn: ItemsFn | None = None,
    ) -> None:
        self.path = path
        samples = self._read(path, prompt_column, response_column, system_prompt, items_fn)
        super().__init__(samples, shuffle=shuffle, seed=seed, provides=corpus_provides(response_column))

    @staticmethod
    def _read(
        path: str,
        prompt_column: str,
        response_column: str | None,
        system_prompt: str | None,
        items_fn: ItemsFn | None,
    ) -> list[PromptSample]:
        samples = [
            parse_jsonl_line(
                text,
                path=path,
                lineno=lineno,
                prompt_column=prompt_column,
                response_column=response_column,
                system_prompt=system_prompt,
                items_fn=items_fn,
            )
            for lineno, text in iter_jsonl_lines(path)
        ]
        if not samples:
            raise DataError(f"rl.data.path: JSONL file {path} has no rows (it is empty or only blank lines)")
        return samples
