"""The ``posttrain`` console script: ``grpo``, ``opd``, ``report`` and ``export-hf`` subcommands."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: posttrain COMMAND [ARGS]

commands:
  grpo       train with GRPO (Dr-GRPO, GSPO, DAPO): posttrain grpo --config RECIPE.py|RUN.yaml [--validate-manifest]
             [--print-config] [-- k=v ...]
  opd        on-policy distillation from a teacher: posttrain opd --config RECIPE.py|RUN.yaml [--validate-manifest]
             [--print-config] [-- k=v ...]
  report     plot a run's curves to a PNG and print a summary: posttrain report RUN_DIR [--out FILE.png]
  export-hf  write a Hugging Face model directory from a checkpoint: posttrain export-hf CHECKPOINT OUT_DIR

Run `posttrain COMMAND --help` for a command's options."""


def report_main(argv: Sequence[str]) -> int:
    """``posttrain report RUN_DIR [--out PNG]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="posttrain report", description="Plot a run's metrics to a PNG.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
    args = parser.parse_args(list(argv))
    from posttrain.errors import PosttrainError
    from posttrain.metrics.report import write_report

    try:
        path, summary = write_report(args.run_dir, args.out)
    except (PosttrainError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary)
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "grpo":
        from posttrain.entrypoints.grpo import main as grpo_main

        return grpo_main(rest)
    if command == "opd":
        from posttrain.entrypoints.opd import main as opd_main

        return opd_main(rest)
    if command == "report":
        return report_main(rest)
    if command == "export-hf":
        from posttrain.checkpoint.export import export_main

        return export_main(rest)
    print(f"posttrain: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
