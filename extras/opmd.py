"""Online policy mirror descent (Trinity-RFT's OPMD family, arXiv:2505.17826 appendix A):
the `opmd` advantage and the `opmd_kimi`, `opmd_pairwise` and `opmd_simple` policy losses.
losses.ADVANTAGES / POLICY_LOSSES name them by import path; importing this file registers
them with their loss attributes.
"""
from __future__ import annotations

import math

import torch

from losses import ADVANTAGES, POLICY_LOSSES, LossInputs, group_stats, register, seq_sum, spread


@register(ADVANTAGES, "opmd")
def opmd_advantages(rewards, group_index, trajectory_index=None, baseline: str = "mean", tau: float = 1.0):
    """OPMD advantages: r - b with the group baseline b = mean(r) ("mean") or
    tau * log(mean(exp(r / tau))) ("logavgexp", the tau log Z of the KL-regularised optimum,
    for opmd_kimi with the same tau); a group of one has b = 0. [B] -> [B].
    Source: Trinity-RFT technical report, arXiv:2505.17826, appendix A. Reference:
    modelscope/Trinity-RFT trinity/algorithm/advantage_fn/opmd_advantage.py @ 547adf1."""
    if baseline == "mean":
        return rewards - group_stats(rewards, group_index)[0]
    if baseline != "logavgexp":
        raise ValueError(f"opmd baseline must be mean or logavgexp, got {baseline!r}")
    single = group_stats(rewards, group_index)[2] == 1                                    # [B]
    return rewards - torch.where(single, 0.0, logavgexp_baseline(rewards, group_index, tau))  # [B]


def logavgexp_baseline(rewards: torch.Tensor, group_index: torch.Tensor, tau: float) -> torch.Tensor:
    """tau * log(mean_group(exp(r / tau))) of each member's group. [B] -> [B]."""
    G = int(group_index.max()) + 1
    scaled = rewards / tau                                                               # [B]
    like = {"dtype": rewards.dtype, "device": rewards.device}
    top = torch.full((G,), -math.inf, **like).scatter_reduce(0, group_index, scaled, "amax")              # [G]
    sums = torch.zeros(G, **like).index_add(0, group_index, torch.exp(scaled - top[group_index]))        # [G]
    count = torch.zeros(G, **like).index_add(0, group_index, torch.ones_like(rewards))                   # [G]
    return (tau * (top + torch.log(sums / count)))[group_index]                           # [B]


@register(POLICY_LOSSES, "opmd_kimi")
def opmd_kimi_loss(inp: LossInputs, tau: float = 1.0):
    """Kimi k1.5 online policy mirror descent in Trinity-RFT's form: per token
    (-A logprobs + spread(tau / 2 * s^2)) / max(1, tau), s = sum_t (logprobs -
    behaviour_logprobs) of the sequence, with A = r - tau log Z from ADVANTAGES["opmd"]
    (baseline "logavgexp", the same tau). Its gradient is the gradient of Kimi's (r - tau log Z - tau s)^2 divided
    by 2 tau max(1, tau); aggregated token-mean, as in Trinity-RFT. Returns {"loss"}: [B, T].
    Source: Kimi k1.5, arXiv:2501.12599, sec. 2.3.2 eq. 3; Trinity-RFT report, arXiv:2505.17826,
    appendix A.1. Reference: Trinity-RFT trinity/trainer/verl/core_algos.py
    compute_policy_loss_opmd ("version 0: kimi-opmd"), read in the fork
    yaochaorui/Trinity-RFT @ 50aba82."""
    s = seq_sum(inp.logprobs - inp.behaviour_logprobs, inp.mask)                         # [B]
    loss = -inp.advantages * inp.logprobs + spread(0.5 * tau * s ** 2, inp.mask)          # [B, T]
    return {"loss": loss / max(1.0, tau)}                                                # [B, T]


@register(POLICY_LOSSES, "opmd_pairwise", needs_groups=True)
def opmd_pairwise_loss(inp: LossInputs, tau: float = 1.0):
    """Pairwise OPMD: with d_i = r_i - tau (log pi(y_i) - sg(log pi(y_i))) (the mirror-descent
    step is anchored at the policy of this step, so d = r in value), tau log Z cancels in
    pairs: sequence i's loss is (d_i - mean_group d)^2 / max(1, tau) (the group's sum of these
    is 1/(2K) sum_ij (d_i - d_j)^2), aggregated token-mean; a group of one gives 0.
    Returns {"loss"}: [B, T]. Source: Trinity-RFT report, arXiv:2505.17826, appendix A.
    Reference: Trinity-RFT trinity/trainer/verl/core_algos.py compute_policy_loss_pairwise_opmd,
    read in the fork yaochaorui/Trinity-RFT @ 50aba82."""
    s = seq_sum(inp.logprobs, inp.mask)                                                  # [B]
    d = inp.rewards - tau * (s - s.detach())                                             # [B]
    same = (inp.group_index[:, None] == inp.group_index[None, :]).to(d.dtype)           # [B, B]
    centred = d - (same @ d) / same.sum(-1)                                              # [B]
    return {"loss": spread(centred ** 2 / max(1.0, tau), inp.mask)}                      # [B, T]


@register(POLICY_LOSSES, "opmd_simple")
def opmd_simple_loss(inp: LossInputs, tau: float = 1.0):
    """Simple OPMD variant: -A logprobs / (1 + tau) with A from the "opmd" advantage (group
    mean baseline): the mirror-descent step regularised towards the current policy, whose
    gradient is the group-mean-baseline policy gradient scaled by 1 / (1 + tau).
    Returns {"loss"}: [B, T]. Source: Trinity-RFT report, arXiv:2505.17826, appendix A.
    Reference: modelscope/Trinity-RFT trinity/algorithm/policy_loss_fn/opmd_policy_loss.py @ 70c21ac."""
    return {"loss": -inp.advantages * inp.logprobs / (1 + tau)}
