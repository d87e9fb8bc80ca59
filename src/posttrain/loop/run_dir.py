"""The run directory: ``$POSTTRAIN_OUTPUT_ROOT/<project>/<group>/<name>/<RUN_TS>/``.

The output root is ``job.output_root`` when set, else ``$POSTTRAIN_OUTPUT_ROOT``, else ``./outputs``.
Each attempt gets its own timestamped directory; ``config_resolved.yaml`` holds the full config
with the values the loop derives from it (``resolved``), the command line (``argv``) and the code's
provenance: ``--config config_resolved.yaml`` runs the same config again (those three keys are
dropped on load, ``config.loading.RESOLVED_EXTRA_KEYS``). It is written with the YAML 1.2 core
schema's quoting, so every value reads back as itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from posttrain.config.loading import config_yaml, resolved_tree
from posttrain.config.schema import RunConfig

DEFAULT_OUTPUT_ROOT = "outputs"


def output_root(cfg: RunConfig) -> Path:
    """Where every run of every job is written."""
    return Path(cfg.job.output_root or os.environ.get("POSTTRAIN_OUTPUT_ROOT") or DEFAULT_OUTPUT_ROOT)


def job_dir(cfg: RunConfig) -> Path:
    """The namespace of one job: all its attempts live below it."""
    return output_root(cfg) / cfg.job.project / cfg.job.group / cfg.job.name


def create_run_dir(cfg: RunConfig) -> Path:
    """A new, empty attempt directory (a same-second collision gets a ``-1``, ``-2`` ... suffix)."""
    base = job_dir(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in ["", *(f"-{i}" for i in range(1, 1000))]:
        path = base / f"{stamp}{suffix}"
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a fresh run directory under {base}")


def resolved_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as written to ``config_resolved.yaml``: every field plus derived values."""
    return resolved_tree(cfg)


def write_resolved_config(run_dir: Path, cfg: RunConfig, extra: dict[str, Any] | None = None) -> Path:
    """Write ``config_resolved.yaml`` atomically (temp file, then rename)."""
    tree = resolved_config(cfg)
    if extra:
        tree.update(extra)
    path = run_dir / "config_resolved.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(config_yaml(tree), encoding="utf-8")
    tmp.replace(path)
    return path
