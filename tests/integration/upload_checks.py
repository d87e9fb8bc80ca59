"""What the multi-rank upload tests check of a finished run (``rl.upload`` to a local directory)."""

from __future__ import annotations

from pathlib import Path


def check_uploads(output: str, run_dir: Path, archive: Path, steps: tuple[int, ...]) -> None:
    """Each checkpoint of ``steps`` was uploaded once (by rank 0: one log line in the launch's
    ``output``), completely (every file its manifest lists, sizes and sha256, and nothing else), and
    carries ``.uploaded`` in ``run_dir``; ``archive`` is the run's ``rl.upload.destination``."""
    from posttrain.checkpoint import verify_checkpoint
    from posttrain.checkpoint.manifest import MANIFEST_NAME, read_manifest
    from posttrain.checkpoint.upload import UPLOADED_NAME

    job = run_dir.parent  # <output root>/<project>/<group>/<name>, mirrored below the archive
    for step in steps:
        name = f"iter_{step:09d}"
        assert output.count(f"upload: {name} -> ") == 1, output[-3000:]
        remote = archive / job.relative_to(job.parents[2]) / run_dir.name / "checkpoints" / name
        assert verify_checkpoint(remote, full=True) == [], remote
        sent = sorted(str(f.relative_to(remote)) for f in remote.rglob("*") if f.is_file())
        assert sent == sorted([*read_manifest(remote)["files"], MANIFEST_NAME])  # no .uploaded, no strays
        assert (run_dir / "checkpoints" / name / UPLOADED_NAME).is_file()
