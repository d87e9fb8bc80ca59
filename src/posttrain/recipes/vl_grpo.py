"""Multimodal GRPO on the built-in shape-count task with a tiny Qwen3-VL built locally (no download).

Each prompt is one 64 x 64 image of 1-5 coloured squares and "How many squares are in the image?
Reply with only the number."; the ``arithmetic`` reward is 1 when the last number of the completion
equals the count (``posttrain.data.visual``). The policy is ``models/vl_demo.py``'s: a random
Qwen3-VL (hidden 64, a 2-block vision tower, the SmolLM2 tokenizer) warmed up on the answer format
only, built into ``~/.cache/posttrain/vl-demo`` the first time this recipe is loaded (or ahead
with ``python -m posttrain.models.vl_demo``). It samples with the transformers engine (the image
path's only engine so far) and trains the vision tower and the language model together; add
``model.freeze_vision_tower=true`` to train the language model alone. On a 2-core CPU the 40 steps
take about 4 minutes; the reward stays near its starting 0.2 (this tiny random model does not learn
to count in 40 steps: the recipe demonstrates the path). docs/multimodal.md.
"""

from posttrain.config.schema import GRPOConfig
from posttrain.models.vl_demo import ensure_vl_demo


def make_config() -> GRPOConfig:
    cfg = GRPOConfig()
    cfg.job.group = "grpo"
    cfg.job.name = "shapes_tiny_qwen3_vl"
    cfg.model.name_or_path = str(ensure_vl_demo())
    cfg.rl.data.factory = "posttrain.data.visual:shape_count_rows"
    cfg.rl.reward = "arithmetic"
    cfg.rl.max_steps = 40
    cfg.rl.group_size = 8
    cfg.rl.batch_per_replica = 32
    cfg.rl.optimizer.lr = 1e-3
    cfg.rollout.max_tokens = 4
    cfg.rollout.temperature = 1.0
    return cfg
