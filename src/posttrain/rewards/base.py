"""The one input type of every reward and the registry that resolves reward names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.data.base import ChatMessages


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees for one completion.

    ``completion`` is the decoded completion text; ``finish_reason`` is ``"stop"`` or ``"length"``.
    """

    prompt: str | ChatMessages
    completion: str
    ground_truth: Any | None = None
    finish_reason: str = "stop"
    metadata: dict[str, Any] = field(default_factory=dict)


class Reward(Protocol):
    """A scorer. ``requires`` names the sample fields it needs (checked against the data source
    before any model loads). ``__call__`` returns a finite float; anything else is an error."""

    name: str
    requires: frozenset[str]

    def __call__(self, sample: RewardInput) -> float: ...
