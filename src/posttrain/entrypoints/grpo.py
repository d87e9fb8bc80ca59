"""``python -m posttrain.entrypoints.grpo --config RECIPE.py|FILE.yaml|FILE.json [--validate-manifest |
--print-config] [-- key=value ...]``.

Argument parsing, recipe and config-file loading and the preflight import no torch, so ``--help``,
``--validate-manifest`` and ``--print-config`` answer in about a second. Training imports the loop
lazily.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posttrain.errors import ConfigError, PosttrainError

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Arguments before ``--`` go to argparse; ``key=value`` items after it are overrides."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


GRPO_DESCRIPTION = (
    "Online GRPO post-training: sample groups of completions, score them, train on the group-relative "
    "advantage. Without --config the embedded default runs (GRPO on arithmetic with SmolLM2-135M-Instruct)."
)


def build_parser(
    prog: str = "posttrain grpo",
    description: str = GRPO_DESCRIPTION,
    recipes: str = "default, dr_grpo, gspo",
) -> argparse.ArgumentParser:
    """The command's arguments (shared by ``grpo`` and ``opd``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="Overrides: after `--`, dotted keys with YAML values, e.g. "
        "`-- rl.max_steps=5 grid.shapes.policy=[1,2] rl.data.path=null`.",
    )
    parser.add_argument(
        "--config",
        metavar="RECIPE|FILE",
        help=f"a recipe .py file defining make_config(), the name of a shipped recipe ({recipes}), or a "
        ".yaml/.yml/.json config file (the tree of a run's config_resolved.yaml, which can be given back)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the config (YAML, after overrides) that would run, and exit; feed it back with --config",
    )
    parser.add_argument(
        "--validate-manifest",
        action="store_true",
        help="run every model-free check, print all problems, exit 0 only if valid",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=argparse.SUPPRESS)
    return parser


@dataclass(frozen=True)
class Command:
    """What differs between the GRPO and OPD entry points: the config class, its preflight, its loop
    (given as import paths, so that ``--help`` and ``--validate-manifest`` import no torch)."""

    config_class: str = "posttrain.config.schema:GRPOConfig"
    preflight: str = "posttrain.preflight.grpo:grpo_preflight"
    train: str = "posttrain.loop.grpo:train"
    description: str = GRPO_DESCRIPTION
    recipes: str = "default, dr_grpo, gspo"

    def load(self, attr: str) -> Any:
        module, _, name = getattr(self, attr).partition(":")
        return getattr(importlib.import_module(module), name)


GRPO_COMMAND = Command()


def _summary(cfg: RunConfig) -> str:
    rl = cfg.rl
    return (
        f"algorithm={cfg.algorithm} model={cfg.model.name_or_path} reward={rl.reward} "
        f"data={rl.data.kind} steps={rl.max_steps} batch={rl.batch_per_replica} group={rl.group_size}"
    )


def validate_manifest(config_arg: str | None, overrides: list[str], command: Command = GRPO_COMMAND) -> int:
    """Print every problem of the recipe; 0 when it is valid."""
    from posttrain.config.loading import build_config, build_config_best_effort

    config_type, preflight = command.load("config_class"), command.load("preflight")
    problems: list[str] = []
    cfg: RunConfig | None
    try:
        cfg = build_config(config_arg, overrides, config_type)
    except ConfigError as exc:
        problems = list(exc.problems)
        cfg = build_config_best_effort(config_arg, overrides, config_type)
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
    print(f"manifest OK: {_summary(cfg)}")
    return 0


def print_config(config_arg: str | None, overrides: list[str], command: Command = GRPO_COMMAND) -> int:
    """Print the resolved config (what ``config_resolved.yaml`` would hold, without argv and provenance)."""
    from posttrain.config.loading import build_config, config_yaml, resolved_tree

    try:
        cfg = build_config(config_arg, overrides, command.load("config_class"))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(config_yaml(resolved_tree(cfg)))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "posttrain grpo", command: Command = GRPO_COMMAND) -> int:
    """Entry point; returns the process exit status."""
    head, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog, command.description, command.recipes).parse_args(head)
    overrides = list(args.overrides) + overrides
    if args.validate_manifest:
        return validate_manifest(args.config, overrides, command)
    if args.print_config:
        return print_config(args.config, overrides, command)
    try:
        from posttrain.config.loading import build_config

        cfg = build_config(args.config, overrides, command.load("config_class"))
        findings = command.load("preflight")(cfg)
        for warning in findings.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if findings.errors:
            raise ConfigError(findings.errors)
        full_argv = list(sys.argv if argv is None else argv)
        if cfg.grid.backend == "ray":  # the driver: the loop runs in Ray actors (launch/ray_backend.py)
            from posttrain.launch.ray_backend import train_with_ray

            train_with_ray(cfg, full_argv, command.config_class, command.train)
        else:
            from posttrain.distributed.process_group import pin_torchrun_gpu

            pin_torchrun_gpu()  # before the loop's import can start CUDA
            command.load("train")(cfg, argv=full_argv)
    except PosttrainError as exc:
        from posttrain.distributed.process_group import rank_tag

        print(f"error{rank_tag()}: {exc}", file=sys.stderr)
        return _leave(1)
    return _leave(0)


def _leave(status: int) -> int:
    """``status`` for a single process; a rank of a multi-rank launch exits here (exit_rank_process)."""
    from posttrain.distributed.process_group import exit_rank_process

    return exit_rank_process(status)


if __name__ == "__main__":
    sys.exit(main(prog="python -m posttrain.entrypoints.grpo"))
