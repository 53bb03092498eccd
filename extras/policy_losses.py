"""Policy losses besides PPO clip (the contract of losses.py), in `POLICY_LOSSES`, which the
composition root merges into the core's when --policy-loss names one of them."""

import torch

from losses import LossInputs, PolicyLoss, importance_ratio, ppo_clip_loss, seq_sum


def spread(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence value spread evenly over its trained tokens (their sum is the value):
    [B] -> [B, T]."""
    return per_seq[:, None] * mask / mask.sum(-1, keepdim=True).clamp(min=1)


def dppo_kl_loss(
    inp: LossInputs,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
):
    """DPPO-Binary-TV + KL: -ratio adv_tau A inside the trust region on exp(logprobs) -
    exp(behaviour_logprobs), + kl_tau (log ratio)^2: {"loss", "masked"} [B, T]. Source: DPPO
    arXiv:2602.04879; Kimi K2.5 arXiv:2602.02276. Reference: PrimeIntellect-ai/prime-rl
    src/prime_rl/trainer/rl/loss.py default_loss_fn @ 559b447."""
    log_ratio = inp.logprobs - inp.behaviour_logprobs  # [B, T]
    diff = torch.exp(inp.logprobs) - torch.exp(inp.behaviour_logprobs)  # [B, T]
    masked = torch.where(inp.advantages > 0, diff > dppo_mask_high, diff < -dppo_mask_low)  # [B, T]
    pg = torch.where(masked, 0.0, adv_tau * inp.advantages * torch.exp(log_ratio))  # [B, T]
    return {"loss": -pg + kl_tau * log_ratio**2, "masked": masked.float()}


def reinforce_tis_loss(inp: LossInputs, tis_cap: float = 1.02):
    """REINFORCE with truncated, detached IS weights: -min(ratio, tis_cap) A logprobs: {"loss",
    "truncated"} [B, T]. Source: PipelineRL arXiv:2509.19128 sec. 3. Reference:
    ServiceNow/PipelineRL pipelinerl/finetune/rl/__init__.py rl_step @ 58d3934."""
    # PipelineRL weighs by the engine's log-probs, never a recomputed pi_old
    ratio = torch.exp((inp.logprobs - inp.behaviour_logprobs).clamp(-20, 20)).detach()  # [B, T]
    w = ratio.clamp(max=tis_cap)  # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "truncated": (ratio > tis_cap).float()}


def importance_sampling_loss(inp: LossInputs):
    """Plain importance-sampled policy gradient, no clip and no cap: -ratio A with ratio =
    exp(logprobs - behaviour_logprobs): {"loss"} [B, T]. Declares no trust region: on stale
    experiences nothing bounds its step (the staleness guard warns). Source: the Tinker API's
    `importance_sampling` loss (thinking-machines-lab/tinker-cookbook docs/losses.mdx); the
    same as pan-x-c/TuFT src/tuft/loss_fn/importance_sampling.py."""
    ratio = torch.exp((inp.logprobs - inp.behaviour_logprobs).clamp(-20, 20))  # [B, T]
    return {"loss": -ratio * inp.advantages}


def cispo_loss(inp: LossInputs, clip_low: float = 1.0, clip_high: float = 0.2):
    """CISPO: -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) A logprobs: {"loss", "clipped"}
    [B, T]. Source: MiniMax-M1 arXiv:2506.13585 sec. 3.1. Reference: verl core_algos.py
    compute_policy_loss_cispo @ b178a3c."""
    ratio = importance_ratio(inp).detach()  # [B, T]
    w = ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T]
    return {"loss": -w * inp.advantages * inp.logprobs, "clipped": (w != ratio).float()}


def gspo_loss(inp: LossInputs, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO-token: PPO clip of the sequence-level ratio: {"loss", "clipped"} [B, T]. Source:
    arXiv:2507.18071 eq. 5-7. Reference: verl core_algos.py compute_policy_loss_gspo @ b178a3c."""
    lengths = inp.action_mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = seq_sum(inp.logprobs - inp.anchor(), inp.action_mask) / lengths  # [B]
    log_s = seq_log_ratio.detach()[:, None] + inp.logprobs - inp.logprobs.detach()  # [B, T]
    s = torch.exp(log_s.clamp(max=10.0))  # [B, T]
    A = inp.advantages
    clipped = torch.clamp(s, 1 - clip_low, 1 + clip_high) * A  # [B, T]
    return {"loss": -torch.minimum(s * A, clipped), "clipped": (clipped < s * A).float()}


