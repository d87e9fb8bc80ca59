"""The preflight of ``rl.upload``: before any model loads, the destination must be named, its fsspec
backend installed (``s3://`` needs ``s3fs``: ``pip install posttrain[upload]``), it must not be the
output root itself (a checkpoint would be copied onto itself), and it must take a small probe object
(reachable, the bucket exists, the credentials may write). Imports no torch; fsspec only when
uploads are on.
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.checkpoint.upload import job_key, probe_destination
from posttrain.config.schema import RunConfig
from posttrain.preflight.findings import Findings


def _output_root(cfg: RunConfig) -> Path:
    """As ``loop/run_dir.py`` resolves it (the preflight may not import the loop)."""
    return Path(cfg.job.output_root or os.environ.get("POSTTRAIN_OUTPUT_ROOT") or "outputs")


def check_upload(cfg: RunConfig, out: Findings) -> None:
    """``rl.upload``: a usable destination when enabled (nothing is checked when off)."""
    up = cfg.rl.upload
    if not up.enabled:
        return
    if not up.destination:
        out.errors.append(
            "rl.upload.enabled=true needs rl.upload.destination: a path or an fsspec URL such as s3://bucket/prefix"
        )
        return
    if cfg.rl.save_every == 0:
        out.warnings.append("rl.upload.enabled=true with rl.save_every=0: no checkpoint is written, nothing uploads")
    import fsspec.core

    if fsspec.core.split_protocol(up.destination)[0] in (None, "file", "local"):
        local = Path(fsspec.core.strip_protocol(up.destination)).expanduser().resolve()
        if local == _output_root(cfg).expanduser().resolve():
            out.errors.append(
                f"rl.upload.destination={up.destination!r} is the output root itself: every checkpoint would be "
                "copied onto itself; name another directory (a mounted archive, or a bucket)"
            )
            return
    problem = probe_destination(up.destination, up.storage_options, job_key(cfg))
    if problem is not None:
        out.errors.append(problem)
