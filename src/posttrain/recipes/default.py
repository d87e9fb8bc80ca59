"""The embedded default: GRPO on two-number addition with SmolLM2-135M-Instruct.

Prompts are "What is a + b? Reply with only the number." with a, b drawn from 1..20, rendered with
the model's chat template. The reward is 1 when the last number of the completion equals a + b.
The untrained model answers correctly on roughly one completion in ten (it often restates the
question or rambles), so most groups mix right and wrong answers and GRPO has a signal from step 0.
"""

from posttrain.config.schema import GRPOConfig


def make_config() -> GRPOConfig:
    cfg = GRPOConfig()
    cfg.job.group = "grpo"
    cfg.job.name = "arithmetic_smollm2"
    cfg.rl.max_steps = 60
    cfg.rl.group_size = 8
    cfg.rl.batch_per_replica = 32
    cfg.rl.optimizer.lr = 2e-5
    cfg.rollout.max_tokens = 16
    cfg.rollout.temperature = 1.0
    return cfg
