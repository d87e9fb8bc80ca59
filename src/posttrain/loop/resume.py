"""The run identity a resume must keep: what the loop stores in each checkpoint and checks on resume.

An exact resume continues the same run: same data order (``data_seed``), same objective (the
trainer's ``ObjectiveSpec``), same reference weights (a hash of ``rl.ref.model_dir``'s files),
same ``rl.n_mini``, plus whatever the config type pins on top (OPD: its teacher). The checkpoint
package stores this dict opaquely in ``TrainingState.identity``; the policy of what it holds and
how a difference is reported lives here, next to the loop that owns it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.layout import TrainingState, json_default
from posttrain.checkpoint.manifest import sha256_file

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig


def resume_identity(cfg: RunConfig) -> dict[str, Any]:
    """The identity ``check_resume_compatible`` compares, built from a config."""
    from posttrain.policy.trainer import objective_spec
    from posttrain.rollout.vllm_seeding import wants_call_seeds

    return {
        "data_seed": cfg.data_seed,
        "objective": dataclasses.asdict(objective_spec(cfg)),
        "ref_anchor": anchor_hash(cfg.rl.ref.model_dir, cfg.rl.ref.revision),
        "n_mini": cfg.rl.n_mini,
        **cfg.resume_identity_extra(),  # a config type may pin more (OPD: the teacher and its knobs)
        # model.lora, only when on (identities of full fine-tuning runs stay as they were)
        **({"model.lora": cfg.model.lora.model_dump(mode="json")} if cfg.model.lora.enabled else {}),
        # a frozen vision tower trains other parameters: only when on, like model.lora
        **({"model.freeze_vision_tower": True} if cfg.model.freeze_vision_tower else {}),
        # vLLM seeding its generators per call draws other completions than a seed per prompt (only
        # when so, like model.lora: runs seeded per prompt keep the identity they had)
        **({"rollout.vllm_seeding": "call"} if wants_call_seeds(cfg) else {}),
    }


def anchor_hash(model_dir: str | Path | None, revision: str | None = None) -> str | None:
    """sha256 over the sorted (relative path, sha256) of every file in ``model_dir``; None for None.
    A hub id (``org/name`` at ``revision``) is hashed in the snapshot directory the reference loads.

    Reads every byte (a multi-GB reference takes seconds): it is computed once per attempt.
    """
    if model_dir is None:
        return None
    root = Path(model_dir).expanduser()
    from posttrain.models.hub import is_hub_id

    if not root.exists() and is_hub_id(str(model_dir)):
        from posttrain.models.loading import resolve_model_path

        root = Path(resolve_model_path(str(model_dir), revision, key="rl.ref.model_dir"))
    if not root.is_dir():
        raise CheckpointError(f"rl.ref.model_dir={str(model_dir)!r} is not a directory")
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(root).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def check_resume_compatible(saved: TrainingState, current_identity: dict[str, Any], n_mini: int) -> None:
    """Refuse (``CheckpointError`` listing every difference) a resume that cannot be exact.

    The optimizer-step rule counts skipped zero-gradient updates too: the trainer does not
    advance ``optimizer_step`` on those, but they still use up one of the batch's ``n_mini`` slots.
    """
    problems = []
    attempted = saved.optimizer_step + saved.zero_grad_skips_total
    if attempted % n_mini:
        skips = (
            f" + {saved.zero_grad_skips_total} skipped zero-gradient update(s)" if saved.zero_grad_skips_total else ""
        )
        problems.append(
            f"optimizer step {saved.optimizer_step}{skips} is not a multiple of rl.n_mini={n_mini}: the "
            "checkpoint does not sit on a collected-batch boundary"
        )
    # the saved side went through JSON (tuples became lists): compare like with like
    old, new = saved.identity, json.loads(json.dumps(current_identity, default=json_default))
    if old.get("data_seed") != new.get("data_seed"):
        problems.append(
            f"data seed changed: the checkpoint was written with {old.get('data_seed')!r}, this run uses "
            f"{new.get('data_seed')!r} (rl.seed, or rollout.seed with rl.data_seed_follows_rollout_seed)"
        )
    old_obj, new_obj = old.get("objective") or {}, new.get("objective") or {}
    changed = [
        f"{k} {old_obj.get(k)!r} -> {new_obj.get(k)!r}"
        for k in sorted(set(old_obj) | set(new_obj))
        if old_obj.get(k) != new_obj.get(k)
    ]
    if changed:
        problems.append("objective identity changed: " + ", ".join(changed))
    if old.get("ref_anchor") != new.get("ref_anchor"):
        problems.append(
            f"reference anchor changed (content of rl.ref.model_dir): {_short(old.get('ref_anchor'))} -> "
            f"{_short(new.get('ref_anchor'))}"
        )
    for key in sorted((set(old) | set(new)) - {"data_seed", "objective", "ref_anchor"}):
        if old.get(key) != new.get(key):
            label = "rl.n_mini" if key == "n_mini" else key
            problems.append(f"{label} changed: {_difference(old.get(key), new.get(key))}{_HINTS.get(key, '')}")
    if problems:
        raise CheckpointError(
            "cannot resume exactly from this checkpoint:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nrestore the original settings, or start fresh with rl.resume=off"
        )


_HINTS = {
    "rollout.vllm_seeding": (
        " (None is a seed per prompt, rollout.per_prompt_seeds=true, the default; 'call' is "
        "rollout.per_prompt_seeds=false: resume with the checkpoint's)"
    ),
}


def _short(value: Any) -> str:
    """A sha256 hex digest shortened for a message; anything else as its repr (None as ``none``)."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return f"sha256 {value[:12]}…"
    return "none" if value is None else repr(value)


def _difference(old: Any, new: Any) -> str:
    """``old -> new``; for two dicts only the entries that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return ", ".join(f"{k} {_short(old.get(k))} -> {_short(new.get(k))}" for k in keys)
    return f"{old!r} -> {new!r}"


__all__ = ["anchor_hash", "check_resume_compatible", "resume_identity"]
