"""`--workflow agent:module.function`: train an agent written against the `openai` package.
    async def my_agent(client: openai.AsyncOpenAI, task: workflows.Task) -> float | None | dict:
        reply = await client.chat.completions.create(model="nanorft", messages=[...], tools=[...])
        return 1.0 if ... else 0.0  # its reward; None: lagged; or {"reward": 1.0, "tool_calls": 2}
Each rollout is one episode of the engine's OpenAI-compatible endpoint (extras/openai_endpoint.py),
its calls experiences by the multi-turn rule (`call_samples`). Needs `pip install openai fastapi
uvicorn`."""

import asyncio
import inspect
import math
import numbers
import uuid

from buffer import Experience
from extras.multiturn import extend_sample, new_sample
from workflows import Task, Workflow, floors_info


def call_samples(calls) -> list[dict]:
    """The samples (new_sample + texts) of an episode's calls: a first choice extends the longest
    prefix sample."""
    samples: list[dict] = []
    for call in calls:
        for j, ch in enumerate(call.choices):
            fits = [s for s in samples if j == 0 and call.prompt[: len(s["tokens"])] == s["tokens"]]
            base = max(fits, key=lambda s: len(s["tokens"]), default=None)
            if base is None:
                base = {**new_sample(call.prompt), "texts": []}
                samples.append(base)
            extend_sample(base, call.prompt, ch)
            base["texts"].append(ch.text)
    return samples


def check_reward(r) -> tuple[float | None, str | None, dict]:
    """(reward, error, metrics) of an agent's return: a finite number, None or {"reward": that,
    NAME: number}."""
    metrics = {}
    if isinstance(r, dict):
        metrics = {k: float(v) for k, v in r.items() if k != "reward" and _finite(v)}
        if bad := sorted(set(r) - set(metrics) - {"reward"}):
            return 0.0, f"the agent returned metrics {bad} that are not finite numbers", metrics
        r = r.get("reward", "no reward")
    if r is None:
        return None, None, metrics
    if _finite(r):
        return float(r), None, metrics
    return 0.0, f"the agent returned {r!r}, not a finite number or None", metrics


def _finite(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


class AgentWorkflow(Workflow):
    """Runs `agent(client, task)` once per rollout; RuntimeError for an episode without a model
    call."""

    agent = None
    tool_parser = "hermes"  # extras.chat_tools.TOOL_PARSERS name or module.function
    batch_wait_s = 0.1  # seconds a call waits for the other episodes' calls (engine batching)

    async def run(self, task: Task, engine, n: int) -> list[Experience]:
        from extras.openai_endpoint import endpoint_for

        endpoint, group_id = endpoint_for(engine), uuid.uuid4().hex
        tasks = [
            asyncio.ensure_future(self.episode(endpoint, task, group_id, f"{group_id}/{i}"))
            for i in range(n)
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one episode failed or the run timed out: end the others too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [e for r in results for e in r]

    async def play(self, client, task: Task):
        """The agent's reward for one episode (override for other agent signatures)."""
        return await type(self).agent(client, task)

    async def episode(
        self, endpoint, task: Task, group_id: str, episode_id: str
    ) -> list[Experience]:
        """One agent rollout -> its samples, all with its reward."""
        import openai

        ep = endpoint.open_episode(self.sampling, self.tool_parser, self.batch_wait_s)
        client = openai.AsyncOpenAI(base_url=ep.url, api_key="nanorft", max_retries=0)
        try:
            reward, error, metrics = check_reward(await self.play(client, task))
        finally:
            calls = endpoint.close_episode(ep)
            await client.close()
        if not calls:
            raise RuntimeError("the agent made no model call (it must call the client it is given)")
        return self.experiences(calls, reward, error, task, group_id, episode_id, metrics)

    def experiences(
        self,
        calls,
        reward,
        error,
        task: Task,
        group_id: str,
        episode_id: str,
        metrics: dict | None = None,
    ) -> list[Experience]:
        """Experiences of one episode's calls (info as multi-turn workflows', plus "metrics")."""
        samples = call_samples(calls)
        last = calls[-1].choices[0] if calls[-1].choices else None
        out = []
        for s in samples:
            info = {
                "episode_id": episode_id,
                "turns": len(calls),
                "samples": len(samples),
                "versions": [min(s["versions"], default=0), max(s["versions"], default=0)],
                "finish_reason": last.finish_reason if last else "stop",
                "answer": task.answer,
                "question": task.question,
                "response": " | ".join(t.strip() for t in s["texts"])[:4000],
                **({"reward_error": error} if error else {}),
                **({"metrics": metrics} if metrics else {}),
                **floors_info(s.get("logprob_floors")),
            }
            out.append(
                Experience(
                    s["tokens"],
                    s["prompt_length"],
                    s["behaviour_logprobs"],
                    s["mask"],
                    reward,
                    group_id,
                    task.task_id,
                    info["versions"][0],
                    info,
                )
            )
        return out


def agent_workflow(path: str) -> type[AgentWorkflow]:
    """The AgentWorkflow of `--workflow agent:PATH`; ValueError (one line): missing packages, a bad
    PATH."""
    from extras.openai_endpoint import require_packages
    from losses import resolve

    require_packages(f"--workflow agent:{path}")
    fn = resolve(path, {}, "agent")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent {path!r} must be an async function (client, task) -> float | None")
    if len(inspect.signature(fn).parameters) < 2:
        raise ValueError(f"agent {path!r} must take (client, task)")
    return type(
        f"Agent_{fn.__name__}",
        (AgentWorkflow,),
        {"agent": staticmethod(fn), "__module__": __name__, "__qualname__": f"Agent_{fn.__name__}"},
    )
