"""TOPR, Tapered Off-Policy REINFORCE (arXiv:2503.14286): the `topr` policy loss.
losses.POLICY_LOSSES names it by import path; importing this file registers it with its
aggregation.
"""
from __future__ import annotations

import torch

from losses import POLICY_LOSSES, LossInputs, register, seq_sum


@register(POLICY_LOSSES, "topr", agg="seq-mean-token-sum")
def topr_loss(inp: LossInputs):
    """TOPR: sequences with A >= 0 get the plain SFT-like term -A log pi(y) (no IS weight);
    sequences with A < 0 get -sg(clip(pi(y) / mu(y), 0, 1)) A log pi(y), with the
    sequence-level ratio pi(y) / mu(y) = exp(sum_t (logprobs - behaviour_logprobs)). The advantage
    plays the paper's baseline-shifted reward R - c. The trajectory objective sums tokens,
    hence seq-mean-token-sum. Returns {"loss", "truncated" (1.0 on negative sequences whose
    ratio was cut to 1)}: [B, T].
    Source: Le Roux et al., "Tapered Off-Policy REINFORCE", arXiv:2503.14286, sec. 3 (no
    reference implementation: checked against the paper's estimator)."""
    seq_log_ratio = seq_sum(inp.logprobs - inp.behaviour_logprobs, inp.mask).detach()    # [B]
    taper = torch.exp(seq_log_ratio.clamp(max=0.0))[:, None]                             # [B, 1] = clip(ratio, 0, 1)
    neg = inp.advantages < 0                                                             # [B, T]
    w = torch.where(neg, taper, 1.0)                                                     # [B, T]
    cut = neg & (seq_log_ratio[:, None] > 0)                                             # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": cut.float()}
