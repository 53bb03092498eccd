"""The frozen reference policy of --kl-loss-coef, --kl-reward-coef and DPO (`Reference`), which
the composition root hands the trainer when the KL terms or the loss need it."""

import contextlib

import torch
import torch.distributed as dist

from losses import kl_estimate


def frozen_model(trainer, model_path: str):
    """The model at `model_path`, sharded as `trainer`'s policy, without gradients, in eval mode."""
    from trainer import Trainer  # the plain model: a LoRA trainer's `pretrained` would add adapters

    return trainer.shard(Trainer.pretrained(trainer, model_path)).requires_grad_(False).eval()


class Reference:
    """The reference log-probs of each step's sequences for `trainer`: the model at `model_path`,
    or with `adapters_off` (a LoRA trainer's) the policy with its adapters disabled, which is
    the frozen model without a second copy of it."""

    def __init__(self, trainer, model_path: str, adapters_off: bool = False):
        self.trainer, self.seqs, self.model = trainer, {}, None
        # the KL terms compare the policy and the reference at the sampling temperature
        self.temperature = trainer.cfg.temperature
        if not adapters_off:
            self.model = frozen_model(trainer, model_path)

    @contextlib.contextmanager
    def module(self):
        """The reference's model: its own copy, or the policy with its adapters disabled (LoRA)."""
        if self.model is not None:
            yield self.model
        else:
            with self.trainer.model.disable_adapter():
                yield self.trainer.model

    def compute(self, rows: list[list], filler) -> dict[int, torch.Tensor]:
        """Log-probs [R] of this rank's `rows` (trainer.rank_micro_batches), by id(experience)."""
        self.seqs = {}
        with torch.no_grad(), self.module() as ref:
            for mb, padding in self.trainer.rank_micro_batches(rows, filler):
                # over the full vocabulary, no kept-set replay: a KL to the reference (or a
                # teacher) is to its full distribution, from the policy's truncated sampling one
                _, lp, _ = self.trainer.logprobs(
                    ref, mb, padding, temperature=self.temperature, replay=False
                )
                for i, e in enumerate([] if padding else mb):
                    self.seqs[id(e)] = lp[i, : len(e.behaviour_logprobs)].float().cpu()
        return self.seqs

    def micro_batch(self, mb: list, padding: bool, like: torch.Tensor) -> torch.Tensor:
        """The log-probs of micro-batch `mb` in the [B, R] layout of `like` (zeros if `padding`)."""
        out = torch.zeros_like(like)
        for i, e in enumerate([] if padding else mb):
            out[i, : len(e.behaviour_logprobs)] = self.seqs[id(e)].to(like.device)
        return out

    def kl_reward_penalty(
        self, rewards: torch.Tensor, batch, rows: list[list], m: dict
    ) -> torch.Tensor:
        """`rewards` [N] minus kl_reward_coef x each rollout's summed k1 KL(behaviour ||
        reference); collective."""
        coef = self.trainer.cfg.kl_reward_coef
        kl = torch.zeros(len(batch.exps), device=self.trainer.device)  # [N]
        # offline: no behaviour
        for e in (e for row in rows for e in row if not batch.offline[batch.row[id(e)]]):
            kl[batch.row[id(e)]] = (
                kl_estimate(torch.tensor(e.behaviour_logprobs), self.seqs[id(e)], "k1")
                * torch.tensor(e.action_mask)
            ).sum()
        dist.all_reduce(kl)  # each sequence is on one rank
        kl = kl.cpu()
        m["reward/kl_penalty"] = float(coef * kl.mean())
        return rewards - coef * kl
