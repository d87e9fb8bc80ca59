"""An engine started while a spawned process imports its parent's script is refused by name
(``vllm_runtime.refuse_while_importing_main``): an engine core in a process of its own is such a
process, and a script that builds its engine at the top level, unguarded, would build one again there.

Real spawned processes, no vLLM: the refusal is the first thing ``build_llm`` does, so a script that
calls it at its top level and then spawns a process stands for one that builds an engine there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import multiprocessing

from posttrain.rollout.vllm_runtime import refuse_while_importing_main


def work():
    refuse_while_importing_main()  # in the child, its script imported: nothing to refuse


def start():
    child = multiprocessing.get_context("spawn").Process(target=work)
    child.start()
    child.join()
    print("CHILD EXIT", child.exitcode, flush=True)


{body}
"""
UNGUARDED = "refuse_while_importing_main()\nstart()"
GUARDED = 'if __name__ == "__main__":\n    refuse_while_importing_main()\n    start()'
ADVICE = 'put that script\'s top-level code under `if __name__ == "__main__":`'


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(body=body))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )


def test_an_unguarded_script_is_told_what_to_change_in_the_spawned_process(tmp_path: Path) -> None:
    done = _run(tmp_path, UNGUARDED)
    # the parent passes the check and spawns; the child, importing the script, is refused before it
    # could start anything (Python's own "bootstrapping phase" error would have come next)
    assert "CHILD EXIT 1" in done.stdout, done.stdout + done.stderr
    assert "PosttrainError" in done.stderr and ADVICE in done.stderr, done.stderr
    assert "bootstrapping phase" not in done.stderr


def test_a_guarded_script_and_its_spawned_process_pass(tmp_path: Path) -> None:
    done = _run(tmp_path, GUARDED)
    assert done.returncode == 0 and "CHILD EXIT 0" in done.stdout, done.stdout + done.stderr
    assert "PosttrainError" not in done.stderr
