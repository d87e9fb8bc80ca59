"""The run identity a resume keeps (``posttrain.loop.resume``): what it holds, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.checkpoint import CheckpointError, TrainingState
from posttrain.config.loading import build_config
from posttrain.loop.resume import anchor_hash, check_resume_compatible, resume_identity


def make_state(step: int, **identity: object) -> TrainingState:
    ident = {"data_seed": 0, "objective": {"loss_type": "token-mean", "epsilon_high": 0.2}, "ref_anchor": None}
    ident.update({"n_mini": 1, **identity})
    return TrainingState(
        step=step,
        optimizer_step=step,
        zero_grad_skips_total=0,
        data_state={"index": step * 4},
        engine_state={"generate_calls": step},
        rng={},
        identity=ident,
    )


def _identity(**changes: object) -> dict:
    ident = make_state(0).identity
    ident.update(changes)
    return ident


def test_check_resume_compatible_accepts_same_identity() -> None:
    saved = make_state(4)
    check_resume_compatible(saved, _identity(), n_mini=1)
    saved.optimizer_step, saved.zero_grad_skips_total = 7, 1  # one of the 8 slots was a zero-grad skip
    saved.identity["n_mini"] = 2
    check_resume_compatible(saved, _identity(n_mini=2), n_mini=2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data_seed": 5}, r"data seed changed: the checkpoint was written with 0, this run uses 5"),
        (
            {"objective": {"loss_type": "seq-mean-token-mean", "epsilon_high": 0.28}},
            r"objective identity changed: epsilon_high 0.2 -> 0.28, loss_type 'token-mean' -> 'seq-mean-token-mean'",
        ),
        (
            {"ref_anchor": "ab" * 32},
            r"reference anchor changed \(content of rl.ref.model_dir\): none -> sha256 abababababab",
        ),
        ({"teacher": {"top_k": 8}}, r"teacher changed: None -> \{'top_k': 8\}"),
    ],
)
def test_check_resume_compatible_refusals(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as info:
        check_resume_compatible(make_state(4), _identity(**change), n_mini=1)
    assert "rl.resume=off" in str(info.value)


def test_a_changed_extra_dict_lists_only_the_entries_that_differ() -> None:
    saved = make_state(4, teacher={"top_k": 4, "model": "ab" * 32, "jsd_beta": 0.5})
    with pytest.raises(CheckpointError) as info:
        check_resume_compatible(saved, _identity(teacher={"top_k": 8, "model": "cd" * 32, "jsd_beta": 0.5}), n_mini=1)
    assert "  - teacher changed: model sha256 abababababab… -> sha256 cdcdcdcdcdcd…, top_k 4 -> 8\n" in str(info.value)


def test_check_resume_refuses_step_off_the_batch_boundary() -> None:
    saved = make_state(3)  # optimizer_step 3
    with pytest.raises(CheckpointError) as info:
        check_resume_compatible(saved, _identity(n_mini=2), n_mini=2)
    text = str(info.value)
    assert "optimizer step 3 is not a multiple of rl.n_mini=2" in text
    assert "rl.n_mini changed: 1 -> 2" in text  # every difference is listed, not only the first


def test_anchor_hash_follows_content(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "w.bin").write_bytes(b"abc")
    first = anchor_hash(tmp_path)
    assert anchor_hash(tmp_path) == first and anchor_hash(None) is None
    (tmp_path / "w.bin").write_bytes(b"abd")
    assert anchor_hash(tmp_path) != first
    with pytest.raises(CheckpointError, match=r"rl.ref.model_dir='.*nope' is not a directory"):
        anchor_hash(tmp_path / "nope")


def test_resume_identity_of_a_config(tmp_path: Path) -> None:
    # 32 trajectories per batch (the default) in mini-batches of 16: rl.n_mini = 2
    cfg = build_config(None, ["rl.seed=3", "rl.mini_batch_per_replica=16", "rl.epsilon_high=0.25"])
    ident = resume_identity(cfg)
    assert sorted(ident) == ["data_seed", "n_mini", "objective", "ref_anchor"]
    assert (ident["data_seed"], ident["n_mini"], ident["ref_anchor"]) == (3, 2, None)
    assert ident["objective"]["epsilon_high"] == 0.25
    assert ident["objective"]["max_tokens"] == cfg.rollout.max_tokens
    (tmp_path / "w.bin").write_bytes(b"ref")
    anchored = resume_identity(build_config(None, [f"rl.ref.model_dir={tmp_path}"]))
    assert anchored["ref_anchor"] == anchor_hash(tmp_path)

    # what a checkpoint stores (through JSON) resumes under the same config, and names a changed knob
    saved = make_state(4)
    saved.identity = json.loads(json.dumps(ident))
    check_resume_compatible(saved, resume_identity(cfg), n_mini=2)
    changed = build_config(None, ["rl.seed=3", "rl.mini_batch_per_replica=16", "rl.epsilon_high=0.3"])
    with pytest.raises(CheckpointError, match=r"objective identity changed: epsilon_high 0.25 -> 0.3"):
        check_resume_compatible(saved, resume_identity(changed), n_mini=2)
