"""Plug-ins given to run.py by import path in the end-to-end tests (and shown in the README)."""
import torch

from losses import LossInputs


def clipped_reinforce(inp: LossInputs, cap: float = 1.5) -> dict[str, torch.Tensor]:
    """REINFORCE with the importance ratio capped at `cap` and detached. Returns [B, T] tensors."""
    ratio = torch.exp(inp.logprobs - inp.old_logprobs).detach()   # [B, T]
    weight = ratio.clamp(max=cap)                                   # [B, T]
    return {"loss": -weight * inp.advantages * inp.logprobs,        # [B, T], aggregated by the trainer
            "capped": (ratio > cap).float()}                        # extra metric: loss/capped


def rank_advantages(rewards, group_index, trajectory_index, **kw):
    """Advantage = rank of the reward within the batch, centred: [B] -> [B]."""
    ranks = rewards.argsort().argsort().float()
    return ranks - ranks.mean()
