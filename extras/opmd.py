"""Online policy mirror descent (Trinity-RFT, arXiv:2505.17826 appendix A): the `opmd` advantage
and the opmd_* losses, in `ADVANTAGES` and `POLICY_LOSSES` (merged into the core's by the
composition root when a run names one)."""

import math

import torch

from extras.policy_losses import spread
from losses import LossInputs, PolicyLoss, group_stats, seq_sum


def opmd_advantages(
    rewards,
    group_index,
    episode_index=None,
    token_counts=None,
    baseline: str = "mean",
    tau: float = 1.0,
):
    """r - b, b the group's mean ("mean") or tau log mean exp(r / tau) ("logavgexp"); 0 for a
    group of one. [B] -> [B]. ValueError for another baseline. Reference: Trinity-RFT
    trinity/algorithm/advantage_fn/opmd_advantage.py @ 547adf1."""
    if baseline == "mean":
        return rewards - group_stats(rewards, group_index)[0]
    if baseline != "logavgexp":
        raise ValueError(f"opmd baseline must be mean or logavgexp, got {baseline!r}")
    _, std, count = group_stats(rewards, group_index)  # [B], [B]
    baseline = logavgexp_baseline(rewards, group_index, tau)  # [B]
    # a constant group's baseline is its reward; tau * (r / tau) need not round back to r
    baseline = torch.where(std == 0, rewards, baseline)  # [B]
    return rewards - torch.where(count == 1, 0.0, baseline)  # [B]


def logavgexp_baseline(
    rewards: torch.Tensor, group_index: torch.Tensor, tau: float
) -> torch.Tensor:
    """tau * log(mean_group(exp(r / tau))) of each member's group. [B] -> [B]."""
    G = int(group_index.max()) + 1
    scaled = rewards / tau  # [B]
    like = {"dtype": rewards.dtype, "device": rewards.device}
    top = torch.full((G,), -math.inf, **like).scatter_reduce(0, group_index, scaled, "amax")  # [G]
    sums = torch.zeros(G, **like).index_add(
        0, group_index, torch.exp(scaled - top[group_index])
    )  # [G]
    count = torch.zeros(G, **like).index_add(0, group_index, torch.ones_like(rewards))  # [G]
    return (tau * (top + torch.log(sums / count)))[group_index]  # [B]


def opmd_kimi_loss(inp: LossInputs, tau: float = 1.0):
    """(-A logprobs + spread(tau / 2 s^2)) / max(1, tau), s the sequence's summed log-ratio:
    {"loss"} [B, T]. Source: Kimi k1.5 arXiv:2501.12599 sec. 2.3.2. Reference: Trinity-RFT
    trinity/trainer/verl/core_algos.py compute_policy_loss_opmd (fork yaochaorui/Trinity-RFT
    @ 50aba82)."""
    s = seq_sum(inp.logprobs - inp.behaviour_logprobs, inp.action_mask)  # [B]
    loss = -inp.advantages * inp.logprobs + spread(0.5 * tau * s**2, inp.action_mask)  # [B, T]
    return {"loss": loss / max(1.0, tau)}  # [B, T]


def opmd_pairwise_loss(inp: LossInputs, tau: float = 1.0):
    """(d_i - mean_group d)^2 / max(1, tau), d = r - tau (log pi - sg(log pi)): {"loss"} [B, T].
    Reference: Trinity-RFT trinity/trainer/verl/core_algos.py compute_policy_loss_pairwise_opmd
    (fork yaochaorui/Trinity-RFT @ 50aba82)."""
    s = seq_sum(inp.logprobs, inp.action_mask)  # [B]
    d = inp.rewards - tau * (s - s.detach())  # [B]
    same = (inp.group_index[:, None] == inp.group_index[None, :]).to(d.dtype)  # [B, B]
    centred = d - (same @ d) / same.sum(-1)  # [B]
    return {"loss": spread(centred**2 / max(1.0, tau), inp.action_mask)}  # [B, T]


def opmd_simple_loss(inp: LossInputs, tau: float = 1.0):
    """-A logprobs / (1 + tau): {"loss"} [B, T]. Reference: Trinity-RFT
    trinity/algorithm/policy_loss_fn/opmd_policy_loss.py @ 70c21ac."""
    return {"loss": -inp.advantages * inp.logprobs / (1 + tau)}


ADVANTAGES = {"opmd": opmd_advantages}
POLICY_LOSSES = {
    "opmd_kimi": PolicyLoss(opmd_kimi_loss),
    "opmd_pairwise": PolicyLoss(opmd_pairwise_loss, needs_groups=True),
    "opmd_simple": PolicyLoss(opmd_simple_loss),
}
