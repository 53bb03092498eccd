"""On-policy distillation (--teacher): a frozen teacher scores every sampled token and the per-token reverse KL
joins the advantage (`Teacher`); `evaluate_teacher` measures the teacher's own held-out accuracy once."""

import dataclasses

import torch

from extras.reference import Reference, frozen_model
from models import resolve_model


def no_advantages(rewards, group_index, episode_index=None, token_counts=None):
    """Zeros [B]: no task advantage, so that --teacher alone trains (pure on-policy distillation)."""
    return torch.zeros_like(rewards)


def distill_advantages(
    advantages: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """`advantages` [B, T] plus coef x (teacher - behaviour log-prob) where `mask` [B, T] is 1: the negative per-token
    reverse KL(student || teacher). Source: Agarwal et al., arXiv:2306.13649; Thinking Machines, "On-Policy
    Distillation" (2025). Reference: thinking-machines-lab/tinker-cookbook tinker_cookbook/distillation/
    train_on_policy.py incorporate_kl_penalty @ 9dfcc3a; Trinity-RFT on_policy_distill_workflow.py @ 2dd56e0;
    prime-rl's teacher_tau (src/prime_rl/trainer/rl/loss.py @ 09e11c7) takes the current log-probs instead."""
    return advantages + coef * mask * (teacher_logprobs - behaviour_logprobs)


class Teacher(Reference):
    """The teacher's log-probs of each step's sequences for `trainer`: its own frozen model, sharded as the policy."""

    def __init__(self, trainer, model_path: str):
        self.trainer, self.seqs, self.coef = trainer, {}, trainer.cfg.distill_coef
        self.temperature = trainer.cfg.teacher_temperature
        self.model = frozen_model(trainer, model_path)

    @staticmethod
    def check(cfg, tokenizer) -> None:
        """FileNotFoundError / ValueError (one line): cfg.teacher is no model, or its tokenizer is not `tokenizer`."""
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(resolve_model(cfg.teacher))
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"--teacher {cfg.teacher}: its tokenizer differs from the student's ({len(theirs)} vs "
                f"{len(tokenizer)} tokens); the teacher must score the student's token ids"
            )

    def advantages(
        self,
        adv: torch.Tensor,
        mb: list,
        padding: bool,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        offline: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(`adv` [B, R] with the teacher's term of micro-batch `mb`, {"distill/reverse_kl": [B, R]}); none offline."""
        teacher = self.micro_batch(mb, padding, behaviour)  # [B, R]
        rollout = mask * ~offline[:, None]  # [B, R]
        return (
            distill_advantages(adv, teacher, behaviour, rollout, self.coef),
            {"distill/reverse_kl": (behaviour - teacher) * rollout},
        )


def evaluate_teacher(cfg, engine, tasks: tuple) -> dict[str, float]:
    """teacher/* (Explorer.evaluate's eval/*) of cfg.teacher on the held-out tasks of `tasks`, with an HFEngine."""
    from engines import HFEngine
    from explorer import Explorer, engine_seed

    theirs = dataclasses.replace(
        cfg, model=cfg.teacher, lora_rank=0, selector="shuffle", selector_kwargs={}
    )
    teacher = HFEngine.from_config(
        theirs,
        resolve_model(cfg.teacher),
        engine_seed(cfg),
        str(getattr(engine, "device", "")),
        False,
    )
    try:
        record = Explorer(theirs, teacher, [], tasks[1], tasks[2], print).evaluate(0) or {}
    finally:
        teacher.close()
    return {
        "teacher/" + k.removeprefix("eval/"): v for k, v in record.items() if k.startswith("eval/")
    }
