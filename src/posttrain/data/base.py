"""The one input type of every prompt source, and the protocol every source implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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
