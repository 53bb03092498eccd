"""Plug-ins given to run.py by import path in the end-to-end tests (and shown in the README)."""
import threading
import time
from pathlib import Path

import torch

from buffer import Buffer
from losses import LossInputs
from workflows import MathWorkflow, MultiTurnWorkflow, in_thread, last_number


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


class LaggedRewardWorkflow(MathWorkflow):
    """Finishes its rollouts without rewards; a background thread fills them in through the
    buffer API a moment later (like a human rater or a slow external judge)."""

    async def run(self, task, engine, n):
        group = await super().run(task, engine, n)
        rewards = [float(len(e.info["response"]) % 2 == 0) for e in group]
        for e in group:
            e.reward = None
        threading.Thread(target=self._rate_later, args=(group[0].group_id, rewards), daemon=True).start()
        return group

    def _rate_later(self, group_id, rewards):
        buffer = Buffer(Path(self.run_dir) / "buffer.sqlite")
        time.sleep(0.3)
        for _ in range(600):  # the explorer writes the group with its batch
            try:
                buffer.set_rewards(group_id, rewards)
                return
            except ValueError:
                time.sleep(0.1)


class FlakyWorkflow(MathWorkflow):
    """Every third task's first attempt hangs (a blocking environment call), every third+1
    raises; retries succeed."""

    attempts: dict = {}

    async def run(self, task, engine, n):
        k = self.attempts[task.task_id] = self.attempts.get(task.task_id, 0) + 1
        index = int(task.task_id.rsplit("/", 1)[1])
        if k == 1 and index % 3 == 0:
            await in_thread(time.sleep, 3600)
        if k == 1 and index % 3 == 1:
            raise ConnectionError("environment crashed")
        return await super().run(task, engine, n)


class CountdownEnv:
    """The policy must count down from the task's number to 0, one number per turn."""

    def reset(self, task):                     # first user message; called again on reuse
        self.left = int(task.answer)
        return f"Count down from {self.left} to 0, one number per reply."

    def step(self, reply):                     # -> (next message or None = over, reward)
        if last_number(reply) != str(self.left):
            return None, 0.0                   # wrong number: the episode ends, reward 0
        self.left -= 1
        return (None, 1.0) if self.left < 0 else ("Next.", None)


class Countdown(MultiTurnWorkflow):
    max_turns = 12

    def make_env(self):                        # environments are reset and reused
        return CountdownEnv()
