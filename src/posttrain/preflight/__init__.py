"""The preflight: every check a run can make before any model loads, above config, data, rewards and
models (it imports those, never the policy, the loop or the rollout engines).

- ``findings``: ``Findings`` (errors refuse the config, warnings do not; recipe guards are either).
- ``common``: the checks every run shares (``run_checks`` runs them in one order).
- ``paths``: the file-system checks (paths the OS can hold, model directories, the run directory,
  ``rl.resume``).
- ``grid``: topology (shapes, backends, data parallelism, the allocation).
- ``grpo``: ``grpo_preflight``, GRPO's own rules (reference, score centering, dynamic sampling).
- ``opd``: ``opd_preflight``, the teacher and distillation rules; ``check_shared_vocabulary``.

Single-field bounds and choices are pydantic's (``posttrain.config``); every rule that ties fields
together, or reads files, the environment, the data source or the reward, is here, once. Importing
the preflight imports no torch (``--validate-manifest`` answers in about a second).
"""

from posttrain.preflight.findings import Findings
from posttrain.preflight.grpo import grpo_preflight
from posttrain.preflight.opd import check_shared_vocabulary, opd_preflight

__all__ = ["Findings", "check_shared_vocabulary", "grpo_preflight", "opd_preflight"]
