"""The composition root: every name a command-line flag can give (policy losses, advantage
estimators, filters, reward functions, workflows, task sources, engines, weight-sync methods,
trackers, selectors, modes) mapped to its object by plain imports, and handed to the core.

The core (the other top-level modules) never names extras/; extras/ imports the core. A module of
extras/ is imported here only when the config names a part that lives there, so that a default run
imports none of them.
"""

import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Callable

import torch

import buffer
import cuda_graphs
import engines
import explorer
import ipc_sync
import loop
import losses
import metrics
import models
import perf
import sync
import trainer
import workflows

# --- the algorithm and the trainer (trainer side) ---

# the advantage estimators whose baseline comes from the other rollouts of a group
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opmd", "grpo_stepwise")


def advantages(name: str | None = None) -> dict:
    """--advantage: name -> estimator; the core's when `name` is one of them, else (another name,
    or None: all, as --help lists them) with those of extras/ merged in."""
    if name in losses.ADVANTAGES:
        return losses.ADVANTAGES
    from extras import advantages, distill, opmd

    return {**losses.ADVANTAGES, **advantages.ADVANTAGES, **opmd.ADVANTAGES, **distill.ADVANTAGES}


def policy_losses(name: str | None = None) -> dict:
    """--policy-loss: name -> losses.PolicyLoss; the core's when `name` is one of them, else
    (another name, or None: all) with those of extras/ merged in."""
    if name in losses.POLICY_LOSSES:
        return losses.POLICY_LOSSES
    from extras import opmd, policy_losses, topr

    return {
        **losses.POLICY_LOSSES,
        **policy_losses.POLICY_LOSSES,
        **topr.POLICY_LOSSES,
        **opmd.POLICY_LOSSES,
    }


def filters(names=None) -> dict:
    """--filters: name -> filter; the core's when every name of `names` is one of them (no
    filters, by default), else (or None: all) with those of extras/ merged in."""
    if names is not None and all(name in losses.FILTERS for name in names):
        return losses.FILTERS
    from extras import filters

    return {**losses.FILTERS, **filters.FILTERS}


def algorithm(cfg) -> losses.Algorithm:
    """The losses.Algorithm cfg names (advantage, policy loss, filters). ValueError (one line)."""
    return losses.resolve_algorithm(
        cfg, advantages(cfg.advantage), policy_losses(cfg.policy_loss), filters(cfg.filters)
    )


def trainer_class(cfg) -> type[trainer.Trainer]:
    """The Trainer, or with --lora-rank > 0 the one of peft adapters on the frozen model."""
    if not cfg.lora_rank:
        return trainer.Trainer
    from extras.lora import LoraTrainer

    return LoraTrainer


def reference(cfg, algo: losses.Algorithm, model_path: str):
    """The factory (trainer -> scorer) of the frozen reference policy at `model_path` when the
    KL terms or the loss need one, else None. A LoRA trainer's is its own policy with the
    adapters disabled: no second copy of the model."""
    if not algo.needs_ref:
        return None
    from extras.reference import Reference

    return lambda policy: Reference(policy, model_path, adapters_off=bool(cfg.lora_rank))


def teacher(cfg):
    """The factory (trainer -> scorer) of --teacher's frozen model (on-policy distillation), or
    None without a teacher."""
    if not cfg.teacher:
        return None
    from extras.distill import Teacher

    return lambda policy: Teacher(policy, resolve_model(cfg.teacher))


def uses_old_policy(cfg) -> bool:
    """Whether cfg asks for pi_old, a rollout correction or the mismatch attribution
    (extras/old_policy.py)."""
    return (
        cfg.old_logprobs != "behaviour"
        or cfg.rollout_correction != "none"
        or bool(cfg.rollout_correction_kwargs or cfg.mismatch_every)
    )


def old_policy(cfg):
    """The factory (trainer -> hook) of pi_old, the rollout correction and the mismatch
    attribution when cfg asks for them, else None."""
    if not uses_old_policy(cfg):
        return None
    from extras.old_policy import OldPolicy

    return OldPolicy


def make_trainer(cfg, model_path: str, device: torch.device) -> trainer.Trainer:
    """This rank's trainer of `cfg` on the model at `model_path`: its class, algorithm, frozen
    scorers and old-policy hook. ValueError (one line): a bad algorithm; without peft for LoRA."""
    algo = algorithm(cfg)
    return trainer_class(cfg)(
        cfg,
        model_path,
        device,
        algorithm=algo,
        reference=reference(cfg, algo, model_path),
        teacher=teacher(cfg),
        old_policy=old_policy(cfg),
    )


