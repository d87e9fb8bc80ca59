"""The engine inside a disaggregated rollout replica (``launch/ray_backend.py``'s ``RolloutActor``).

A replica serves every policy rank that samples on it, and keeps one sampling stream per rank
(``cell``), so what a rank draws does not depend on the order in which the ranks' requests arrive,
and each rank's checkpoint restores its own stream. Two kinds, chosen by ``rollout.backend``:

* ``hf``: the transformers engine on the replica's own copy of the policy; one ``HFRolloutEngine``
  per cell, all on that one model (each holds its own call counter).
* ``vllm``: one in-process ``VLLMRolloutEngine`` (engine core in this process,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) built from the model directory, so it starts from the
  policy's initial weights. Its call counter is the stream position: the replica swaps each cell's
  counter in before sampling for that cell and takes it out afterwards. The GPU is the replica's
  alone, so vLLM's sleep mode is off here whatever ``rollout.enable_sleep_mode`` says.

Both take the policy's full Hugging Face-named weights with ``load_weights(tensors, version=...)``;
the engine stamps the version only after a complete copy (the actor poisons the replica otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.config.schema import GRPOConfig


class HFReplica:
    """Transformers engines (one per cell) sharing the replica's copy of the policy."""

    def __init__(self, cfg: GRPOConfig) -> None:
        from posttrain.models.loading import load_model_and_tokenizer

        self.model, self.tokenizer = load_model_and_tokenizer(cfg.model)
        self.batch_size = cfg.rollout.batch_size
        self.engines: dict[int, Any] = {}
        self.device = next(self.model.parameters()).device

    def _engine(self, cell: int) -> Any:
        from posttrain.rollout.hf_engine import HFRolloutEngine

        if cell not in self.engines:
            self.engines[cell] = HFRolloutEngine(self.model, self.tokenizer, batch_size=self.batch_size)
        return self.engines[cell]

    def generate(self, cell: int, prompt_token_ids: list[list[int]], n: int, params: Any, version: int) -> Any:
        engine = self._engine(cell)
        engine.weight_version = version
        return engine.generate(prompt_token_ids, n, params)

    def load_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        self._engine(-1).load_weights(named_tensors, version=version)

    def state_dict(self, cell: int) -> dict[str, int]:
        return dict(self._engine(cell).state_dict())

    def load_state_dict(self, cell: int, state: dict[str, int]) -> None:
        self._engine(cell).load_state_dict(state)

    def close(self) -> None:
        """Nothing to release beyond the process itself."""


class VLLMReplica:
    """One in-process vLLM engine; each cell's sampling stream is its own call counter."""

    def __init__(self, cfg: GRPOConfig) -> None:
        from posttrain.models.loading import load_tokenizer, resolve_device, resolve_dtype, resolve_model_path
        from posttrain.rollout.vllm_engine import engine_from_config

        path = resolve_model_path(cfg.model.name_or_path)
        dtype = resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))  # the policy's dtype
        self.engine = engine_from_config(
            cfg.rollout,
            path,
            load_tokenizer(path),
            dtype=str(dtype).removeprefix("torch."),
            enable_sleep_mode=False,  # the replica's GPU is its own: nothing to make room for
        )
        self.streams: dict[int, dict[str, int]] = {}
        # where the nccl transport receives into (Ray gives the actor its GPU as cuda:0)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def generate(self, cell: int, prompt_token_ids: list[list[int]], n: int, params: Any, version: int) -> Any:
        """Sample on ``cell``'s stream; the batch carries the engine's own stamped version."""
        self.engine.load_state_dict(self.state_dict(cell))
        try:
            return self.engine.generate(prompt_token_ids, n, params)
        finally:
            self.streams[cell] = dict(self.engine.state_dict())

    def load_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        self.engine.load_weights(named_tensors, version=version)

    def state_dict(self, cell: int) -> dict[str, int]:
        return dict(self.streams.get(cell, {"generate_calls": 0}))

    def load_state_dict(self, cell: int, state: dict[str, int]) -> None:
        self.streams[cell] = {"generate_calls": int(state["generate_calls"])}

    def close(self) -> None:
        """Shut vLLM's engine core down (before the driver kills the actor)."""
        self.engine.close()


def build_replica(cfg: GRPOConfig) -> HFReplica | VLLMReplica:
    """The replica engine ``rollout.backend`` names."""
    return VLLMReplica(cfg) if cfg.rollout.backend == "vllm" else HFReplica(cfg)
