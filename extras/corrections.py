"""Rollout corrections for the training-inference mismatch as pure tensor functions: per-token
weights and keep masks from rho = pi_old / pi_behaviour (the trainer's log-probs at the
behaviour version against the engine's), so that the loss's own ratio becomes pi_theta / pi_old
(verl's decoupled mode). B sequences, T response tokens. Sources: volcengine/verl
verl/trainer/ppo/rollout_corr_helper.py, verl/trainer/config/algorithm.py (presets),
docs/algo/rollout_corr.md and rollout_corr_math.md @ b178a3c; IcePop (Ring-1T,
arXiv:2510.18855) as OpenRLHF/OpenRLHF openrlhf/models/loss.py PolicyLoss.forward @ 3c3be62
writes it; TIS: Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training" (fengyao.notion.site/off-policy-rl, 2025).
"""

import math

import torch

CORRECTIONS = ("none", "tis-token", "tis-seq", "mis-token", "mis-seq", "geo-mask", "icepop")
# kind -> (low, high) bounds on rho: verl's presets (verl/trainer/config/algorithm.py @ b178a3c:
# rollout_is_threshold 2.0, decoupled_seq_is_rs "0.5_2.0", decoupled_geo_rs "0.999_1.001");
# IcePop's alpha, beta as OpenRLHF's is_correction_threshold [0.5, 5.0] (train_ppo_ray.py)
DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "tis-token": (None, 2.0),
    "tis-seq": (None, 2.0),
    "mis-token": (0.5, 2.0),
    "mis-seq": (0.5, 2.0),
    "geo-mask": (0.999, 1.001),
    "icepop": (0.5, 5.0),
}
SAFETY_BOUND = 20.0  # verl clamps log-ratios to +-20 before exp (rollout_corr_helper.py)


def check_correction(kind: str, low=None, high=None) -> tuple[float | None, float | None]:
    """The bounds (low, high) of correction `kind`, DEFAULT_BOUNDS' where None. ValueError (one
    line): an unknown kind, bounds for "none", a low bound for a TIS kind (a cap only), a cap
    (high) <= 0, or a band that is not 0 < low <= high (verl's thresholds must be positive:
    rollout_corr_helper.py _parse_rollout_rs_thresholds, compute_rollout_correction_weights
    @ b178a3c)."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown correction {kind!r}; known: {', '.join(CORRECTIONS)}")
    default_low, default_high = DEFAULT_BOUNDS[kind]
    if kind == "none" and (low is not None or high is not None):
        raise ValueError(f"correction 'none' takes no bounds, got low={low}, high={high}")
    if kind.startswith("tis") and low is not None:
        raise ValueError(f"correction {kind!r} caps weights at high only; it takes no low bound")
    low = default_low if low is None else float(low)
    high = default_high if high is None else float(high)
    if high is not None and not high > 0:
        raise ValueError(f"correction {kind!r}: high must be > 0, got {high}")
    if low is not None and not 0 < low <= high:
        raise ValueError(f"correction {kind!r}: need 0 < low <= high, got low={low}, high={high}")
    return low, high


def correction_weights(old_logprobs, behaviour_logprobs, action_mask, kind, low=None, high=None):
    """(weight [B, T], keep [B, T], terms) of correction `kind` (CORRECTIONS) with the bounds of
    `check_correction` (whose ValueError it raises), from old_logprobs [B, T] (pi_old, the
    trainer's), behaviour_logprobs [B, T] (pi_behaviour, the engine's) and action_mask [B, T]
    (1.0 on trained tokens). All detached, in the log-probs' dtype (float32 at least). weight
    multiplies the per-token loss; keep (0 or 1) is 0 on the trained tokens the correction drops
    (verl's modified response_mask); both are 1.0 off the trained tokens, whose log-probs are
    never read. Per kind (log rho clamped to +-20 before exp, as verl does):
      tis-token  weight min(rho_t, high)                  verl rollout_is="token"
      tis-seq    weight min(exp(clamp(sum_t log rho_t)), high), each token of the sequence:
                 the sum of the unclamped log-ratios     verl rollout_is="sequence"
      mis-token  tis-token's weight; keep low <= rho_t <= high (token_k1)
      mis-seq    tis-seq's weight; keep low <= exp(sum_t of the clamped log rho_t) <= high
                 (seq_sum_k1; the preset decoupled_seq_is_rs)
      geo-mask   weight 1; keep low <= exp(sum_t log rho_t / (n + 1e-8)) <= high (seq_mean_k1,
                 masked_mean's 1e-8; the preset decoupled_geo_rs)
      icepop     weight rho_t inside [low, high], else 0 and keep 0: IcePop's M(rho; alpha, beta)
                 (arXiv:2510.18855), compared in ratio space as OpenRLHF does, which
                 exponentiates unclamped (there a log-ratio > 88 gives inf * 0 = NaN in float32)
      none       weight 1, keep 1
    verl's k1 options bound exp(-log rho) by a threshold "a_b" (rollout_corr_helper.py
    compute_rollout_rejection_mask @ b178a3c), i.e. rho by (1/b, 1/a); its docs, and this
    function, bound rho itself: the same for reciprocal bounds (0.5, 2.0).
    terms: "correction/weight" (weight), "correction/capped" (1.0 on kept tokens whose weight
    the cap lowered), "correction/masked" (1.0 where keep is 0), each [B, T] (masked mean over
    the trained tokens: the step's metric); "correction/weight_max" and "correction/weight_min":
    0-dim, over the trained tokens (-inf / inf when there are none)."""
    low, high = check_correction(kind, low, high)
    trained = action_mask > 0  # [B, T]
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    diff = old_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype)  # [B, T]
    # 0 off the trained tokens: their placeholders reach no sum (verl's masked_sum: torch.where)
    diff = torch.where(trained, diff, 0.0)
    log_rho = diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
    seq_log_rho = diff.sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, 1]
    rho = torch.exp(seq_log_rho if kind.endswith("-seq") else log_rho).expand_as(diff)  # [B, T]
    weight = torch.ones_like(diff)
    keep = torch.ones_like(diff, dtype=torch.bool)
    capped = torch.zeros_like(keep)
    if kind[:3] in ("tis", "mis"):
        weight = rho.clamp(max=high)
        capped = rho > high
    if kind in ("mis-token", "mis-seq", "geo-mask"):
        count = trained.to(dtype).sum(-1, keepdim=True)  # [B, 1]
        stat = {
            "mis-token": log_rho,
            "mis-seq": log_rho.sum(-1, keepdim=True),
            "geo-mask": log_rho.sum(-1, keepdim=True) / (count + 1e-8),
        }[kind]
        keep = ((stat >= math.log(low)) & (stat <= math.log(high))).expand_as(diff)
    if kind == "icepop":
        keep = (rho >= low) & (rho <= high)
        weight = torch.where(keep, rho, 0.0)
    weight = torch.where(trained, weight, 1.0)
    keep = keep | ~trained
    terms = {
        "correction/weight": weight,
        "correction/capped": (capped & keep & trained).to(dtype),
        "correction/masked": (~keep).to(dtype),
        "correction/weight_max": weight.masked_fill(~trained, -math.inf).max(),
        "correction/weight_min": weight.masked_fill(~trained, math.inf).min(),
    }
    return weight, keep.to(dtype), terms