def check_trainer(cfg) -> None:
    """The trainer's settings before a run starts: the algorithm, trainer.check_config, what the
    parts of extras/ ask (the teacher of advantage none, LoRA's). ValueError (one line);
    FileNotFoundError."""
    algo = algorithm(cfg)
    trainer.check_config(cfg, algo)
    if cfg.advantage == "none" and not cfg.teacher:
        raise ValueError(
            "advantage none makes every advantage 0: it trains beside --teacher only "
            "(on-policy distillation)"
        )
    if cfg.group_size < 2 and cfg.advantage in GROUP_ADVANTAGES and not cfg.train_data:
        raise ValueError(
            f"advantage {cfg.advantage} compares the rollouts of a group: it needs group_size >= 2"
        )
    if cfg.lora_rank:
        from extras.lora import check_config

        check_config(cfg)
    if uses_old_policy(cfg):
        from extras.old_policy import check_config

        check_config(cfg)


def check_teacher(cfg, tokenizer) -> None:
    """--teacher's model scores the student's token ids (`tokenizer`'s); FileNotFoundError /
    ValueError (one line). Nothing without a teacher."""
    if not cfg.teacher:
        return
    from extras.distill import Teacher

    Teacher.check(cfg, tokenizer)


# --- tasks, workflows, rewards, engines (explorer side) ---


def resolve_model(name: str) -> str:
    """--model, --teacher: the local model directory (models.resolve_model); a Hugging Face Hub
    id (owner/name) fetched first (extras/hub.py). FileNotFoundError (one line) when missing."""
    if not models.hub_id(name):
        return models.resolve_model(name)
    from extras.hub import model_dir

    return model_dir(name)


def load_tasks(name: str, *settings) -> tuple:
    """(train, held-out tasks, verifier dataset or None) of --task `name` (`settings`:
    workflows.load_tasks' kwargs, train_size, eval_size, seed, eval_seed): a reasoning-gym
    dataset (workflows.load_tasks), else guess_number, verifiers:NAME, a .jsonl file or a
    Hugging Face dataset (extras/task_sources.py). ValueError (one line); FileNotFoundError."""
    if workflows.is_reasoning_gym(name):
        return workflows.load_tasks(name, *settings)
    from extras.task_sources import load_tasks as any_tasks

    return any_tasks(name, *settings)


def tasks(cfg) -> tuple:
    """The run's tasks (train, held-out, verifier dataset) of cfg's task settings. ValueError
    (one line): none to train on."""
    settings = (cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed, cfg.eval_seed)
    made = train, _, _ = load_tasks(cfg.task, *settings)
    if not train:
        raise ValueError(f"task {cfg.task!r} produced no training tasks")
    return made


def reward_fn(cfg) -> Callable:
    """--reward-fn with --reward-kwargs bound: the core's (workflows.REWARD_FNS), a function at
    an import path, or human (a lagged reward), judge, math_verify. ValueError (one line)."""
    name = cfg.reward_fn
    registry = workflows.REWARD_FNS
    try:
        if name == "human":
            from extras.lagged_rewards import human_reward

            registry = {name: human_reward}
        elif name == "judge":
            from extras.judge import judge_reward

            registry = {name: judge_reward}
        elif name == "math_verify":
            from extras.math_verify_reward import math_verify_reward

            registry = {name: math_verify_reward}
    except ImportError as e:  # the package it needs (math-verify)
        raise ValueError(f"reward_fn {name!r} cannot be imported: {e}") from None
    return workflows.load_reward_fn(name, cfg.reward_kwargs, registry)


def workflow_class(cfg) -> type[workflows.Workflow]:
    """--workflow: the core's (workflows.WORKFLOWS), a class at an import path, guess_number,
    reflect, agent:module.function (an agent's episodes) or verifiers:NAME (an installed verifiers
    environment's). ValueError (one line)."""
    name = cfg.workflow
    registry = workflows.WORKFLOWS
    prefix, colon, rest = name.partition(":")
    if colon and prefix == "agent":
        from extras.agent import agent_workflow

        registry = {name: agent_workflow(rest)}
    elif colon and prefix == "verifiers":
        from extras.verifiers_env import verifiers_workflow

        registry = {name: verifiers_workflow(rest)}
    elif name == "guess_number":
        from extras.guess_number import GuessNumberWorkflow

        registry = {name: GuessNumberWorkflow}
    elif name == "reflect":
        from extras.reflect import ReflectWorkflow

        registry = {name: ReflectWorkflow}
    return workflows.load_workflow(name, registry)


