"""The ``model.lora`` section: train low-rank adapters (LoRA, through ``peft``) instead of every weight.

With ``rank > 0`` the policy's base weights are frozen and ``peft`` adds a trainable low-rank pair
``B @ A`` (``B`` initialised to zero, so step 0 samples exactly the base model) beside each targeted
linear layer; only those matrices (and ``modules_to_save``, trained whole) reach the optimizer, the
checkpoints and the rollout engine's weight sync. The KL reference is then the base model itself: the
policy run with its adapter disabled, not a second copy. What the section means for each engine, the
checkpoints and ``export-hf``: docs/lora.md. Rules that tie these fields to others (dropout against
the determinism probe and score centering, Muon, the vLLM engine's limits) are checked by
``preflight/lora.py`` before any model loads.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from posttrain.config.section import Section

ALL_LINEAR = "all-linear"
"""The ``target_modules`` preset: every linear layer of the decoder (not the LM head)."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts: its engine takes the smallest one at least ``rank``, and
``preflight/lora.py`` refuses ranks above the last with ``rollout.backend=vllm``."""


class LoraConfig(Section):
    """Low-rank adapters on the policy (off unless ``rank > 0``)."""

    rank: int = Field(0, ge=0)
    """Rank r of each adapter pair; 0 turns LoRA off (every weight trains, as without this section).
    8 to 64 is usual; the update of a targeted ``out x in`` weight is limited to rank r."""
    alpha: float = Field(16.0, gt=0.0)
    """Scale of the adapter's contribution: the layer adds ``(alpha / rank) * B @ A @ x``. Keeping
    ``alpha`` fixed while changing ``rank`` changes the effective step size; re-tune ``rl.optimizer.lr``."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during training. Nonzero makes the training forward random, so it
    is refused where two forwards must agree: several optimizer steps per batch (the pi_old pass and
    its determinism probe), score centering, and a ratio against the dropout-free sampler's logprobs
    (``rl.use_rollout_logprobs_for_loss``, OPD's advantage mode). Seldom useful in RL."""
    target_modules: list[str] | str = ALL_LINEAR
    """Which linear layers get an adapter: ``all-linear`` (every linear layer of the decoder, not the
    LM head), or a list of module names matched against the end of each module's dotted name, e.g.
    ``[q_proj, k_proj, v_proj, o_proj]``."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained whole beside the adapters: every module whose dotted name ENDS with one of these
    strings (peft's rule, a plain suffix: ``norm`` also matches ``input_layernorm``; ``model.norm`` is
    the final norm alone). Refused with ``rollout.backend=vllm``, whose LoRA requests carry adapters only."""

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained (``rank > 0``)."""
        return self.rank > 0

    @field_validator("target_modules")
    @classmethod
    def _names_or_preset(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str) and v != ALL_LINEAR:
            raise ValueError(f"target_modules={v!r}: give {ALL_LINEAR!r} or a list of module names, e.g. [q_proj]")
        if isinstance(v, list) and (not v or any(not name.strip() for name in v)):
            raise ValueError("target_modules: a list of non-empty module names (or the preset 'all-linear')")
        return v

    @field_validator("modules_to_save")
    @classmethod
    def _no_empty_names(cls, v: list[str]) -> list[str]:
        if any(not name.strip() for name in v):
            raise ValueError("modules_to_save: module names must be non-empty")
        return v