def sft_loss(inp: LossInputs):
    """-logprobs: {"loss"} [B, T]. Reference: Trinity-RFT
    trinity/algorithm/policy_loss_fn/sft_loss.py @ 51d229f."""
    return {"loss": -inp.logprobs}


def dpo_loss(inp: LossInputs, beta: float = 0.1):
    """DPO on each group's best and worst sequence by reward, both carrying the pair's loss:
    {"loss", "pair_correct"} [B, T]. ValueError without ref_logprobs. Source: arXiv:2305.18290
    eq. 7. Reference: huggingface/trl trl/trainer/dpo_trainer.py @ f2cd577."""
    if inp.ref_logprobs is None:
        raise ValueError("dpo needs ref_logprobs (a reference model)")
    logit = beta * seq_sum(inp.logprobs - inp.ref_logprobs, inp.action_mask)  # [B]
    # 0 where no pair, but in the graph: a micro-batch without a pair still runs backward
    # (FSDP2's reduce-scatter)
    per_seq = logit * 0  # [B]
    correct = torch.zeros_like(logit)  # [B]
    for g in inp.group_index.unique():
        members = (inp.group_index == g).nonzero().squeeze(-1)
        r = inp.rewards[members]
        if r.max() > r.min():  # first best and first worst member: the pair
            c, w = members[r.argmax()], members[r.argmin()]
            margin = logit[c] - logit[w]
            per_seq[c] = per_seq[w] = -torch.nn.functional.logsigmoid(margin)
            correct[c] = correct[w] = float(margin.detach() > 0)
    return {
        "loss": spread(per_seq, inp.action_mask),
        "pair_correct": correct[:, None].expand_as(inp.action_mask),
    }


def mix_loss(
    inp: LossInputs,
    mu: float = 0.1,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
):
    """(1 - mu) ppo_clip on rollouts + mu SFT on expert tokens, each part normalised over itself
    (losses.part_totals): {"loss", "clipped", "expert"} [B, T]. Reference: modelscope/Trinity-RFT
    trinity/algorithm/policy_loss_fn/mix_policy_loss.py @ c10d414."""
    expert = (
        inp.expert
        if inp.expert is not None
        else torch.zeros(len(inp.action_mask), dtype=torch.bool, device=inp.action_mask.device)
    )[:, None]  # [B, 1]
    ppo = ppo_clip_loss(inp, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = torch.where(expert, mu * -inp.logprobs, (1 - mu) * ppo["loss"])  # [B, T]
    return {
        "loss": loss,
        "clipped": ppo["clipped"] * ~expert,
        "expert": expert.float().expand_as(loss),
    }


POLICY_LOSSES = {
    "dppo_kl": PolicyLoss(dppo_kl_loss),
    "reinforce_tis": PolicyLoss(reinforce_tis_loss, "seq-mean-token-sum"),
    "cispo": PolicyLoss(cispo_loss),
    "importance_sampling": PolicyLoss(importance_sampling_loss, trust_region=False),
    "gspo": PolicyLoss(gspo_loss, "seq-mean-token-mean"),
    "sft": PolicyLoss(sft_loss),
    "dpo": PolicyLoss(dpo_loss, "seq-mean-token-sum", needs_groups=True, needs_ref=True),
    "mix": PolicyLoss(mix_loss, split_expert=True),
}
