"""Multi-turn workflows: the policy and an environment take turns (`MultiTurnWorkflow`;
extras/guess_number.py). Their episodes' metrics (samples per episode, turns) are the
explorer's (explorer.episode_record): each sample records its episode in its info."""

import asyncio
import uuid

from buffer import Experience
from workflows import Task, Workflow, chat_ids, floors_info, in_thread


def new_sample(prompt: list[int]) -> dict:
    """An empty sample (dict of tokens, prompt_length, mask, behaviour_logprobs, versions, and
    logprob_floors once a completion has them) starting at `prompt`."""
    return {
        "tokens": list(prompt),
        "prompt_length": len(prompt),
        "mask": [],
        "behaviour_logprobs": [],
        "versions": [],
    }


def extend_sample(s: dict, prompt: list[int], out) -> None:
    """Append the tokens of `prompt` past the sample's (mask 0: not trained on) and the completion
    `out` (mask 1)."""
    extra = prompt[len(s["tokens"]) :]
    s["tokens"] += extra + list(out.tokens)
    s["mask"] += [0] * len(extra) + [1] * len(out.tokens)
    s["behaviour_logprobs"] += [0.0] * len(extra) + list(out.behaviour_logprobs)
    s["versions"] += list(out.versions)
    floors = getattr(out, "logprob_floors", None)
    if floors is not None:  # the kept sets of a truncation, which the trainer replays
        have = s.setdefault("logprob_floors", [])
        # the tokens before (the environment's, mask 0): any finite floor, nothing trains on them
        have += [0.0] * (len(s["mask"]) - len(have) - len(floors)) + list(floors)


class MultiTurnWorkflow(Workflow):
    """Subclasses implement `make_env()`: an environment with `reset(task) -> str` (the first user
    message) and `step(reply) -> (message or None at the end, reward or None)`, called in a thread.
    A turn whose prompt extends the sample's tokens joins that sample, else a new one starts
    (prime-rl's merging rule)."""

    max_turns = 6

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._idle_envs: list = []

    def make_env(self):
        raise NotImplementedError

    def context(self, messages: list[dict]) -> list[dict]:
        """The messages the policy sees this turn (override to compact them: a new sample
        starts)."""
        return messages

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        group_id = uuid.uuid4().hex
        trajs = await asyncio.gather(
            *(self.episode(task, engine, group_id, f"{group_id}/{i}") for i in range(n))
        )
        return [e for t in trajs for e in t]

    async def episode(self, task: Task, engine, group_id: str, episode_id: str) -> list[Experience]:
        """One conversation -> its samples."""
        env = self._idle_envs.pop() if self._idle_envs else self.make_env()
        msgs = self.system() + [{"role": "user", "content": await in_thread(env.reset, task)}]
        samples, reward, turns, transcript = [], None, 0, []
        while reward is None and turns < self.max_turns:
            turns += 1
            prompt = chat_ids(self.tokenizer, self.context(msgs), True)
            if not samples or prompt[: len(samples[-1]["tokens"])] != samples[-1]["tokens"]:
                samples.append(new_sample(prompt))
            out = (await engine.generate(prompt, 1, self.sampling))[0]
            extend_sample(samples[-1], prompt, out)
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
        return [
            Experience(
                s["tokens"],
                s["prompt_length"],
                s["behaviour_logprobs"],
                s["mask"],
                reward,
                group_id,
                task.task_id,
                min(s["versions"]),
                {
                    "episode_id": episode_id,
                    "turns": turns,
                    "samples": len(samples),
                    "versions": [min(s["versions"]), max(s["versions"])],
                    "finish_reason": out.finish_reason,
                    "answer": task.answer,
                    "response": " | ".join(transcript),
                    **floors_info(s.get("logprob_floors")),
                },
            )
            for s in samples
        ]
