"""pi_old of decoupled PPO, the rollout correction of a step's sequences and the mismatch
attribution: `OldPolicy`, the hook the composition root gives the trainer
(`Trainer(old_policy=...)`) for --old-logprobs recompute, --rollout-correction and
--mismatch-every.

Decoupled PPO separates two ratios (AReaL, arXiv:2505.24298 sec. 5; verl's rollout correction,
docs/algo/rollout_corr.md @ b178a3c): the trust region's pi_theta / pi_old, where pi_old is the
trainer's own computation at the weight version that sampled a sequence, and the correction
weight pi_old / pi_behaviour, which only the engine's mismatch with the trainer moves
(precision, kernels, truncated sampling), not staleness.

The trainer computes pi_old itself (`OldPolicy.old_logprobs`), with the weights of each
version a batch may still come from kept beside its own (`KeptWeights`): the trainer's forward
code, precision and layout exactly, at the cost of one forward pass without gradients over the
batch per step and one copy of the trained parameters per version of the schedule's staleness
bound (the default job: one). The explorer could rescore its rollouts instead, with no copy
kept, but it would need the trainer's packed layout and precision in another process, and its
model is the engine's, not the trainer's.

Only the trainer's core is extended: the loss takes pi_old as `LossInputs.old_logprobs`, and
`Trainer.forward_backward` multiplies each token's loss by the correction's weight and its
mask (`Corrected.micro_batch`).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from extras import mismatch
from extras.corrections import check_correction, correction_weights
from schedule import staleness_bound


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (sharded) parameter, as a plain tensor sharing its memory."""
    return param.to_local() if isinstance(param, DTensor) else param


class KeptWeights:
    """Copies of the trained parameters (this rank's shards) of the last `bound + 1` versions:
    the weights of every version an experience of the schedule may have been sampled with. The
    trainer's own parameters are the newest; with a bound of 0 nothing is copied."""

    def __init__(self, bound: int):
        self.bound = bound
        self.copies: dict[int, list[torch.Tensor]] = {}

    def versions(self, current: int) -> set[int]:
        """The versions whose weights can be loaded while the trainer is at `current`."""
        return {v for v in self.copies if v >= current - self.bound} | {current}

    def keep(self, version: int, params: list[torch.Tensor]) -> None:
        """Copy `params` (the weights at `version`) in, and forget versions older than the bound;
        the oldest copy's memory is reused."""
        if version in self.copies or self.bound == 0:
            return
        stale = [v for v in self.copies if v < version - self.bound]
        reused = self.copies.pop(min(stale)) if stale else None
        for v in stale:
            self.copies.pop(v, None)
        with torch.no_grad():
            if reused is None:
                self.copies[version] = [p.detach().clone() for p in params]
                return
            for copy, p in zip(reused, params):
                copy.copy_(p)
        self.copies[version] = reused

    def load(self, version: int, params: list[torch.Tensor]) -> None:
        """Copy the kept weights of `version` into `params`; KeyError if not kept."""
        with torch.no_grad():
            for p, copy in zip(params, self.copies[version]):
                p.copy_(copy)


def padded(seqs: list[torch.Tensor], R: int, fill: float = 0.0) -> torch.Tensor:
    """Sequences' values [r_i] as one tensor [B, R], `fill` after each one's end."""
    out = seqs[0].new_full((len(seqs), R), fill)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


@dataclass
class Corrected:
    """pi_old and the rollout correction of this rank's sequences, each [R_i] by the sequence's
    index in the step's batch: `old` the log-probs at its behaviour version, `weight` the
    correction's weight on each token's loss (1: none), `keep` 1.0 on the tokens it keeps;
    `sums` the correction's metrics summed over the trained tokens (0-dim, `*_max` and `*_min`
    extremes); `token_counts` [N] each sequence of the batch's trained tokens that the
    correction keeps, over every rank (the loss's token totals)."""

    old: dict[int, torch.Tensor]
    weight: dict[int, torch.Tensor]
    keep: dict[int, torch.Tensor]
    sums: dict[str, torch.Tensor]
    token_counts: torch.Tensor | None = None

    def micro_batch(self, rows: list[int], R: int) -> tuple[torch.Tensor, ...]:
        """(old, weight, keep) [B, R] of the sequences `rows` (batch indices) of a micro-batch."""
        return tuple(
            padded([part[i] for i in rows], R) for part in (self.old, self.weight, self.keep)
        )


def correct(
    old: dict[int, torch.Tensor],
    behaviour: dict[int, torch.Tensor],
    mask: dict[int, torch.Tensor],
    kind: str,
    kwargs: dict,
    device: torch.device,
) -> Corrected:
    """The rollout correction `kind` (corrections.CORRECTIONS, options `kwargs`) of sequences
    given by index: pi_old `old`, `behaviour` log-probs and action `mask`, each [R_i] on
    `device`. Sequence-level corrections see each sequence whole: all of them go in one call."""
    rows = sorted(old)
    R = max((len(old[i]) for i in rows), default=1)
    if rows:
        old_t, behaviour_t, mask_t = (
            padded([part[i] for i in rows], R) for part in (old, behaviour, mask)
        )
    else:  # no sequences on this rank this step: every rank still sums the same metrics
        old_t = behaviour_t = mask_t = torch.zeros(1, 1, device=device)
    weight, keep, terms = correction_weights(old_t, behaviour_t, mask_t, kind, **kwargs)
    sums = {}
    for name, term in terms.items():
        sums[name] = term if term.dim() == 0 else (term.float() * mask_t).sum()
    return Corrected(
        old,
        {i: weight[n, : len(old[i])] for n, i in enumerate(rows)},
        {i: keep[n, : len(old[i])] for n, i in enumerate(rows)},
        sums,
    )


