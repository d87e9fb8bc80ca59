"""Exception types users see. Each names what is wrong and what to change."""


class PosttrainError(Exception):
    """Base class of every error posttrain raises on purpose."""


class ConfigError(PosttrainError):
    """A recipe or override is invalid. ``problems`` lists every problem found, not only the first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


class DataError(PosttrainError):
    """A prompt source is unreadable or malformed (the message names the file and line)."""


class RewardError(PosttrainError):
    """A reward returned something that is not a finite number, or got a malformed completion."""


class TrainingError(PosttrainError):
    """The update went wrong (a non-finite gradient, a failed determinism probe): the run stops."""
