"""The one input type of every prompt source, the protocol every source implements, and the base of the
built-in generated tasks (``SeededStream``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from posttrain.errors import DataError

ChatMessages = list[dict[str, Any]]


@dataclass(frozen=True)
class PromptSample:
    """One prompt with what a reward may need to score its completions.

    ``prompt`` is either a plain string (sent as one user message when the model has a chat
    template) or a chat-message list ``[{"role": ..., "content": ...}, ...]``. ``ground_truth`` is
    the reference answer (``None`` when the source carries none). ``uid`` identifies the row so
    that logs and checkpoints can name it (``"file.jsonl:12"``, ``"arith:seed=1:3"``).
    """

    prompt: str | ChatMessages
    ground_truth: Any | None = None
    uid: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class DataSource(Protocol):
    """An endless, resumable stream of prompts.

    ``provides`` names the fields the source carries for every sample (``"prompt"`` always,
    ``"ground_truth"`` when it has a reference answer); rewards declare what they need and a
    mismatch is rejected before any model loads.
    """

    provides: frozenset[str]

    def next_batch(self, n: int) -> list[PromptSample]:
        """The next ``n`` prompts; wraps around (next epoch, reshuffled) at the end of a corpus."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The cursor: enough to continue exactly where this source stopped."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor written by ``state_dict``."""
        ...


class SeededStream(ABC):
    """An endless generated task whose sample ``i`` depends on ``(seed, i)`` alone: the cursor is the
    next index, and a resume under another seed is refused (its samples would not be the ones the
    run was promised). Subclasses set ``seed`` and define ``sample``."""

    provides: frozenset[str] = frozenset({"prompt", "ground_truth"})
    cursor_name: ClassVar[str]
    """What the errors call this stream's cursor ("the arithmetic cursor")."""

    seed: int
    _index: int = 0

    @abstractmethod
    def sample(self, index: int) -> PromptSample:
        """Sample ``index`` of this seed's stream (independent of the cursor)."""

    def next_batch(self, n: int) -> list[PromptSample]:
        """The next ``n`` samples."""
        if n < 0:
            raise ValueError(f"next_batch needs n >= 0, got {n}")
        out = [self.sample(i) for i in range(self._index, self._index + n)]
        self._index += n
        return out

    def state_dict(self) -> dict[str, Any]:
        """The cursor: the next index, and the seed (a resume with another seed is refused)."""
        return {"index": self._index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from the index in ``state``."""
        if state.get("seed", self.seed) != self.seed:
            raise DataError(
                f"the {self.cursor_name} cursor was saved with data seed {state['seed']} but this run uses "
                f"{self.seed}; an exact resume needs the same data seed"
            )
        index = int(state["index"])
        if index < 0:
            raise DataError(f"invalid {self.cursor_name} cursor index {index}")
        self._index = index
