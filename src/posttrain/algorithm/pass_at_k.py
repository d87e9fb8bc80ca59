"""Evaluation summaries of sampled rewards: mean reward, pass@1, pass@k (pure tensor math).

An evaluation samples ``n`` completions for each of ``N`` prompts; ``rewards_NK`` holds their rewards
(row ``i``: prompt ``i``'s ``n`` samples). A sample *passes* when its reward is at least a threshold
(1.0 for 0/1 rewards); ``c_i`` is the number of passing samples of prompt ``i``.

* ``reward_mean``: the mean reward over all ``N x n`` samples.
* ``mean@k``: the mean over prompts of each prompt's mean reward over its ``n`` samples. Every prompt
  has the same ``n`` samples here, so it equals ``reward_mean``; it is kept under the name other
  libraries log it as, to make their dashboards comparable.
* ``pass@j``: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained
  on Code", eq. 1): per prompt ``1 - C(n - c, j) / C(n, j)``, the probability that at least one of
  ``j`` samples drawn without replacement from the ``n`` passes, averaged over prompts. For ``j = 1``
  it is ``c / n``, the fraction of passing samples (so pass@1 is an unbiased estimate of one
  sample's success rate whatever ``n``); for ``j = n`` it is 1 when any sample passes, else 0.

The product form ``prod_{i = n - c + 1}^{n} (1 - j / i)`` of ``C(n - c, j) / C(n, j)`` avoids the
huge binomials, and is 0 as soon as ``n - c < j`` (one factor is ``1 - j / j``).
"""

from __future__ import annotations

import torch


def passing_counts(rewards_NK: torch.Tensor, threshold: float) -> torch.Tensor:
    """How many of each prompt's samples have a reward of at least ``threshold``."""
    return (rewards_NK >= threshold).sum(dim=-1)


def pass_at_k(counts_N: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Chen et al.'s unbiased pass@k per prompt, from ``counts_N`` passing samples out of ``n``
    (float64). Needs ``1 <= k <= n``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={n}")
    i_K = torch.arange(1, n + 1, dtype=torch.float64, device=counts_N.device)
    # Factor i takes part in the product when i > n - c, i.e. for the c largest i.
    in_product_NK = i_K.unsqueeze(0) > (n - counts_N.to(torch.float64)).unsqueeze(-1)
    factors_NK = torch.where(in_product_NK, 1.0 - k / i_K, torch.ones_like(i_K))
    return 1.0 - factors_NK.prod(dim=-1)


def eval_summary(rewards_NK: torch.Tensor, threshold: float) -> dict[str, torch.Tensor]:
    """``reward_mean``, ``mean@k``, ``pass@1`` and ``pass@k`` (k = the samples per prompt) of
    ``rewards_NK`` as 0-d float64 tensors (see the module docstring)."""
    if rewards_NK.dim() != 2 or rewards_NK.numel() == 0:
        shape = list(rewards_NK.shape)
        raise ValueError(f"eval_summary needs a non-empty [prompts, samples] tensor, got shape {shape}")
    rewards_NK = rewards_NK.to(torch.float64)
    n = rewards_NK.shape[1]
    counts_N = passing_counts(rewards_NK, threshold)
    return {
        "reward_mean": rewards_NK.mean(),
        "mean@k": rewards_NK.mean(dim=-1).mean(),
        "pass@1": pass_at_k(counts_N, n, 1).mean(),
        "pass@k": pass_at_k(counts_N, n, n).mean(),
    }
