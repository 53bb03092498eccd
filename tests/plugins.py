"""Plug-ins given to run.py by import path in the end-to-end tests (and shown in the README)."""

import asyncio
import os
import threading
import time
from pathlib import Path

import torch

from buffer import Buffer
from extras import checkpoint_sync
from extras.lagged_rewards import set_rewards
from extras.multiturn import MultiTurnWorkflow
from extras.policy_losses import dpo_loss
from losses import LossInputs, PolicyLoss
from workflows import MathWorkflow, in_thread, last_number


def clipped_reinforce(inp: LossInputs, cap: float = 1.5) -> dict[str, torch.Tensor]:
    """REINFORCE with the importance ratio capped at `cap` and detached. Returns [B, T] tensors."""
    ratio = torch.exp(inp.logprobs - inp.behaviour_logprobs).detach()  # [B, T]
    weight = ratio.clamp(max=cap)  # [B, T]
    return {
        "loss": -weight * inp.advantages * inp.logprobs,  # [B, T], aggregated by the trainer
        "capped": (ratio > cap).float(),
    }  # extra metric: loss/capped


def rank_advantages(rewards, group_index, episode_index, token_counts, **kw):
    """Advantage = rank of the reward within the batch, centred: [B] -> [B]."""
    ranks = rewards.argsort().argsort().float()
    return ranks - ranks.mean()


# a pairwise loss given by import path with what it needs (losses.PolicyLoss)
PAIRWISE = PolicyLoss(dpo_loss, needs_groups=True, needs_ref=True)


def rewards_only_advantages(rewards, group_index):
    """Not losses.py's advantage contract (no episode_index, token_counts): refused by name."""
    return rewards


class LaggedRewardWorkflow(MathWorkflow):
    """Finishes its rollouts without rewards; a background thread fills them in through the
    buffer API a moment later (like a human rater or a slow external judge)."""

    async def run(self, task, engine, n):
        group = await super().run(task, engine, n)
        rewards = [float(len(e.info["response"]) % 2 == 0) for e in group]
        for e in group:
            e.reward = None
        threading.Thread(
            target=self._rate_later, args=(group[0].group_id, rewards), daemon=True
        ).start()
        return group

    def _rate_later(self, group_id, rewards):
        buffer = Buffer(Path(self.run_dir) / "buffer.sqlite")
        time.sleep(0.3)
        for _ in range(600):  # the explorer writes the group with its batch
            try:
                set_rewards(buffer, group_id, rewards)
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

    def reset(self, task):  # first user message; called again on reuse
        self.left = int(task.answer)
        return f"Count down from {self.left} to 0, one number per reply."

    def step(self, reply):  # -> (next message or None = over, reward)
        if last_number(reply) != str(self.left):
            return None, 0.0  # wrong number: the episode ends, reward 0
        self.left -= 1
        return (None, 1.0) if self.left < 0 else ("Next.", None)


class Countdown(MultiTurnWorkflow):
    max_turns = 12

    def make_env(self):  # environments are reset and reused
        return CountdownEnv()


class BrokenInitWorkflow(MathWorkflow):
    """A workflow whose constructor fails (a missing environment resource)."""

    def __init__(self, *args, **kwargs):
        raise OSError("environment server unreachable")


class FailingLaterWorkflow(MathWorkflow):
    """Works for the first 4 tasks, then every run raises: the explorer fails mid-run."""

    runs = 0

    async def run(self, task, engine, n):
        type(self).runs += 1
        if type(self).runs > 4:
            raise ConnectionError("environment crashed for good")
        return await super().run(task, engine, n)


def failing_loss(inp: LossInputs) -> dict[str, torch.Tensor]:
    """A policy loss that breaks on the trainer's second step (after one good step)."""
    failing_loss.calls = getattr(failing_loss, "calls", 0) + 1
    if failing_loss.calls > 1:
        raise FloatingPointError("loss diverged")
    return {"loss": -inp.advantages * inp.logprobs}


def failing_loss_that_hangs_on_exit(inp: LossInputs) -> dict[str, torch.Tensor]:
    """A policy loss that raises on its first call and leaves behind something that never
    lets the process finish (an exit handler that waits forever, as a destructor waiting
    on a dead peer would)."""
    import atexit
    import threading

    atexit.register(threading.Event().wait)
    raise FloatingPointError("loss diverged")


class AllExplorersStarted(MathWorkflow):
    """A start barrier for separate explorer launches: each explorer's first rollout waits until
    `explorers` (2) explorers of the run have reached theirs (a file per process in RUN_DIR), so
    every explorer takes part in the run however late its process started."""

    explorers = 2

    async def run(self, task, engine, n):
        if not getattr(self, "started", False):
            root = Path(self.run_dir)
            (root / f"explorer-started-{os.getpid()}").touch()
            while len(list(root.glob("explorer-started-*"))) < self.explorers:
                await asyncio.sleep(0.05)
            self.started = True
        return await super().run(task, engine, n)


class WaitForPublish(MathWorkflow):
    """In-flight test workflow: the first generate call of each explorer batch from the second on pauses at
    its 3rd decode step (inside the engine's step hook) until the trainer has announced weights newer than
    those the call started with, so an in-flight update lands mid-sequence on every batch, however fast or
    slow either side is. Use with --inflight --sync-interval 1 --sync-offset 1 --eval-size 0: then the
    version it waits for is trained from an earlier batch, never from the paused one."""

    deadline_s = 300.0

    async def run(self, task, engine, n):
        if not getattr(engine, "probe_installed", False):
            engine.probe_installed = True
            self.install(engine)
        return await super().run(task, engine, n)

    def install(self, engine) -> None:
        """Wrap `engine.generate_batch` and `engine.step_hook` with the pause."""
        hook, generate = engine.step_hook, engine.generate_batch
        state = {"steps": 0, "start": 0, "pause": False, "labels": set()}

        def generate_batch(*args):
            words = (
                engine.label.split()
            )  # "batch 3 (version 2)"; a retry of the batch keeps its label
            later_batch = len(words) > 1 and words[0] == "batch" and int(words[1]) >= 1
            state.update(
                steps=0,
                start=engine.version,
                pause=later_batch and engine.label not in state["labels"],
            )
            state["labels"].add(engine.label)
            return generate(*args)

        def step_hook():
            state["steps"] += 1
            if (
                state["pause"] and state["steps"] == 3
            ):  # an update loaded at steps 1-2 already landed mid-sequence
                deadline = time.monotonic() + self.deadline_s
                while self.announced(engine) <= state["start"]:
                    if time.monotonic() > deadline:
                        raise TimeoutError("no publish announced")
                    time.sleep(0.01)
            hook()

        engine.generate_batch, engine.step_hook = generate_batch, step_hook

    def announced(self, engine) -> int:
        """The newest weight version the trainer has announced (broadcast sync)."""
        return engine.weights_announced()


class WaitForCheckpoint(WaitForPublish):
    """WaitForPublish for --sync-method checkpoint: waits for a newer published checkpoint."""

    def announced(self, engine) -> int:
        latest = checkpoint_sync.latest_checkpoint(self.run_dir)
        return latest[0] if latest else -1


def difficulty_by_length(tasks, ctx):
    """A task-pipeline plug-in: difficulty = the question's length in characters."""
    for t in tasks:
        t.difficulty = float(len(t.question))
    return tasks
