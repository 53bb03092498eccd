"""On-policy distillation (--teacher): a frozen teacher scores every sampled token and the
per-token reverse KL joins the advantage (`Teacher`); `evaluate_teacher` measures the teacher's
own held-out accuracy once."""

import dataclasses

import torch

from extras.reference import Reference, frozen_model
from models import resolve_model


def no_advantages(rewards, group_index, episode_index=None, token_counts=None):
    """Zeros [B]: no task advantage, so that --teacher alone trains (pure on-policy
    distillation)."""
    return torch.zeros_like(rewards)


# --advantage none, merged into the core's estimators by the composition root
ADVANTAGES = {"none": no_advantages}


def distill_advantages(
    advantages: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """`advantages` [B, T] plus coef x (teacher - behaviour log-prob) where `mask` [B, T] is 1:
    the negative per-token reverse KL(student || teacher). Source: Agarwal et al.,
    arXiv:2306.13649; Thinking Machines, "On-Policy Distillation" (2025). Reference:
    thinking-machines-lab/tinker-cookbook tinker_cookbook/distillation/ train_on_policy.py
    incorporate_kl_penalty @ 9dfcc3a; Trinity-RFT on_policy_distill_workflow.py @ 2dd56e0;
    prime-rl's teacher_tau (src/prime_rl/trainer/rl/loss.py @ 09e11c7) takes the current
    log-probs instead."""
    return advantages + coef * mask * (teacher_logprobs - behaviour_logprobs)


class Teacher(Reference):
    """The teacher's log-probs of each step's sequences for `trainer`: its own frozen model,
    sharded as the policy."""

    def __init__(self, trainer, model_path: str):
        self.trainer, self.seqs, self.coef = trainer, {}, trainer.cfg.distill_coef
        self.temperature = trainer.cfg.teacher_temperature
        self.model = frozen_model(trainer, model_path)

    @staticmethod
    def check(cfg, tokenizer) -> None:
        """FileNotFoundError / ValueError (one line): cfg.teacher is no model, or its tokenizer
        is not `tokenizer`."""
        from transformers import AutoTokenizer

        theirs = AutoTokenizer.from_pretrained(resolve_model(cfg.teacher))
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"--teacher {cfg.teacher}: its tokenizer differs from the student's "
                f"({len(theirs)} vs {len(tokenizer)} tokens); the teacher must score the "
                "student's token ids"
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
        """(`adv` [B, R] with the teacher's term of micro-batch `mb`,
        {"distill/reverse_kl": [B, R]}); none offline."""
        teacher = self.micro_batch(mb, padding, behaviour)  # [B, R]
        rollout = mask * ~offline[:, None]  # [B, R]
        return (
            distill_advantages(adv, teacher, behaviour, rollout, self.coef),
            {"distill/reverse_kl": (behaviour - teacher) * rollout},
        )


def evaluate_teacher(explorer, graphs=None) -> dict[str, float]:
    """teacher/* (Explorer.evaluate's eval/*) of --teacher on the held-out tasks of `explorer`
    (an explorer.Explorer), with an HFEngine on its engine's device (its decode steps from
    `graphs`, as engines.HFEngine takes them) and its workflow and reward function."""
    from engines import HFEngine
    from explorer import Explorer, engine_seed
    from extras.hub import model_dir
    from workflows import Shuffle

    cfg = explorer.cfg
    theirs = dataclasses.replace(cfg, model=cfg.teacher)
    device = str(getattr(explorer.engine, "device", ""))
    teacher = HFEngine.from_config(
        theirs, model_dir(cfg.teacher), engine_seed(cfg), device, False, graphs
    )
    # no training tasks: the plain selector, no task pipeline, no teacher of its own
    parts = dataclasses.replace(explorer.parts, selector=Shuffle, curate=None, teacher_eval=None)
    held_out = explorer.held_out
    try:
        record = Explorer(theirs, teacher, [], held_out, explorer.dataset, print, parts).evaluate(0)
    finally:
        teacher.close()
    return {
        "teacher/" + k.removeprefix("eval/"): v
        for k, v in (record or {}).items()
        if k.startswith("eval/")
    }
