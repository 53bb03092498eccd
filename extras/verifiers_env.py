"""`--task verifiers:NAME --workflow verifiers:NAME`: train on an installed `verifiers` (>= 0.4)
environment, NAME its taskset id. Each rollout is a verifiers episode recorded like any agent's
(extras/agent.py); its reward is the mean over its traces. verifiers runs the harness programs with
`uv`, which must be on PATH."""

import importlib.util
import os
import shutil

from extras.agent import AgentWorkflow
from extras.offline import hold_out
from workflows import Task

RUNTIME = {"type": "subprocess"}  # where verifiers runs the harness program: a local subprocess


def require_verifiers(what: str) -> None:
    """ValueError (one line) when verifiers, `uv` or the endpoint's packages are missing."""
    from extras.openai_endpoint import require_packages

    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"{what} needs verifiers: pip install verifiers uv openai fastapi uvicorn")
    search = os.pathsep.join([os.environ.get("PATH", ""), os.path.expanduser("~/.local/bin")])
    if shutil.which("uv", path=search) is None:
        raise ValueError(
            f"{what} needs uv on PATH (verifiers runs its harness programs with it): pip install uv"
        )
    require_packages(what)


def load_env(name: str, harness: str | None = None):
    """The verifiers Env of taskset `name` in a local subprocess runtime, with `harness`, else the
    taskset's own, else `null` (verifiers' default `bash` would run the model's commands here).
    ValueError (one line)."""
    require_verifiers(f"verifiers:{name}")
    from verifiers.v1.configs.env import EnvConfig
    from verifiers.v1.env import Env
    from verifiers.v1.envs.single_agent import SingleAgentEnvConfig
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    try:
        own = default_harness_id(name)
        agent = {
            "runtime": RUNTIME,
            "harness": {"id": harness or (own if own != "bash" else "null")},
        }
        cls = environment_class(name)
        config_cls = concrete_type(cls, EnvConfig, origin=Env) or SingleAgentEnvConfig
        return cls(config_cls(taskset={"id": name}, agent=agent))
    except Exception as e:  # verifiers raises many kinds for a missing or broken environment
        raise ValueError(
            f"verifiers environment {name!r} cannot be loaded: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def verifiers_tasks(name: str, train_size: int, eval_size: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out) of the first train_size + eval_size tasks of taskset `name`; ValueError
    (one line)."""
    env = load_env(name)
    tasks = []
    for t in env.taskset:
        if len(tasks) >= train_size + eval_size:
            break
        prompt = t.data.prompt
        text = (
            prompt
            if isinstance(prompt, str)
            else str(prompt[-1].get("content", ""))
            if prompt
            else ""
        )
        tasks.append(
            Task(
                f"verifiers/{name}/{t.data.idx}",
                text,
                str(getattr(t.data, "answer", "")),
                {"verifiers_idx": t.data.idx},
            )
        )
    return hold_out(f"verifiers:{name}", tasks, eval_size)


class VerifiersWorkflow(AgentWorkflow):
    """Rollouts of verifiers environment `env_name`; RuntimeError for a foreign task or a failed
    episode."""

    env_name = ""
    harness: str | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.env = load_env(self.env_name, self.harness)
        self._tasks: dict[int, object] = {}

    def vf_task(self, task: Task):
        """The verifiers task behind a nanorft task (by its position in the taskset)."""
        if (
            idx := task.entry.get("verifiers_idx") if isinstance(task.entry, dict) else None
        ) is None:
            raise RuntimeError(
                f"--workflow verifiers:{self.env_name} needs its tasks: "
                f"--task verifiers:{self.env_name}"
            )
        if idx not in self._tasks:
            for t in self.env.taskset:
                self._tasks[t.data.idx] = t
                if t.data.idx >= idx:
                    break
        return self._tasks[idx]

    async def play(self, client, task: Task):
        import verifiers.v1 as vf

        ctx = vf.ModelContext(
            model="nanorft",
            client=vf.EvalClientConfig(
                base_url=str(client.base_url).rstrip("/"), api_key_var="NANORFT_ENDPOINT_KEY"
            ),
        )
        # serving() holds per-env state: one env per episode
        env = load_env(self.env_name, self.harness)
        async with env.serving():
            episode = await env.run_episode(self.vf_task(task), ctx)
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        if errors or not episode.traces:
            first = errors[0] if errors else None
            raise RuntimeError(
                f"verifiers episode failed: {first.type}: {first.message}"
                if first
                else "verifiers episode has no trace"
            )
        return sum(t.reward for t in episode.traces) / len(episode.traces)


def verifiers_workflow(name: str) -> type[VerifiersWorkflow]:
    """The workflow class of `--workflow verifiers:NAME`; ValueError (one line) when it is
    missing."""
    load_env(name)
    return type(
        f"Verifiers_{name}",
        (VerifiersWorkflow,),
        {"env_name": name, "__module__": __name__, "__qualname__": f"Verifiers_{name}"},
    )
