"""Advantage estimators besides GRPO (the contract of losses.py), in `ADVANTAGES`, which the
composition root merges into the core's when --advantage names one of them."""

import torch

from losses import group_stats, grpo_advantages


def dr_grpo_advantages(rewards, group_index, episode_index=None, token_counts=None):
    """Dr. GRPO: r - mean_group, no std division. [B] -> [B]. Source: arXiv:2503.20783 sec. 3.2.
    Reference: verl core_algos.py compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo=False)
    @ b178a3c."""
    return rewards - group_stats(rewards, group_index)[0]


def rloo_advantages(rewards, group_index, episode_index=None, token_counts=None):
    """RLOO: r_i - mean of the rest of its group; a group of one keeps r. [B] -> [B]. Source:
    arXiv:2402.14740 eq. 10. Reference: verl core_algos.py compute_rloo_outcome_advantage
    @ b178a3c."""
    mean, _, count = group_stats(rewards, group_index)
    # [B]
    return torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1), rewards)


def reinforce_pp_advantages(
    rewards,
    group_index,
    episode_index=None,
    token_counts: torch.Tensor | None = None,
    group_baseline: bool = True,
    eps: float = 1e-8,
):
    """REINFORCE++(-baseline): r - group mean (if `group_baseline`), whitened over the batch's
    tokens (`token_counts` [B] weights). [B] -> [B]. Source: arXiv:2501.03262 sec. 3. Reference:
    verl core_algos.py compute_reinforce_plus_plus(_baseline)_outcome_advantage @ b178a3c."""
    adv = rewards - group_stats(rewards, group_index)[0] if group_baseline else rewards  # [B]
    w = torch.ones_like(adv) if token_counts is None else token_counts.to(adv.dtype)  # [B]
    n = w.sum()  # []
    mean = (w * adv).sum() / n.clamp(min=1)  # []
    var = (w * (adv - mean) ** 2).sum() / (n - 1).clamp(min=1)  # []
    return (adv - mean) * torch.rsqrt(var + eps)  # [B]


def stepwise_grpo_advantages(
    rewards, group_index, episode_index, token_counts=None, eps: float = 1e-6
):
    """GRPO over episodes (each with its last sample's reward), given to all their samples.
    [B] -> [B]. Source: arXiv:2505.17826 sec. 2.2. Reference: Trinity-RFT
    trinity/algorithm/advantage_fn/multi_step_grpo_advantage.py @ 369bf62."""
    T = int(episode_index.max()) + 1
    last = torch.zeros(T, dtype=torch.long, device=rewards.device).scatter_reduce(
        0,
        episode_index,
        torch.arange(len(rewards), device=rewards.device),
        "amax",
        include_self=False,
    )  # [T]
    adv = grpo_advantages(rewards[last], group_index[last], eps=eps)  # [T]
    return adv[episode_index]  # [B]


ADVANTAGES = {
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "grpo_stepwise": stepwise_grpo_advantages,
}
