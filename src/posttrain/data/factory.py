"""Prompts from a user function named ``module:function`` (rows as dicts, or ready ``PromptSample``s).

The function is called once, with ``seed=`` when it accepts that keyword, and its output is
materialised and checked up front (dict rows through ``rl.data.items_fn`` when set); it is then
served with the corpus cursor like a JSONL file.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from posttrain.data.base import PromptSample
from posttrain.data.jsonl import CorpusSource, ItemsFn, apply_system_prompt, corpus_provides, row_to_sample
from posttrain.errors import DataError
from posttrain.importing import import_object


def import_callable(path: str, *, what: str) -> Callable[..., Any]:
    """Resolve ``module:attr`` (``attr`` may be dotted) to a callable; errors are ``DataError``s naming ``what``."""
    fn: Callable[..., Any] = import_object(path, what=what, must_be_callable=True, error=DataError)
    return fn


def _accepts_seed(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature; call them without arguments
        return False
    return any(
        (p.name == "seed" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or p.kind == p.VAR_KEYWORD
        for p in params
    )


class FactorySource(CorpusSource):
    """The rows a ``module:function`` factory returns, served with the corpus cursor."""

    def __init__(
        self,
        factory: str,
        *,
        prompt_column: str = "prompt",
        response_column: str | None = "answer",
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
        items_fn: ItemsFn | None = None,
    ) -> None:
        self.factory = factory
        self._items_fn = items_fn
        fn = import_callable(factory, what="rl.data.factory")
        try:
            produced = fn(seed=seed) if _accepts_seed(fn) else fn()
            items = list(produced) if isinstance(produced, Iterable) else None
        except Exception as exc:  # user code: report which factory failed, keep the cause chained
            raise DataError(f"rl.data.factory: {factory!r} raised {exc!r}") from exc
        if items is None:
            raise DataError(
                f"rl.data.factory: {factory!r} returned {type(produced).__name__}, "
                "not an iterable of dicts or PromptSamples"
            )
        samples = [
            self._to_sample(item, i, prompt_column, response_column, system_prompt) for i, item in enumerate(items)
        ]
        if not samples:
            raise DataError(f"rl.data.factory: {factory!r} returned no rows")
        super().__init__(samples, shuffle=shuffle, seed=seed, provides=corpus_provides(response_column))

    def _to_sample(
        self,
        item: Any,
        i: int,
        prompt_column: str,
        response_column: str | None,
        system_prompt: str | None,
    ) -> PromptSample:
        where = f"factory {self.factory} row {i}"
        uid = f"{self.factory}:{i}"
        if not isinstance(item, PromptSample):
            return row_to_sample(
                item,
                where=where,
                uid=uid,
                prompt_column=prompt_column,
                response_column=response_column,
                system_prompt=system_prompt,
                items_fn=self._items_fn,
            )
        # A ready sample (items_fn maps rows, not samples): its prompt is checked like a row's, and it
        # must carry the ground truth the config promises to the reward (provides is derived from response_column).
        row = {"prompt": item.prompt}
        row_to_sample(row, where=where, uid=uid, prompt_column="prompt", response_column=None, system_prompt=None)
        if response_column is not None and item.ground_truth is None:
            raise DataError(
                f"{where}: PromptSample has ground_truth=None while rl.data.response_column is set; "
                "set rl.data.response_column=null when the factory carries no ground truth"
            )
        return PromptSample(
            prompt=apply_system_prompt(item.prompt, system_prompt),
            ground_truth=item.ground_truth if response_column is not None else None,
            uid=item.uid or uid,
            metadata=dict(item.metadata),
        )
