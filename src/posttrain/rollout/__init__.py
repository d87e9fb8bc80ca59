"""Rollout engines: sample completions for prompts. All engines share ``RolloutEngine``."""
