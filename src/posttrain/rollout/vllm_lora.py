"""Adapter sync to a vLLM engine for a LoRA policy (``model.lora``): the engine keeps the base weights
it was built with and samples with the policy's current adapter as a ``LoRARequest``.

After each optimizer step ``AdapterSync.sync`` writes the adapter in peft's format (a few MB) to a
versioned directory, has vLLM load it under a new id, and only then drops the previous one: a
transfer moves the adapter's tensors instead of every weight of the model (a disaggregated rollout
replica calls ``AdapterSync.load`` with the tensors it received, ``rollout/replica_lora.py``). The new request is used
from the next ``generate`` on. A failure anywhere poisons the engine like a failed full-weight sync
(``rollout/state.py``): vLLM may hold the new adapter, the old one, or neither, so the engine refuses
to sample until a resume. The directories live under one temporary root removed on ``close``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.config.lora import VLLM_LORA_RANKS
from posttrain.rollout.state import EngineState


def lora_engine_args(rank: int) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that let it serve one adapter of rank ``rank`` (none for 0)."""
    if rank <= 0:
        return {}
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(f"model.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    # one adapter at a time: the new version is loaded before the old one is removed, and the
    # sampling of one step uses one version, so one GPU slot (and two CPU-cache slots) suffice
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1, "max_cpu_loras": 2}


class AdapterSync:
    """The adapter a vLLM engine samples with, one ``LoRARequest`` per synced version."""

    def __init__(self, llm: Any, state: EngineState) -> None:
        self._llm = llm
        self._state = state
        self._root = Path(tempfile.mkdtemp(prefix="posttrain-lora-"))
        self._ids = 0  # vLLM caches adapters by integer id: every sync gets a new one
        self.request: Any = None
        """The ``LoRARequest`` of the current adapter; None until the first sync (the initial
        adapter has ``B = 0``: the base weights vLLM holds compute exactly what it does)."""
        self.last_sync_s = 0.0
        self.last_bytes = 0

    def sync(self, module: Any, version: int) -> None:
        """Write ``module``'s adapter (whole tensors: a collective every policy rank calls when it is
        sharded), load it into vLLM as a new request and retire the previous one."""
        from posttrain.models.lora import ADAPTER, trained_state_dict

        self._state.check_usable()
        self.load(trained_state_dict(module), module.peft_config[ADAPTER], version)

    def load(self, trained: Mapping[str, Any], peft_config: Any, version: int) -> None:
        """The adapter ``trained`` (whole tensors under the policy's state-dict names) with its
        ``peft.LoraConfig``, as a new request; the previous one is retired after it loaded (``sync``
        for a policy in this process; a rollout replica passes what it received)."""
        from vllm.lora.request import LoRARequest

        from posttrain.models.lora import ADAPTER_WEIGHTS, write_adapter_files

        self._state.check_usable()
        start = time.perf_counter()
        self._ids += 1
        target = self._root / f"v{version:09d}-{self._ids}"
        try:
            write_adapter_files(trained, peft_config, target)
            request = LoRARequest(f"policy-v{version}-{self._ids}", self._ids, str(target))
            if not self._llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter in {target}")
            old, self.request = self.request, request
            if old is not None:
                self._llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
            self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old adapter
        except Exception as err:
            raise self._state.poison(
                f"the adapter sync for version {version} failed ({type(err).__name__}: {err}); the vLLM engine may "
                "hold either adapter"
            ) from err
        self.last_bytes = (target / ADAPTER_WEIGHTS).stat().st_size
        self.last_sync_s = time.perf_counter() - start

    def close(self) -> None:
        """Remove every adapter directory written."""
        shutil.rmtree(self._root, ignore_errors=True)
