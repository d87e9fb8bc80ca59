"""Command-line entry points: ``posttrain`` (cli) and ``python -m posttrain.entrypoints.grpo``."""
