"""What a preflight check reports: the problems that refuse the config and the warnings that do not."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Findings:
    """Problems that refuse the config, and warnings that do not."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def guard(self, message: str, severity: str) -> None:
        """A recipe-hygiene hazard: a warning, or an error under ``recipe_guard_severity=error``."""
        (self.errors if severity == "error" else self.warnings).append(f"recipe guard: {message}")
