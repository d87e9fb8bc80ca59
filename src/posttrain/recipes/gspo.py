"""GSPO (arXiv 2507.18071) on the default arithmetic task.

GSPO takes one length-normalised importance ratio per response,
``s = exp(mean_t(log pi - log pi_old))``, and clips it per response. The ratio only differs from
one when the policy has moved since sampling, so the recipe takes two optimizer steps per collected
batch (``rl.mini_batch_per_replica`` = half the batch), which turns on the frozen pi_old pass.
The clip range is the paper's: sequence ratios stay much closer to one than token ratios.
"""

from posttrain.config.schema import GRPOConfig
from posttrain.recipes.default import make_config as make_default


def make_config() -> GRPOConfig:
    cfg: GRPOConfig = make_default()
    cfg.algorithm = "gspo"
    cfg.job.name = "arithmetic_smollm2_gspo"
    cfg.rl.grpo_surrogate = "clipped"
    cfg.rl.importance_sampling_level = "sequence"
    cfg.rl.loss_type = "seq-mean-token-mean"
    cfg.rl.epsilon_low = 3e-4
    cfg.rl.epsilon_high = 4e-4
    cfg.rl.mini_batch_per_replica = cfg.rl.batch_per_replica // 2
    return cfg
