"""Multi-turn workflows: the policy and an environment take turns (`MultiTurnWorkflow`; the
guess-number game, extras/guess_number.py, and docs/workflows.md build on it)."""
from __future__ import annotations

import asyncio
import uuid

from buffer import Experience
from workflows import Task, Workflow, chat_ids, in_thread


class MultiTurnWorkflow(Workflow):
    """Subclasses implement `make_env()`: an environment with `reset(task) -> str` (the first user
    message) and `step(reply) -> (message or None at the end, reward or None while it goes on)`,
    called in a thread; environments are reused, one whose call raised is dropped.

    Each turn's prompt is the chat template of the conversation so far; while it extends the
    previous prompt + completion as an exact token prefix, the turn joins the same sample (the
    environment's tokens with action_mask 0, behaviour log-prob 0), else a new sample starts
    (prime-rl's merging rule). The samples of an episode share its reward and
    info["episode_id"], "turns", "samples"."""

    max_turns = 6

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._idle_envs: list = []

    def make_env(self):
        raise NotImplementedError

    def context(self, messages: list[dict]) -> list[dict]:
        """The messages the policy sees this turn (override to compact them: a new sample starts)."""
        return messages

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        group_id = uuid.uuid4().hex
        trajs = await asyncio.gather(*(self.episode(task, engine, group_id, f"{group_id}/{i}") for i in range(n)))
        return [e for t in trajs for e in t]

    async def episode(self, task: Task, engine, group_id: str, episode_id: str) -> list[Experience]:
        """One conversation -> its samples."""
        env = self._idle_envs.pop() if self._idle_envs else self.make_env()
        msgs = self.system() + [{"role": "user", "content": await in_thread(env.reset, task)}]
        samples: list[dict] = []
        reward, turns, transcript = None, 0, []
        while reward is None and turns < self.max_turns:
            turns += 1
            prompt = chat_ids(self.tokenizer, self.context(msgs), True)
            cur = samples[-1] if samples else None
            if cur is not None and prompt[: len(cur["tokens"])] == cur["tokens"]:
                extra = prompt[len(cur["tokens"]):]  # environment tokens: not trained on
                cur["tokens"] += extra
                cur["mask"] += [0] * len(extra)
                cur["behaviour_logprobs"] += [0.0] * len(extra)
            else:
                cur = {"tokens": list(prompt), "prompt_length": len(prompt), "mask": [], "behaviour_logprobs": [],
                       "versions": []}
                samples.append(cur)
            out = (await engine.generate(cur["tokens"], 1, self.sampling))[0]
            cur["tokens"] += out.tokens
            cur["mask"] += [1] * len(out.tokens)
            cur["behaviour_logprobs"] += out.behaviour_logprobs
            cur["versions"] += list(out.versions)
            text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": text})
            message, reward = await in_thread(env.step, text)
            transcript.append(text.strip())
            if message is None:
                break
            msgs.append({"role": "user", "content": message})
            transcript.append(message)
        self._idle_envs.append(env)
        reward = 0.0 if reward is None else float(reward)
        return [Experience(s["tokens"], s["prompt_length"], s["behaviour_logprobs"], s["mask"], reward, group_id,
                           task.task_id, min(s["versions"]),
                           {"episode_id": episode_id, "turns": turns, "samples": len(samples),
                            "versions": [min(s["versions"]), max(s["versions"])],
                            "finish_reason": out.finish_reason, "answer": task.answer,
                            "response": " | ".join(transcript)})
                for s in samples]