def selector(cfg) -> Callable:
    """--selector, --selector-kwargs: (tasks, seed) -> the Selector; workflows.Shuffle (the
    default), or one of extras/pipelines.py (ValueError at the call: unknown name or keyword)."""
    if cfg.selector == "shuffle" and not cfg.selector_kwargs:
        return workflows.Shuffle
    from extras.pipelines import make_selector

    return functools.partial(make_selector, cfg.selector, cfg.selector_kwargs)


def explorer_parts(cfg) -> explorer.ExplorerParts:
    """The explorer's parts cfg names: workflow, reward function, selector, the task pipeline
    (--task-pipeline) and the teacher's held-out evaluation (--teacher). ValueError (one line)."""
    parts = explorer.ExplorerParts(workflow_class(cfg), reward_fn(cfg), selector(cfg))
    if cfg.task_pipeline:
        from extras.pipelines import curate

        parts = dataclasses.replace(parts, curate=curate)
    if cfg.teacher:
        from extras.distill import evaluate_teacher

        graphs = decode_graphs if cfg.cuda_graphs else None
        evaluate = functools.partial(evaluate_teacher, graphs=graphs)
        parts = dataclasses.replace(parts, teacher_eval=evaluate)
    return parts


def engine_class(cfg) -> type[engines.Engine]:
    """--engine (hf, vllm or module.Class; auto: resolved by `check_explorer`): its class; hf
    with --lora-rank > 0: the HF engine with peft adapters."""
    if cfg.engine == "vllm":
        from extras.vllm_engine import VLLMEngine

        return VLLMEngine
    if cfg.engine == "hf" and cfg.lora_rank:
        from extras.lora import LoraHFEngine

        return LoraHFEngine
    return losses.resolve(cfg.engine, engines.ENGINES, "engine")


def decode_graphs(max_batch: int):
    """The HF engine's decode steps as CUDA graphs (--cuda-graphs), for batches of up to
    `max_batch` rows; the engine asks for them on a GPU only."""
    return cuda_graphs.Graphs(max_batch)


def make_engine(cfg, model_path: str, seed: int, *where) -> engines.Engine:
    """engines.make_engine (`where`: its device, colocated, version and status, in that order)
    of the engine class cfg names (`engine_class`), an HF engine's decode steps CUDA graphs
    where --cuda-graphs asks for them, its bf16 linear layers on a CPU on packed weights
    (perf.pack_linear_weights)."""
    cls = engine_class(cfg)
    build = cls.from_config
    if cfg.cuda_graphs and issubclass(cls, engines.HFEngine):
        build = functools.partial(cls.from_config, graphs=decode_graphs)
    engine = engines.make_engine(cfg, model_path, seed, *where, build=build)
    if isinstance(engine, engines.HFEngine):
        # a decode step multiplies a few rows by every weight: reorder them once, not at each call
        perf.pack_linear_weights(engine.model)
    return engine


def check_pipelines(cfg) -> None:
    """The data-pipeline settings (--selector, the task and experience pipelines, --replay,
    --annotation), if any: extras/pipelines.py's check. ValueError (one line); ConnectionError:
    Label Studio unreachable."""
    pipelines = (cfg.task_pipeline, cfg.experience_pipeline, cfg.replay, cfg.annotation)
    if cfg.selector != "shuffle" or cfg.selector_kwargs or any(pipelines):
        from extras.pipelines import check_config

        check_config(cfg)


def check_explorer(cfg, tokenizer, dataset) -> None:
    """The explorer's settings before a run starts: --engine auto resolved (vllm where vLLM is
    installed, else hf); ValueError (one line) for an engine (vLLM's own checks), a reward
    function or a workflow that cannot work; given the `tokenizer` (rank 0), the workflow is
    made once with the verifier `dataset`."""
    if cfg.engine == "auto":
        cfg.engine = "vllm" if engines.vllm_available() else "hf"
    if cfg.engine == "vllm":
        from extras.vllm_engine import check_config

        check_config(cfg)
    engine_class(cfg)
    workflow = workflow_class(cfg)
    reward = reward_fn(cfg)
    if tokenizer is None:
        return
    sampling = engines.Sampling(cfg.max_tokens)
    try:
        workflow(tokenizer, reward, dataset, cfg.system_prompt, sampling, run_dir=cfg.run_dir)
    except Exception as e:
        raise ValueError(
            f"workflow {cfg.workflow!r} cannot be created: {type(e).__name__}: {e}"
        ) from None


