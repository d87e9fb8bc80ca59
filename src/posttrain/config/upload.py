"""The ``rl.upload`` section: copy every completed checkpoint to an archive (any fsspec URL).

With ``enabled`` each checkpoint, once complete and published (its manifest written last, the
directory renamed into place), is copied in the background to
``<destination>/<job.project>/<job.group>/<job.name>/<attempt>/checkpoints/iter_*/`` with its
manifest sent last; a finished copy leaves ``.uploaded`` in the local checkpoint, and retention
(``rl.keep_model_last`` / ``rl.keep_optim_last``) never prunes a checkpoint without it.
``rl.resume=auto`` also looks at the destination and downloads its newest checkpoint when no newer
one is here. The machinery: ``posttrain.checkpoint.upload``; what is checked before any model loads
(a missing fsspec backend, an unreachable or unwritable destination): ``preflight/upload.py``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from posttrain.config.section import Section


class UploadConfig(Section):
    """Uploads of completed checkpoints to an archive destination (off by default)."""

    enabled: bool = False
    """Upload every completed checkpoint to ``rl.upload.destination`` in the background; a finished
    copy leaves ``.uploaded`` in the local checkpoint, and retention keeps a checkpoint until then."""
    destination: str | None = None
    """Where checkpoints go: an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ...) or a local or
    mounted path. The job's attempts are mirrored below it as ``<project>/<group>/<name>/<attempt>/
    checkpoints/iter_*``; must not be the run's output root itself. Needed when ``enabled``."""
    required: bool = False
    """``false``: an upload that still fails after its retries is logged as an error, the checkpoint
    stays local (kept by retention, retried with the next checkpoint's upload) and training goes on.
    ``true``: the run stops with an ``UploadError`` at the next step boundary (or at the end)."""
    retries: int = Field(3, ge=0, le=100)
    """Attempts after the first before an upload counts as failed."""
    retry_backoff_s: float = Field(2.0, ge=0.0, le=3600.0)
    """Seconds before the first retry; each later retry waits twice as long as the one before."""
    wait_timeout_s: float = Field(3600.0, ge=0.0, le=7 * 24 * 3600.0)
    """At the end of the run, the most seconds to wait for uploads still in flight (progress is
    logged meanwhile); what is not done by then is reported as failed."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the fsspec filesystem, e.g. ``{endpoint_url: http://host:9000}`` for an
    S3-compatible server with s3fs. Keep credentials out of it (the config is written to
    ``config_resolved.yaml``): s3fs reads ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` and the
    usual AWS files from the environment."""
