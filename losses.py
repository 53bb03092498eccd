"""The default algorithm as pure tensor functions (GRPO, PPO clip, KL, aggregation, the length
penalty, the filters' pass), the core's registries of advantages, policy losses and filters, and
`resolve_algorithm`, which turns a config's names into an `Algorithm` through the registries the
composition root (components.py) hands it. B sequences, T response tokens. Contracts, also of
plug-ins given by import path `module.function` (docs/algorithms.md):
  ADVANTAGES[name](rewards [B], group_index [B], episode_index [B], token_counts [B], **kw) -> [B]
  POLICY_LOSSES[name].fn(LossInputs, **kw) -> {"loss": [B, T], metrics: [B, T]}, its needs in a
    PolicyLoss
  FILTERS[name](tokens, behaviour_logprobs, advantage, action_mask, **kw) -> bool keep
"""

import dataclasses
import importlib
import inspect
import os
import sys
from typing import Callable

import torch


@dataclasses.dataclass
class LossInputs:
    """Inputs of a policy loss on one micro-batch, all on one device."""

    logprobs: torch.Tensor  # [B, T] under the current policy (grad)
    behaviour_logprobs: torch.Tensor  # [B, T] under the behaviour policy (no grad)
    advantages: torch.Tensor  # [B, T] each sequence's advantage over its tokens
    action_mask: torch.Tensor  # [B, T] 1.0 on trained tokens (the experiences' action_mask)
    rewards: torch.Tensor  # [B]
    group_index: torch.Tensor  # [B] int (whole groups present when the loss `needs_groups`)
    ref_logprobs: torch.Tensor | None = None  # [B, T] under the frozen reference policy
    expert: torch.Tensor | None = None  # [B] bool: expert (SFT) sequences
    # [B, T] pi_old, the trust region's anchor where the loss's source has one: the trainer's
    # log-probs at the behaviour version (--old-logprobs recompute); None: behaviour_logprobs
    old_logprobs: torch.Tensor | None = None

    def anchor(self) -> torch.Tensor:
        """pi_old's log-probs [B, T]: old_logprobs, or the behaviour log-probs without them."""
        return self.behaviour_logprobs if self.old_logprobs is None else self.old_logprobs


AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var")


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy loss (the contract above) and what the trainer arranges around it. A plug-in
    named by import path is a plain function (these defaults) or a PolicyLoss object."""

    fn: Callable[..., dict[str, torch.Tensor]]
    agg: str = "token-mean"  # its aggregation under --loss-agg auto
    needs_groups: bool = False  # whole groups in one micro-batch (a pairwise loss)
    needs_ref: bool = False  # the reference model's log-probs (LossInputs.ref_logprobs)
    split_expert: bool = False  # expert and rollout tokens aggregated apart (`part_totals`)
    # a clip, cap or mask bounds its step on stale experiences (False: the staleness guard warns)
    trust_region: bool = True


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """What the trainer runs of a config (`resolve_algorithm`): its options stay in the config
    (advantage_kwargs, policy_loss_kwargs, the filters' tables)."""

    advantage: Callable[..., torch.Tensor]  # the ADVANTAGES contract
    loss: PolicyLoss
    agg: str  # the aggregation of AGGREGATIONS the loss is reduced with
    filters: dict[str, Callable[..., bool]]  # name -> filter (the FILTERS contract), in order
    needs_ref: bool  # the KL terms or the loss need the frozen reference policy's log-probs


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x where mask is 1. [B, T] -> scalar."""
    return (x * mask).sum()


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum over tokens: [B, T] -> [B]."""
    return (x * mask).sum(-1)


def group_stats(
    x: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-member (mean, unbiased std, count) of each group: x [B], index [B] -> three [B], in
    x's dtype.

    Computed in float64, and a group whose members are all equal gets its members' own value as
    mean and an std of exactly 0: in float32 the mean of eight 0.7s is not 0.7, and that rounding
    noise divided by a tiny std would give every member of a constant group the same nonzero
    advantage (a class of bug reported in NeMo-RL). A group of one has mean 0 and std 1 (verl
    core_algos.py compute_grpo_outcome_advantage @ b178a3c).
    """
    x64 = x.double()  # [B]
    G = int(index.max()) + 1
    onehot = torch.nn.functional.one_hot(index, G).double()  # [B, G]
    count = onehot.sum(0)  # [G]
    mean = (onehot * x64[:, None]).sum(0) / count  # [G]
    dev = x64 - mean[index]  # [B]
    var = (onehot * dev[:, None] ** 2).sum(0) / (count - 1).clamp(min=1)  # [G]
    inf = torch.full((G,), torch.inf, dtype=x64.dtype, device=x.device)  # [G]
    low = inf.scatter_reduce(0, index, x64, "amin")  # [G]
    high = (-inf).scatter_reduce(0, index, x64, "amax")  # [G]
    constant = (low == high)[index]  # [B]
    single = count[index] == 1  # [B]
    member_mean = torch.where(single, 0.0, torch.where(constant, x64, mean[index]))  # [B]
    member_std = torch.where(single, 1.0, torch.where(constant, 0.0, var.sqrt()[index]))  # [B]
    return member_mean.to(x.dtype), member_std.to(x.dtype), count[index].to(x.dtype)


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, total_tokens, total_seqs
) -> torch.Tensor:
    """This micro-batch's share of the global loss; loss, mask [B, T]; the totals count the global
    batch's trained tokens / sequences (or [B]: each sequence's part's, `part_totals`).
    Modes: token-mean (DAPO, arXiv:2503.14476 sec. 3.3), seq-mean-token-sum, seq-mean-token-mean
    (GRPO); verl's agg_loss (verl/trainer/ppo/core_algos.py @ b178a3c)."""

    # a number, 0-d or [B] -> a float tensor >= 1
    def _totals(total, like: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(total, dtype=like.dtype, device=like.device).clamp(min=1)

    if mode == "token-mean":
        tokens = _totals(total_tokens, loss)  # [] or [B]
        return (loss * mask / (tokens[:, None] if tokens.dim() else tokens)).sum()
    if mode == "seq-mean-token-sum":
        return (seq_sum(loss, mask) / _totals(total_seqs, loss)).sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum(loss, mask) / mask.sum(-1).clamp(min=1) / _totals(total_seqs, loss)).sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {list(AGGREGATIONS)}")


def part_totals(
    token_counts: torch.Tensor, expert: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, its part's (expert or rollout) kept tokens and sequences: the totals of
    `aggregate` for a `split_expert` loss. token_counts [N], expert [N], keep [N] -> [N], [N]."""
    kept, is_exp = keep.to(token_counts.dtype), expert.to(token_counts.dtype)  # [N]
    tokens = torch.stack(
        [(token_counts * kept * (1 - is_exp)).sum(), (token_counts * kept * is_exp).sum()]
    )  # [2]
    seqs = torch.stack([(kept * (1 - is_exp)).sum(), (kept * is_exp).sum()])  # [2]
    return tokens[expert.long()], seqs[expert.long()]


def grpo_advantages(rewards, group_index, episode_index=None, token_counts=None, eps: float = 1e-6):
    """GRPO: (r - mean_group) / (std_group + eps). [B] -> [B]. Source: DeepSeekMath,
    arXiv:2402.03300 sec. 4.1.2; verl core_algos.py compute_grpo_outcome_advantage @ b178a3c."""
    mean, std, _ = group_stats(rewards, group_index)
    return (rewards - mean) / (std + eps)


def length_penalty(rewards: torch.Tensor, lengths: torch.Tensor, coef: float) -> torch.Tensor:
    """Rewards minus `coef` per unit of length (--length-penalty). [B], [B] -> [B]."""
    return rewards - coef * lengths


def kl_estimate(logp: torch.Tensor, logq: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p || q) from a sample of p: k1, k2, k3 (= low_var, clamped as
    verl's). [B, T] -> [B, T]. The values estimate KL(p || q); as a loss on p's own samples the
    gradients differ: k1's is 0 in expectation, k2's is that of KL(p || q), k3's that of
    KL(q || p) (tests/test_losses.py enumerates a categorical policy). ValueError: unknown kind.
    Source: J. Schulman, "Approximating KL divergence" (2020); verl core_algos.py
    kl_penalty_forward @ b178a3c."""
    if kind == "k1":
        return logp - logq
    if kind == "k2":
        return 0.5 * (logp - logq) ** 2
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
    log_r = (logq - logp).clamp(-20, 20)
    return (torch.expm1(log_r) - log_r).clamp(-10, 10)


def importance_ratio(inp: LossInputs) -> torch.Tensor:
    """pi_theta / pi_old: exp(logprobs - inp.anchor()) [B, T], the log-ratio clamped to
    [-20, 20] as verl does (core_algos.py compute_policy_loss_vanilla @ b178a3c, whose
    old_log_prob is its trainer's recomputation)."""
    return torch.exp((inp.logprobs - inp.anchor()).clamp(-20, 20))


def ppo_clip_loss(
    inp: LossInputs, clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = 3.0
):
    """PPO clipped surrogate with clip-higher and dual clip (None: off): {"loss", "clipped",
    "clipped_low", "clipped_high", "clipped_dual"} [B, T], the clipped tokens in all and by the
    bound that clipped them (low: ratio < 1 - clip_low with A < 0; high: ratio > 1 + clip_high
    with A > 0; dual: the dual clip's bound with A < 0). Source: PPO arXiv:1707.06347 eq. 7; DAPO
    arXiv:2503.14476 sec. 3.1; dual clip arXiv:1912.09729 eq. 5; verl core_algos.py
    compute_policy_loss_vanilla @ b178a3c."""
    ratio = importance_ratio(inp)  # [B, T]
    A = inp.advantages
    unclipped = ratio * A  # [B, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A  # [B, T]
    loss = -torch.minimum(unclipped, clipped)  # [B, T]
    active = clipped < unclipped  # [B, T]
    dual = torch.zeros_like(active)  # [B, T]
    if dual_clip is not None:
        dual = (A < 0) & (loss > -dual_clip * A)  # [B, T]
        loss = torch.where(dual, -dual_clip * A, loss)
    low = active & (A < 0) & ~dual  # [B, T]
    high = active & (A > 0)  # [B, T]
    return {
        "loss": loss,
        "clipped": (active | dual).float(),
        "clipped_low": low.float(),
        "clipped_high": high.float(),
        "clipped_dual": dual.float(),
    }


def apply_filters(
    filters: dict[str, Callable], filter_kwargs: dict[str, dict], batch, adv: torch.Tensor
) -> tuple[torch.Tensor, dict[str, int]]:
    """Which sequences [N] bool all `filters` (name -> function, the FILTERS contract) keep with
    their `filter_kwargs` (--filters), in order, of a trainer.StepBatch of N sequences with
    advantages `adv` [N]; offline ones always. `filter/<name>`: how many it dropped."""
    keep = torch.ones(len(batch.exps), dtype=torch.bool)
    m = {}
    for name, fn in filters.items():
        drop = [
            i
            for i, e in enumerate(batch.exps)
            if keep[i]
            and not batch.offline[i]
            and not fn(
                e.tokens,
                e.behaviour_logprobs,
                float(adv[i]),
                e.action_mask,
                **filter_kwargs[name],
            )
        ]
        keep[drop] = False
        m[f"filter/{name}"] = len(drop)
    return keep, m


# name -> object, the core's own: the composition root (components.py) merges in the others
# when a run names one
ADVANTAGES: dict[str, Callable] = {"grpo": grpo_advantages}
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo_clip": PolicyLoss(ppo_clip_loss)}
FILTERS: dict[str, Callable] = {}
# the positional arguments each contract passes
ADVANTAGE_ARGS = ("rewards", "group_index", "episode_index", "token_counts")
FILTER_ARGS = ("tokens", "behaviour_logprobs", "advantage", "action_mask")
LOSS_ARGS = ("inputs",)


def imported(name: str, registry: dict, what: str):
    """What `registry` names `name`, or what import path `module.attribute` points to, imported;
    ValueError (one line)."""
    target = registry.get(name, name)
    if not isinstance(target, str):
        return target
    module, _, attr = target.rpartition(".")
    if not module:
        raise ValueError(f"unknown {what} {name!r}; known: {sorted(registry)} or module.function")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {name!r} cannot be imported: {e} ({import_dirs()})") from None


def check_signature(fn, name: str, what: str, kwargs: dict | None, takes: tuple[str, ...]) -> None:
    """ValueError (one line) unless `fn` is callable with the contract's positional arguments
    `takes` and the options `kwargs`."""
    if not callable(fn):
        raise ValueError(f"{what} {name!r} is not callable")
    params = inspect.signature(fn).parameters
    kinds = [p.kind for p in params.values()]
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = sum(kind in by_position for kind in kinds)
    if positional < len(takes) and inspect.Parameter.VAR_POSITIONAL not in kinds:
        raise ValueError(
            f"{what} {name!r} takes ({', '.join(params)}); losses.py's contract passes "
            f"({', '.join(takes)}, **options)"
        )
    if clash := sorted(set(kwargs or {}) & set(takes)):
        raise ValueError(f"{what} {name!r}: {clash} are given by the trainer, not as options")
    bad = sorted(set(kwargs or {}) - set(params))
    if bad and inspect.Parameter.VAR_KEYWORD not in kinds:
        raise ValueError(f"{what} {name!r} takes no argument(s) {bad}; it takes {sorted(params)}")


def resolve(
    name: str, registry: dict, what: str, kwargs: dict | None = None, takes: tuple[str, ...] = ()
) -> Callable:
    """The function or class registered as `name` or at import path `module.attribute`, taking
    the contract's positional arguments `takes` and the options `kwargs`; ValueError (one line)."""
    fn = imported(name, registry, what)
    check_signature(fn, name, what, kwargs, takes)
    return fn


def resolve_loss(
    name: str, kwargs: dict | None = None, registry: dict[str, PolicyLoss] = POLICY_LOSSES
) -> PolicyLoss:
    """The PolicyLoss named `name` in `registry` or at an import path (a function or a
    PolicyLoss), its function checked against `kwargs`; ValueError (one line)."""
    spec = imported(name, registry, "policy_loss")
    if not isinstance(spec, PolicyLoss):
        spec = PolicyLoss(spec)
    check_signature(spec.fn, name, "policy_loss", kwargs, LOSS_ARGS)
    return spec


def resolve_algorithm(
    cfg,
    advantages: dict[str, Callable] = ADVANTAGES,
    policy_losses: dict[str, PolicyLoss] = POLICY_LOSSES,
    filters: dict[str, Callable] = FILTERS,
) -> Algorithm:
    """The Algorithm of `cfg`'s names, looked up in the registries given (name -> object; the
    core's by default) or imported by path `module.function`; ValueError (one line)."""
    advantage = resolve(
        cfg.advantage, advantages, "advantage", cfg.advantage_kwargs, ADVANTAGE_ARGS
    )
    loss = resolve_loss(cfg.policy_loss, cfg.policy_loss_kwargs, policy_losses)
    chosen = {}
    for name, kwargs in cfg.filters.items():
        if not isinstance(kwargs, dict):
            raise ValueError(
                f"filters: the value of {name!r} must be a table of keyword arguments, "
                f"got {kwargs!r}"
            )
        chosen[name] = resolve(name, filters, "filter", kwargs, FILTER_ARGS)
    for name, known in (("loss_agg", ("auto", *AGGREGATIONS)), ("kl_estimator", KL_ESTIMATORS)):
        if getattr(cfg, name) not in known:
            raise ValueError(f"unknown {name} {getattr(cfg, name)!r}; known: {', '.join(known)}")
    agg = loss.agg if cfg.loss_agg == "auto" else cfg.loss_agg
    needs_ref = bool(cfg.kl_loss_coef or cfg.kl_reward_coef or loss.needs_ref)
    return Algorithm(advantage, loss, agg, chosen, needs_ref)


def import_dirs() -> str:
    """Where import paths are looked up (sys.path, installed packages named once), for error
    lines."""
    installed = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    cwd = os.getcwd()
    dirs = {}  # a dict: each named once, in order
    for p in map(os.path.abspath, (p or "." for p in sys.path)):
        if any(p == x or p.startswith(x + os.sep) for x in installed):
            p = "the installed packages"
        elif p == cwd:
            p += " (the working directory)"
        dirs[p] = None
    return f"modules are looked up in {', '.join(dirs)}; add a module's directory to PYTHONPATH"
