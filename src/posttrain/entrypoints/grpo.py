"""``python -m posttrain.entrypoints.grpo --config RECIPE.py [--validate-manifest] [-- key=value ...]``.

Argument parsing, recipe loading and the preflight import no torch, so ``--help`` and
``--validate-manifest`` answer in about a second. Training imports the loop lazily.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from posttrain.errors import ConfigError, PosttrainError

if TYPE_CHECKING:
    from posttrain.config.schema import GRPOConfig


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Arguments before ``--`` go to argparse; ``key=value`` items after it are overrides."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def build_parser(prog: str = "posttrain grpo") -> argparse.ArgumentParser:
    """The GRPO command's arguments."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Online GRPO post-training: sample groups of completions, score them, train on the "
        "group-relative advantage. Without --config the embedded default runs (GRPO on arithmetic with "
        "SmolLM2-135M-Instruct).",
        epilog="Overrides: after `--`, dotted keys with YAML values, e.g. "
        "`-- rl.max_steps=5 grid.shapes.policy=[1,2] rl.data.path=null`.",
    )
    parser.add_argument(
        "--config",
        metavar="RECIPE",
        help="a recipe .py file defining make_config(), or the name of a shipped recipe (default, dr_grpo, gspo)",
    )
    parser.add_argument(
        "--validate-manifest",
        action="store_true",
        help="run every model-free check, print all problems, exit 0 only if valid",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=argparse.SUPPRESS)
    return parser


def validate_manifest(config_arg: str | None, overrides: list[str]) -> int:
    """Print every problem of the recipe; 0 when it is valid."""
    from posttrain.config.loading import build_config, build_config_best_effort
    from posttrain.config.validate import preflight

    problems: list[str] = []
    cfg: GRPOConfig | None
    try:
        cfg = build_config(config_arg, overrides)
    except ConfigError as exc:
        problems = list(exc.problems)
        cfg = build_config_best_effort(config_arg, overrides)
    if cfg is not None:
        findings = preflight(cfg)
        for warning in findings.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        problems += findings.errors
    if problems or cfg is None:
        print(f"manifest INVALID ({len(problems)} problem(s)):", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    rl = cfg.rl
    print(
        f"manifest OK: algorithm={cfg.algorithm} model={cfg.model.name_or_path} reward={rl.reward} "
        f"data={rl.data.kind} steps={rl.max_steps} batch={rl.batch_per_replica} group={rl.group_size}"
    )
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "posttrain grpo") -> int:
    """Entry point; returns the process exit status."""
    head, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(head)
    overrides = list(args.overrides) + overrides
    if args.validate_manifest:
        return validate_manifest(args.config, overrides)
    try:
        from posttrain.config.loading import build_config
        from posttrain.config.validate import preflight

        cfg = build_config(args.config, overrides)
        findings = preflight(cfg)
        for warning in findings.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if findings.errors:
            raise ConfigError(findings.errors)
        from posttrain.loop.grpo import train

        train(cfg, argv=list(sys.argv if argv is None else argv))
    except PosttrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m posttrain.entrypoints.grpo"))
