"""The engine inside a disaggregated rollout replica (``launch/ray_backend.py``'s ``RolloutActor``).

A replica serves every policy rank that samples on it, and keeps one sampling stream per rank
(``cell``), so what a rank draws does not depend on the order in which the ranks' requests arrive,
and each rank's checkpoint restores its own stream. It holds one engine, built by the same factory
code as a colocated one (``rollout/factory.py``), of the kind ``rollout.backend`` names:

* ``hf``: the transformers engine on the replica's own copy of the policy;
* ``vllm``: an in-process ``VLLMRolloutEngine`` (engine core in this process,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) built from the model directory, so it starts from the
  policy's initial weights. The GPU is the replica's alone, so vLLM's sleep mode is off here
  whatever ``rollout.enable_sleep_mode`` says.

The engine's call counter is the stream position: the replica swaps each cell's counter in before
sampling for that cell and takes it out afterwards. The policy's full Hugging Face-named weights
arrive through ``load_weights(tensors, version)``; the engine stamps the version only after a
complete copy (the actor poisons the replica otherwise). A LoRA policy sends its adapter alone,
which the replica's engine takes in place or as a LoRA request (``rollout/replica_lora.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from posttrain.config.schema import RunConfig
from posttrain.rollout.replica_lora import ReplicaAdapter, replica_adapter
from posttrain.rollout.state import EngineState

if TYPE_CHECKING:
    from posttrain.rollout.hf_engine import HFRolloutEngine
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine


class Replica:
    """One engine, one sampling stream (call counter) per cell; ``device`` is where tensors
    broadcast to the replica land (``distributed/weight_sync.py``)."""

    def __init__(
        self, engine: HFRolloutEngine | VLLMRolloutEngine, device: torch.device, adapter: ReplicaAdapter | None = None
    ) -> None:
        self.engine = engine
        self.device = device
        self.streams: dict[int, dict[str, int]] = {}
        self.adapter = adapter  # model.lora: every weight version is the adapter alone (rollout/replica_lora.py)

    def generate(self, cell: int, prompt_token_ids: list[list[int]], n: int, params: Any) -> Any:
        """Sample on ``cell``'s stream; the batch carries the engine's own stamped version."""
        self.engine.load_state_dict(self.state_dict(cell))
        try:
            return self.engine.generate(prompt_token_ids, n, params)
        finally:
            self.streams[cell] = dict(self.engine.state_dict())

    def load_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        if self.adapter is not None:
            self.adapter.load(named_tensors, version)
            return
        self.engine.load_weights(named_tensors, version=version)

    def weight_layout(self) -> dict[str, tuple[tuple[int, ...], str]] | None:
        """Name -> (shape, dtype) of every tensor a weight update must bring: the transformers
        engine's model (its ``state_dict``, tied names included, as the policy sends them). ``None``
        for a vLLM engine, which casts to its own dtype and whose ``load_weights`` checks the
        checkpoint's names itself before it writes anything. A LoRA replica: its adapter's tensors."""
        if self.adapter is not None:
            return self.adapter.layout()
        model = getattr(self.engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            return None
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in model.state_dict().items()}

    def state_dict(self, cell: int) -> dict[str, int]:
        return dict(self.streams.get(cell, EngineState().state_dict()))

    def load_state_dict(self, cell: int, state: dict[str, int]) -> None:
        stream = EngineState()
        stream.load_state_dict(state)
        self.streams[cell] = stream.state_dict()

    def close(self) -> None:
        """Release the engine (vLLM's engine core) before the driver kills the actor."""
        self.engine.close()


def build_replica(cfg: RunConfig, launcher_args: dict[str, Any] | None = None) -> Replica:
    """The replica engine ``rollout.backend`` names, on the policy's initial weights; ``launcher_args``:
    one lane of a tensor-parallel vLLM replica (``launch/rollout_lanes.py``)."""
    from posttrain.models.loading import (
        load_model_and_tokenizer,
        load_tokenizer,
        resolve_model_path,
    )
    from posttrain.models.lora import apply_lora
    from posttrain.rollout.factory import build_hf_engine, build_vllm_engine, vllm_dtype

    if cfg.rollout.backend != "vllm":
        model, tokenizer = load_model_and_tokenizer(cfg.model)
        model = apply_lora(model, cfg.model.lora)  # model.lora: the policy's adapters, synced in place
        hf = build_hf_engine(cfg, model, tokenizer)
        return Replica(hf, next(model.parameters()).device, replica_adapter(cfg, hf))
    path = resolve_model_path(cfg.model.name_or_path, cfg.model.revision)
    engine = build_vllm_engine(
        cfg,
        path,
        load_tokenizer(path),
        dtype=vllm_dtype(cfg),  # the policy's compute dtype
        enable_sleep_mode=False,  # the replica's GPU is its own: nothing to make room for
        launcher_args=launcher_args,
    )
    # where the nccl transport receives into (Ray gives the actor its GPU as cuda:0)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return Replica(engine, device, replica_adapter(cfg, engine, path))
