"""The embedded default: GRPO on two-number addition with SmolLM2-135M-Instruct.

Prompts are "What is a + b? Reply with only the number." with a, b drawn from 1..20, rendered with
the model's chat template. The reward is 1 when the last number of the completion equals a + b.
The untrained model ends on the right number in roughly one completion in ten (it often restates
the question or rambles), so many groups mix right and wrong answers and GRPO has a signal from
step 0. On a 2-core CPU (fp32) the 60 steps take about 4.5 minutes and the reward climbs from about
0.4 (first quarter) to 0.7-0.8 (last quarter); benchmarks/cpu_default.md and docs/benchmarks.md
have the curves. On a GPU
the same learning rate works as is: the policy keeps fp32 master weights and computes in bf16
(benchmarks/gpu_precision.md: 0.49 -> 0.87 over 200 steps with the vLLM engine on one H200).
"""

from posttrain.config.schema import GRPOConfig


def make_config() -> GRPOConfig:
    cfg = GRPOConfig()
    cfg.job.group = "grpo"
    cfg.job.name = "arithmetic_smollm2"
    cfg.rl.max_steps = 60
    cfg.rl.group_size = 8
    cfg.rl.batch_per_replica = 32
    # fp32 on a CPU: 1e-5 climbs steadily; 3e-5 learns faster but collapses onto one answer per
    # prompt after ~50 steps (every group ties, learning stops).
    cfg.rl.optimizer.lr = 1e-5
    cfg.rollout.max_tokens = 16
    cfg.rollout.temperature = 1.0
    return cfg