# --- modes, weight sync, buffer, batch sources, trackers (the run) ---

# --log: the package each tracker needs (the hint of the error line)
TRACKER_PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow-skinny sqlalchemy alembic",
}


def tracker_names(cfg) -> list[str]:
    """The trackers cfg.log names. ValueError (one line): an unknown one, or its package missing."""
    names = [x.strip() for x in cfg.log.split(",") if x.strip() and x.strip() != "none"]
    for name in names:
        if name not in TRACKER_PACKAGES:
            known = ", ".join(TRACKER_PACKAGES)
            raise ValueError(f"--log: unknown tracker {name!r} (choose from {known}, or none)")
        if importlib.util.find_spec(name) is None:
            raise ValueError(
                f"--log {name}: the {name} package is not installed "
                f"(pip install {TRACKER_PACKAGES[name]})"
            )
    return names


def trackers(cfg, run_dir: Path) -> list:
    """The tracker objects of cfg.log for metrics.Metrics, each writing under `run_dir`."""
    config = dataclasses.asdict(cfg)
    made = []
    for name in tracker_names(cfg):
        if name == "tensorboard":
            made.append(metrics.TensorBoardLog(run_dir, config))
        elif name == "wandb":
            from extras.wandb_log import WandbLog

            made.append(WandbLog(run_dir, config))
        else:
            from extras.mlflow_log import MLflowLog

            made.append(MLflowLog(run_dir, config))
    return made


def sync_method(cfg, layout) -> str:
    """cfg.sync_method for `layout` (a launch.Placement; auto: ipc where the explorer shares
    trainer rank 0's GPU and the CUDA allocator allows handles, else broadcast). ValueError (one
    line): ipc where the explorer does not share trainer rank 0's device."""
    if cfg.sync_method == "auto":
        # on one GPU a broadcast goes through host memory (gloo), a handle does not (docs/gpus.md)
        if not layout.explorer.startswith("cuda"):
            return "broadcast"
        shares = ipc_sync.shares_rank_0s_device(cfg, layout)
        by_handle = ipc_sync.cuda_ipc_allowed() and shares
        return "ipc" if by_handle else "broadcast"
    if cfg.sync_method == "ipc":
        ipc_sync.check_placement(cfg, layout)
    return cfg.sync_method


def transport(cfg) -> type | None:
    """The class of both ends of the weight-sync group (sync.WeightSync's interface) for
    cfg.sync_method; None for checkpoints, which need no group."""
    if cfg.sync_method == "checkpoint":
        return None
    if cfg.sync_method == "ipc":  # the weights by handle on one device
        return ipc_sync.IpcSync
    return sync.WeightSync


def publisher(cfg, rank: int, send):
    """This trainer rank's weight publisher: none offline (--train-data), a checkpoint, or
    `send` to the explorers' weight-sync group (sync.SentWeights)."""
    if cfg.train_data:
        from extras.offline import NoWeights

        return NoWeights()
    if cfg.sync_method == "checkpoint":
        from extras.checkpoint_sync import CheckpointWeights

        return CheckpointWeights(cfg, rank)
    return sync.SentWeights(send, sync.bucket_elems(cfg))


def receiver(cfg, engine, log, alive, port: int | None, device: str) -> sync.Receiver:
    """The explorer's end of the weight sync: the group at `port`, or (None) the run's
    checkpoints."""
    source = None
    if port is None:
        from extras.checkpoint_sync import CheckpointSource

        source = CheckpointSource(cfg.run_dir, cfg.explorer_name, engine)
    return sync.Receiver(engine, cfg, log, alive, port, device, transport(cfg), source)


def buffer_backend(cfg) -> type | None:
    """The class of cfg.buffer's server connection (PostgreSQL's for a postgresql:// URL), or
    None for a SQLite file."""
    if not cfg.buffer.startswith(buffer.POSTGRES):
        return None
    from extras.postgres import Postgres

    return Postgres


def open_buffer(cfg) -> buffer.Buffer:
    """The run's buffer: RUN_DIR/buffer.sqlite, a SQLite path, or a PostgreSQL URL."""
    return buffer.open_buffer(cfg.buffer, cfg.run_dir, backend=buffer_backend(cfg))