def check_config(cfg) -> None:
    """ValueError (one line) for a rollout correction, pi_old or mismatch attribution the run
    cannot have."""
    kwargs = dict(cfg.rollout_correction_kwargs)
    if unknown := sorted(set(kwargs) - {"low", "high"}):
        raise ValueError(f"rollout_correction_kwargs takes low and high, not {unknown}")
    check_correction(cfg.rollout_correction, kwargs.get("low"), kwargs.get("high"))
    if cfg.rollout_correction != "none" and cfg.old_logprobs != "recompute":
        raise ValueError(
            f"--rollout-correction {cfg.rollout_correction} weighs each token by pi_old / "
            "pi_behaviour: it needs --old-logprobs recompute"
        )
    bound = staleness_bound(cfg)
    if cfg.old_logprobs == "recompute" and bound is None:
        raise ValueError(
            "--old-logprobs recompute keeps the weights of every version an experience may come "
            "from: mode train needs --max-staleness"
        )
    mismatch.check_config(cfg)


class OldPolicy:
    """The trainer's hook for pi_old, the rollout correction and the mismatch attribution,
    made from a trainer.Trainer once its policy is built. Per step, `prepare` before the
    micro-batches."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg
        self.kept = KeptWeights(staleness_bound(trainer.cfg))

    def params(self) -> list[torch.Tensor]:
        """This rank's parts of the trained parameters."""
        return [local(p) for _, p in self.trainer.named_trained_parameters()]

    @contextlib.contextmanager
    def weights_of(self, version: int):
        """Within: the trainer's model holds the kept weights of `version`; after, its own
        again. KeyError: a version not kept."""
        trainer = self.trainer
        if version == trainer.version:
            yield
            return
        params = self.params()
        self.kept.keep(trainer.version, params)
        self.kept.load(version, params)
        try:
            yield
        finally:
            self.kept.load(trainer.version, params)

    def prepare(self, batch, rows: list[list], filler) -> tuple[Corrected | None, dict]:
        """Before the step's micro-batches, the weights still at the trainer's version: keep
        them; every --mismatch-every steps the attribution's metrics (extras/mismatch.py); with
        --old-logprobs recompute pi_old and the rollout correction of this rank's sequences
        `rows` of `batch` (a trainer.StepBatch; `filler` pads micro-batches), else None."""
        trainer = self.trainer
        self.kept.keep(trainer.version, self.params())
        metrics = {}
        every = self.cfg.mismatch_every
        if every and trainer.version % every == 0:
            metrics = mismatch.attribute(self, [e for row in rows for e in row])
        if self.cfg.old_logprobs != "recompute":
            return None, metrics
        return self.corrected(batch, rows, filler), metrics

    @torch.no_grad()
    def old_logprobs(
        self, batch, rows: list[list], filler
    ) -> tuple[dict[int, torch.Tensor], set[int]]:
        """pi_old: each of this rank's sequences' log-probs [R] under the weights of its
        behaviour version, by its index in `batch`, and the indices of those that keep their
        behaviour log-probs instead: offline sequences, and versions no longer kept (a resumed
        run's first steps). Collective: every rank runs the passes of every version of the
        batch, which is the same on every rank."""
        trainer = self.trainer
        kept = self.kept.versions(trainer.version)
        exps = {batch.row[id(e)]: e for row in rows for e in row}
        out = {
            i: torch.tensor(e.behaviour_logprobs, device=trainer.device) for i, e in exps.items()
        }
        unkept = {i for i, e in exps.items() if e.model_version not in kept or batch.offline[i]}
        for v in sorted({e.model_version for e in batch.exps} & kept):
            of_v = [
                [e for e in row if e.model_version == v and not batch.offline[batch.row[id(e)]]]
                for row in rows
            ]
            with self.weights_of(v):
                for mb, padding in trainer.rank_micro_batches([r for r in of_v if r], filler):
                    _, lp, _ = trainer.logprobs(trainer.model, mb, padding)
                    for i, e in enumerate([] if padding else mb):
                        out[batch.row[id(e)]] = lp[i, : len(e.behaviour_logprobs)].float()
        return out, unkept

    def corrected(self, batch, rows: list[list], filler) -> Corrected:
        """pi_old (`old_logprobs`) and the rollout correction of this rank's sequences `rows` of
        `batch`, with each sequence's kept token count over every rank; "old_logprobs/unkept":
        the fraction of trained tokens whose pi_old is their behaviour log-probs."""
        device = self.trainer.device
        old, unkept = self.old_logprobs(batch, rows, filler)
        exps = {batch.row[id(e)]: e for row in rows for e in row}
        behaviour = {i: torch.tensor(e.behaviour_logprobs, device=device) for i, e in exps.items()}
        mask = {
            i: torch.tensor(e.action_mask, dtype=torch.float, device=device)
            for i, e in exps.items()
        }
        kwargs = self.cfg.rollout_correction_kwargs
        out = correct(old, behaviour, mask, self.cfg.rollout_correction, kwargs, device)
        unkept_tokens = sum(float(mask[i].sum()) for i in unkept if not batch.offline[i])
        out.sums["old_logprobs/unkept"] = torch.tensor(unkept_tokens, device=device)
        counts = torch.zeros(len(batch.exps), dtype=torch.float64, device=device)
        for i, keep in out.keep.items():
            counts[i] = (keep.double() * mask[i].double()).sum()
        dist.all_reduce(counts)
        out.token_counts = counts.float().cpu()
        return out
