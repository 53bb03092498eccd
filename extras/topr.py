"""TOPR, Tapered Off-Policy REINFORCE: the `topr` policy loss, in `POLICY_LOSSES` (merged into
the core's by the composition root when --policy-loss names it)."""

import torch

from losses import LossInputs, PolicyLoss, seq_sum


def topr_loss(inp: LossInputs):
    """-A log pi(y) for A >= 0, -sg(clip(pi(y) / mu(y), 0, 1)) A log pi(y) for A < 0
    (sequence-level ratio): {"loss", "truncated"} [B, T]. Source: Le Roux et al.,
    arXiv:2503.14286 sec. 3 (no reference implementation)."""
    seq_log_ratio = seq_sum(inp.logprobs - inp.behaviour_logprobs, inp.action_mask).detach()  # [B]
    taper = torch.exp(seq_log_ratio.clamp(max=0.0))[:, None]  # [B, 1] = clip(ratio, 0, 1)
    neg = inp.advantages < 0  # [B, T]
    w = torch.where(neg, taper, 1.0)  # [B, T]
    cut = neg & (seq_log_ratio[:, None] > 0)  # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": cut.float()}


POLICY_LOSSES = {"topr": PolicyLoss(topr_loss, "seq-mean-token-sum")}
