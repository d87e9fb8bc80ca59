"""Group-relative advantages and the per-group reward spread (the informative-group signal).

GRPO (arXiv 2402.03300, §4.1.2) scores each completion against the other completions sampled for
the same prompt: ``A = (r - mean_group(r)) / std_group(r)``. Dr-GRPO (arXiv 2503.20783, §3.1) drops
the division by the std ("unbiased" advantage), because it up-weights groups whose rewards barely
differ. A group whose rewards all tie carries no signal: its advantage is exactly zero, and
DAPO's dynamic sampling (arXiv 2503.14476, §3.2) uses the reward spread to skip such groups.

Shapes: ``N`` groups x ``G`` members.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards_NG: Tensor, *, unbiased: bool, eps: float = 1e-6) -> Tensor:
    """Group-relative advantage of every member, same shape as ``rewards_NG``.

    ``A = r - mean_group(r)``, then divided by ``std_group(r) + eps`` unless ``unbiased``
    (Dr-GRPO). The std is the *sample* std (Bessel's correction, ``torch.std``'s default), as in
    the GRPO reference implementations; a group of one member has no spread, so its std is taken
    as 0 rather than NaN.

    A tied group (every reward exactly equal, a group of one included: ``group_reward_spread == 0``,
    the same test :func:`informative_groups` makes) gets exactly 0 for every member, in both modes.
    The arithmetic alone does not ensure that: the mean of equal rewards that are not dyadic does
    not round back to them (``[0.9] * 3`` in float32 centres to 6e-8, and dividing that by a std
    of the same rounding noise gives 0.056), so tied groups are selected exactly and zeroed. Every
    other group keeps the plain formula above, bit for bit; a NaN or infinite reward never ties.

    Computed in at least float32 (integer or bfloat16 rewards are promoted).
    """
    if rewards_NG.dim() != 2:
        raise ValueError(f"rewards_NG must be 2-D (groups x members), got shape {tuple(rewards_NG.shape)}")
    dtype = torch.promote_types(rewards_NG.dtype, torch.float32)
    r_NG = rewards_NG.to(dtype)
    centred_NG = r_NG - r_NG.mean(dim=1, keepdim=True)
    if unbiased:
        advantages_NG = centred_NG
    elif r_NG.shape[1] < 2:
        # Bessel's std of one sample is 0/0; the group has no spread and its advantage is 0.
        advantages_NG = centred_NG / (torch.zeros_like(r_NG[:, :1]) + eps)
    else:
        advantages_NG = centred_NG / (r_NG.std(dim=1, keepdim=True, correction=1) + eps)
    if r_NG.shape[1] == 0:
        return advantages_NG
    return torch.where(_tied_groups(rewards_NG)[:, None], torch.zeros_like(advantages_NG), advantages_NG)


def _tied_groups(rewards_NG: Tensor) -> Tensor:
    """Boolean ``[N]``: every reward equals the group's first, and it is finite. Decided on the
    rewards as given (before any promotion), so it holds exactly where ``group_reward_spread`` is 0."""
    first_N1 = rewards_NG[:, :1]
    return (rewards_NG == first_N1).all(dim=1) & torch.isfinite(first_N1[:, 0])


def group_reward_spread(rewards_NG: Tensor) -> Tensor:
    """``max - min`` of each group's rewards, shape ``[N]``: exactly 0 for a tied group or a group of
    one (a difference of finite floats is 0 only when they are equal), NaN when a reward is NaN or
    the max and min are the same infinity. :func:`group_advantages` zeroes exactly the groups where it is 0."""
    if rewards_NG.dim() != 2:
        raise ValueError(f"rewards_NG must be 2-D (groups x members), got shape {tuple(rewards_NG.shape)}")
    return rewards_NG.amax(dim=1) - rewards_NG.amin(dim=1)


def informative_groups(rewards_NG: Tensor, threshold: float = 0.0) -> Tensor:
    """Boolean ``[N]``: groups whose reward spread exceeds ``threshold`` (strictly).

    With the default threshold 0 a group is informative exactly when not all its rewards tie,
    i.e. when :func:`group_advantages` does not zero it and it can contribute a nonzero gradient
    (DAPO dynamic sampling, arXiv 2503.14476 §3.2).
    """
    return group_reward_spread(rewards_NG) > threshold
