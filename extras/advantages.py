"""Advantage estimators besides GRPO (Dr. GRPO, RLOO, REINFORCE++, step-wise GRPO), named by
import path in losses.ADVANTAGES: importing this file registers them (contract: losses.py)."""
from __future__ import annotations

import torch

from losses import ADVANTAGES, group_stats, grpo_advantages, register


@register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards, group_index, trajectory_index=None):
    """Dr. GRPO: r - mean_group, no std division; a group of one keeps r (prime-rl gives
    it 0). [B] -> [B].
    Source: Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783, sec. 3.2.
    Reference: volcengine/verl verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage
    (norm_adv_by_std_in_grpo=False) @ b178a3c; PrimeIntellect-ai/prime-rl
    src/prime_rl/orchestrator/algo/grpo.py @ 559b447."""
    return rewards - group_stats(rewards, group_index)[0]


@register(ADVANTAGES, "rloo")
def rloo_advantages(rewards, group_index, trajectory_index=None):
    """RLOO: r_i - mean of the other members of its group = K/(K-1) (r_i - mean_group); a
    group of one keeps r. [B] -> [B]. Source: Ahmadian et al., arXiv:2402.14740, eq. 10.
    Reference: volcengine/verl verl/trainer/ppo/core_algos.py compute_rloo_outcome_advantage @ b178a3c."""
    mean, _, count = group_stats(rewards, group_index)
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1), rewards)  # [B]


@register(ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantages(rewards, group_index, trajectory_index=None, group_baseline: bool = True,
                            token_counts: torch.Tensor | None = None, eps: float = 1e-8):
    """REINFORCE++: subtract the group mean (the "-baseline" variant, optional; a group of
    one keeps r), then whiten over the batch's tokens: (x - mean) / sqrt(var + eps), each
    sequence weighing its `token_counts` [B] (equal weights when None), unbiased variance.
    [B] -> [B].
    Source: Hu, "REINFORCE++", arXiv:2501.03262, sec. 3. Reference: volcengine/verl
    verl/trainer/ppo/core_algos.py compute_reinforce_plus_plus_baseline_outcome_advantage and
    compute_reinforce_plus_plus_outcome_advantage (gamma 1), verl/utils/torch_functional.py
    masked_whiten @ b178a3c."""
    adv = rewards - group_stats(rewards, group_index)[0] if group_baseline else rewards     # [B]
    w = torch.ones_like(adv) if token_counts is None else token_counts.to(adv.dtype)       # [B]
    n = w.sum()                                                                            # []
    mean = (w * adv).sum() / n.clamp(min=1)                                                # []
    var = (w * (adv - mean) ** 2).sum() / (n - 1).clamp(min=1)                             # []
    return (adv - mean) * torch.rsqrt(var + eps)                                           # [B]


@register(ADVANTAGES, "grpo_stepwise")
def stepwise_grpo_advantages(rewards, group_index, trajectory_index, eps: float = 1e-6):
    """Step-wise GRPO for multi-turn: each trajectory (the samples sharing a
    trajectory_index; its reward is that of its last sample) counts once in its group's
    mean and std, and all its samples get its advantage; a group of one trajectory keeps
    r / (1 + eps). [B] -> [B].
    Source: Trinity-RFT step-wise GRPO (arXiv:2505.17826, sec. 2.2). Reference:
    modelscope/Trinity-RFT trinity/algorithm/advantage_fn/multi_step_grpo_advantage.py @ 369bf62."""
    T = int(trajectory_index.max()) + 1
    last = torch.zeros(T, dtype=torch.long, device=rewards.device).scatter_reduce(
        0, trajectory_index, torch.arange(len(rewards), device=rewards.device), "amax", include_self=False)  # [T]
    adv = grpo_advantages(rewards[last], group_index[last], eps=eps)                      # [T]
    return adv[trajectory_index]                                                          # [B]