def check_buffer(cfg) -> None:
    """buffer.check_config with the backend of cfg.buffer."""
    buffer.check_config(cfg, buffer_backend(cfg))


def reader_and_log(
    cfg,
    trainer,
    start: int,
    model_path: str,
    rank: int = 0,
    world: int = 1,
    layout=None,
    device=None,
) -> tuple[loop.BatchReader, loop.StepLog]:
    """This rank's BatchReader and StepLog at step `start`. Rank 0 opens the buffer (on --resume,
    experiences served after `start` go back), metrics.jsonl, the batch source (the buffer, or
    --train-data), the shaping (--replay, experience pipeline, --expert-data) and, given
    `layout`, FLOP meters."""
    if rank != 0:
        return loop.BatchReader(rank), loop.StepLog(cfg, rank, world, start)
    buf = open_buffer(cfg)
    buf.set_run_state("trainer_done", None)  # a trainer is running (again)
    if cfg.resume:
        released = buf.release_after(start)
        metrics.print0(
            f"resumed at step {start} (version {trainer.version}); "
            f"{released} experiences served again"
        )
    evals_from_buffer = cfg.mode == "train" and not cfg.train_data
    keep = loop.kept_on_resume(start, evals_from_buffer) if cfg.resume else None
    log = metrics.Metrics(Path(cfg.run_dir), trackers(cfg, Path(cfg.run_dir)), keep)
    shape = None
    if cfg.train_data:
        from extras.offline import OfflineBatches

        batches = OfflineBatches(cfg, trainer.tokenizer, start)
    else:
        batches = loop.BufferBatches(cfg, buf)
        if cfg.replay:  # consumed groups after the fresh ones, shaped with them
            from extras.pipelines import Replay

            shape = Replay(buf, cfg.replay)
    if cfg.experience_pipeline:
        from extras.pipelines import ExperiencePipeline

        shape = ExperiencePipeline(cfg.experience_pipeline, trainer.tokenizer, model_path, shape)
    if cfg.expert_fraction:
        from extras.offline import ExpertMixing

        shape = ExpertMixing(cfg, trainer, shape)
    meters = perf.StepMeters()
    if layout is not None:  # model FLOPs and MFU beside the RL step
        matmul = perf.matmul_params(model_path)  # the explorer samples with the same model
        passes = 3 + trainer.needs_ref  # forward and backward, and a reference model's forward
        trainer_meter = perf.TrainerMeter(matmul, device.type, cfg.dtype, passes)
        # mode both: the explorer's device; mode train: explorers taken to be on the trainer's kind
        explorer_device = layout.explorer if cfg.mode == "both" else device.type
        explorer_device = "cuda" if explorer_device.startswith("cuda") else "cpu"
        explorer_meter = perf.ExplorerMeter(matmul, explorer_device, cfg.dtype)
        meters = perf.StepMeters(trainer_meter, explorer_meter, device.type)
    reader = loop.BatchReader(rank, batches, shape)
    return reader, loop.StepLog(cfg, rank, world, start, buf, log, meters)


def explorer_engine(cfg, model_path: str, layout, version: int, status):
    """Mode both's engine in the explorer process, on the explorer's device of `layout`,
    holding weight `version` and saying what it does to `status`."""
    import engines
    import explorer

    device = engines.use_gpu(layout.explorer)
    seed = explorer.engine_seed(cfg)
    return make_engine(cfg, model_path, seed, device, layout.colocated, version, status)


def explorer_pace(cfg, engine, receiver, core_flags):
    """Mode both's schedule (schedule.Schedule) for the explorer; on one machine's cores the side
    that waits lends its threads to the other (perf.LendingPace)."""
    import engines
    from schedule import Schedule

    pace = Schedule(cfg, receiver, cfg.steps)
    if core_flags is None or not isinstance(engine, engines.HFEngine):
        return pace
    cores = perf.CoreShare(core_flags, 1, cfg.explorer_threads, cfg.trainer_threads)
    perf.lend_threads(engine.model, cores)
    return perf.LendingPace(pace, cores)


def make_explorer(cfg, engine, tasks: tuple, log):
    """The explorer.Explorer of `engine` over `tasks` (train, held-out, verifier dataset) with the
    parts cfg names, records to `log`."""
    import explorer

    return explorer.Explorer(cfg, engine, *tasks, log, explorer_parts(cfg))
