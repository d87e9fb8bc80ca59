"""Dr-GRPO (arXiv 2503.20783) on the default arithmetic task.

Dr-GRPO removes GRPO's two length and difficulty biases: advantages are not divided by the group
std (``rl.unbiased_advantage``), and each sequence's token sum is divided by the fixed
``rollout.max_tokens`` instead of its own length (``rl.loss_type=seq-mean-token-sum-fixed``).
The fixed divisor shrinks gradients, so Adam's eps must be small (1e-8): the recipe guard refuses
a larger one under ``rl.recipe_guard_severity=error``, which this recipe sets.
"""

from posttrain.config.schema import GRPOConfig
from posttrain.recipes.default import make_config as make_default


def make_config() -> GRPOConfig:
    cfg: GRPOConfig = make_default()
    cfg.algorithm = "dr_grpo"
    cfg.job.name = "arithmetic_smollm2_dr_grpo"
    cfg.rl.unbiased_advantage = True
    cfg.rl.loss_type = "seq-mean-token-sum-fixed"
    cfg.rl.optimizer.eps = 1e-8
    cfg.rl.recipe_guard_severity = "error"
    return cfg
