"""``python -m posttrain.entrypoints.opd --config RECIPE.py|FILE.yaml [--validate-manifest] [-- k=v ...]``.

On-policy distillation: the GRPO command's shape (recipes, config files, overrides,
``--validate-manifest``, ``--print-config``) with an ``OPDConfig``, OPD's preflight (every teacher /
objective rule, before any model loads) and the OPD loop. Without ``--config`` the shipped ``opd_direct`` recipe runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from posttrain.entrypoints.grpo import Command
from posttrain.entrypoints.grpo import main as command_main

OPD_COMMAND = Command(
    config_class="posttrain.config.opd:OPDConfig",
    preflight="posttrain.preflight.opd:opd_preflight",
    train="posttrain.loop.opd:train",
    description=(
        "On-policy distillation: the student samples, a frozen teacher scores the same completions, and "
        "the student learns from the teacher's signal on the states it reaches (docs/opd.md)."
    ),
    recipes="opd_direct, opd_dpca",
)


def main(argv: Sequence[str] | None = None, prog: str = "posttrain opd") -> int:
    """Entry point; returns the process exit status."""
    return command_main(argv, prog, OPD_COMMAND)


if __name__ == "__main__":
    sys.exit(main(prog="python -m posttrain.entrypoints.opd"))
