"""Every setting of a run (`Config`), each a flag with its docstring as --help, and
`parse_config`."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import re
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DEFAULT_TASK = "basic_arithmetic"
# the defaults of these settings are tuned for basic_arithmetic: another task gets these unless
# they are given (`task_preset`; the first line of a run names them)
OTHER_TASK_DEFAULTS = {"task_kwargs": {}, "system_prompt": "Give only the final answer."}


@dataclass
class Config:
    """Every setting of a run: each field is a --flag, its docstring the flag's help; `# -- title`
    comments group them."""

    # a field's docstring is its --help text, whose line breaks tyro keeps: one longer than a line
    # stays whole, marked noqa: E501

    # (not a setting) the names set in --config or by flag: parse_config records them
    given = frozenset()

    # -- mode and run
    mode: Literal["both", "explore", "train", "bench"] = "both"
    """both = trainer ranks + a spawned explorer; explore / train = one side each (sharing run_dir); bench = evaluate"""  # noqa: E501
    run_dir: str = "runs/default"
    """output directory (metrics, samples, buffer, plot, final weights)"""
    overwrite: bool = False
    """delete an existing run_dir first (mode both, offline mode train)"""
    resume: bool = False
    """continue a killed run from its last resume state (RUN_DIR/checkpoints) and its buffer"""
    steps: int = 60
    """trainer steps of the run (= explorer batches)"""
    seed: int = 0
    """seed of the training tasks, task order, sampling and model init"""
    eval_seed: int = 0
    """seed of the held-out tasks (reasoning-gym): fixed, so that runs of every --seed are evaluated on the same tasks and share the base model's cached evaluation"""  # noqa: E501
    train_data: str = ""
    """mode train on offline data: JSONL of chats {"messages"} (SFT) or {"prompt", "chosen", "rejected"} (DPO)"""  # noqa: E501
    bench_models: str = ""
    """mode bench: comma-separated models, each as for --model; empty: RUN_DIR/final"""
    bench_k: int = 4
    """mode bench: samples per held-out task (avg@k, pass@k)"""
    # -- model, task and reward
    model: str = "smollm2-135m"
    """a local Hugging Face model directory, a Hub id (owner/name), or smollm2-135m (built in)"""
    task: str = DEFAULT_TASK
    """a reasoning-gym dataset, a JSONL file, a Hugging Face dataset (Hub id, directory, data file) or verifiers:NAME"""  # noqa: E501
    task_kwargs: dict = field(
        default_factory=lambda: {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 2,
            "operators": ["+", "-"],
            "allow_parentheses": False,
        }
    )
    """keyword arguments of the task's dataset (JSON); a task other than basic_arithmetic gets {}"""
    train_size: int = 2000
    """number of generated training tasks"""
    eval_size: int = 100
    """number of held-out tasks (another seed; 0 disables evaluation): 100 gives avg@4 a standard error near 0.04"""  # noqa: E501
    system_prompt: str = "Give only the final answer, as a number."
    """system message before each question ('' for none)"""
    reward_fn: str = "reasoning_gym"
    """reward function: reasoning_gym (the dataset's verifier), math_verify, judge (an LLM judge), or module.function"""  # noqa: E501
    reward_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the reward function (JSON), e.g. {"url": ..., "model": ...} for judge"""
    workflow: str = "math"
    """workflow: math (single turn), guess_number, reflect, module.Class, agent:module.function, or verifiers:NAME"""  # noqa: E501
    # -- explorer (rollouts)
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """inference engine of the explorer: hf, vllm, or auto (vllm when installed, else hf)"""
    vllm_memory_fraction: float = 0.2
    """fraction of device memory (CPU build: of RAM) vLLM reserves for weights and KV cache"""
    batch_size: int = 8
    """tasks per explorer batch (groups per trainer step)"""
    group_size: int = 8
    """rollouts per task (the group of GRPO)"""
    max_tokens: int = 24
    """max tokens of a rollout's response"""
    temperature: float = 0.7
    """sampling temperature of the rollouts (the trainer's logprobs use the same)"""
    top_p: float = 1.0
    """nucleus sampling (1 = off); trainable: the trainer replays the kept set (mask replay)"""
    top_k: int = 0
    """top-k sampling, applied before top-p as vLLM does (0 = off); trainable as top_p is"""
    kept_set_replay: bool = True
    """top-p / top-k: the trainer's log-probs over the kept sets the engine sampled from (false: over the whole vocabulary, every ratio off by the kept mass; for comparison only)"""  # noqa: E501
    eval_temperature: float = 0.0
    """temperature for held-out evaluation (0 = greedy)"""
    eval_k: int = 4
    """samples per held-out task for avg@k (0 = greedy only); version 0 takes at least group_size, for pass@k"""  # noqa: E501
    eval_interval: int = 15
    """evaluate held-out accuracy every this many weight versions (and at the start and end)"""
    workflow_timeout_s: float = 600.0
    """seconds one workflow run (one task's group) may take before it is cancelled and retried"""
    workflow_retries: int = 1
    """extra attempts for a workflow run that timed out or raised; then the task is replaced"""
    difficulty_filter: bool = False
    """drop groups whose rewards are all equal and sample more tasks"""
    refill_rounds: int = 4
    """max extra sampling rounds per batch to replace dropped or failed groups"""
    pool_easy: float = math.inf
    """retire a task once a group's mean reward is >= this (prime-rl's easy pool); inf: never"""
    pool_hard: float = -math.inf
    """retire a task once a group's mean reward is <= this (prime-rl's hard pool); -inf: never"""
    pool_lift_fraction: float = 0.0
    """fraction of each batch drawn back from the retired tasks"""
    explorer_max_batch: int = 256
    """max sequences in one forward pass of the explorer (an evaluation's 400 samples: two)"""
    cuda_graphs: bool = True
    """HF engine on a GPU: replay each decode step as a CUDA graph (no effect on a CPU)"""
    explorer_threads: int = 0
    """torch threads of the explorer (0 = split the cores)"""
    explorer_name: str = "explorer0"
    """name recorded on every experience of this explorer"""
    # -- sync between explorer and trainer
    sync_method: Literal["auto", "broadcast", "ipc", "checkpoint"] = "auto"
    """weight sync: broadcast (torch.distributed), ipc (mode both, explorer on trainer rank 0's device: handles of the weights, CUDA IPC on a GPU, shared memory on the CPU), checkpoint (files in run_dir), or auto (mode both: ipc where the hf explorer shares trainer rank 0's GPU and PYTORCH_CUDA_ALLOC_CONF allows CUDA IPC, else broadcast; explore / train: checkpoint)"""  # noqa: E501
    sync_host: str = "127.0.0.1"
    """address of the weight-sync store, where trainer rank 0 listens"""
    sync_port: int = 0
    """port of the weight-sync store (0 = a free one; explore / train with broadcast: the same on both sides)"""  # noqa: E501
    sync_bucket_mb: float = 64.0
    """broadcast and ipc sync in buckets of at most this many MiB of float32 parameters (0 = the whole model at once)"""  # noqa: E501
    num_explorers: int = 1
    """mode train with broadcast sync: explorers that join the weight-sync group"""
    sync_interval: int = 2
    """trainer steps between two weight publishes to the explorer"""
    sync_offset: int = 0
    """explorer batches generated ahead of the trainer before the first wait (1 with interval 1: one-step off-policy)"""  # noqa: E501
    inflight: bool = False
    """in-flight updates (PipelineRL): new weights replace old ones between decode steps"""
    max_staleness: int = -1
    """train only on experiences at most this many versions old (-1 = no bound)"""
    sync_timeout_s: float = 3600.0
    """longest wait of any single weight-sync collective (seconds)"""
    sync_checksum: bool = False
    """log a float64 sum of the published weights on both ends (one extra pass per publish)"""
    buffer_timeout_s: float = 1800.0
    """mode train: give up when the buffer has not delivered a batch for this long (seconds)"""
    buffer: str = ""
    """experience buffer: "" = RUN_DIR/buffer.sqlite, a SQLite path, or postgresql://user@host:port/db[?schema=NAME]"""
    # -- data pipelines: task and experience operators, selectors, replay, human labels
    task_pipeline: list = field(default_factory=list)
    """task operators run before the loop, a list of {op = NAME, ...}: dedup, length_filter, metadata_difficulty, pass_rate_difficulty, model_difficulty, or module.function"""  # noqa: E501
    selector: str = "shuffle"
    """how the explorer picks the next tasks: shuffle, sequential, random, easy2hard, diff_based, or module.Class"""  # noqa: E501
    selector_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the selector (JSON), e.g. {"target": 0.5, "tau": 0} for diff_based"""
    experience_pipeline: list = field(default_factory=list)
    """experience operators before the trainer, a list of {op = NAME, ...}: quality_reward, diversity_reward, clean, or module.function"""  # noqa: E501
    replay: dict = field(default_factory=dict)
    """prioritised experience replay: {"groups": N} adds N consumed groups to each batch ("decay", "use_count_limit")"""  # noqa: E501
    annotation: dict = field(default_factory=dict)
    """human labels through Label Studio (reward_fn human): {"url": ...}, mode, choices, timeout_s, timeout_reward"""  # noqa: E501
    # -- algorithm
    advantage: str = "grpo"
    """advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, grpo_stepwise, opmd, none, or module.function"""  # noqa: E501
    advantage_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the advantage estimator (JSON), e.g. {"baseline": "logavgexp"} for opmd"""  # noqa: E501
    policy_loss: str = "ppo_clip"
    """policy loss: ppo_clip, dppo_kl, reinforce_tis, cispo, importance_sampling, gspo, sft, dpo, mix, topr, opmd_kimi, opmd_pairwise, opmd_simple, or module.function"""  # noqa: E501
    policy_loss_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the policy loss (JSON), e.g. {"clip_high": 0.28, "dual_clip": 3.0} for ppo_clip"""  # noqa: E501
    old_logprobs: Literal["behaviour", "recompute"] = "behaviour"
    """pi_old, the anchor of the policy loss's ratio: behaviour (the engine's log-probs) or recompute (the trainer's own forward at each experience's behaviour version, from weights it keeps: decoupled PPO; one forward pass per step, one copy of the weights per version of the staleness bound)"""  # noqa: E501
    rollout_correction: str = "none"
    """rollout correction from rho = pi_old / pi_behaviour, the loss's own ratio being pi_theta / pi_old (needs --old-logprobs recompute): none; tis-token (each token's loss weighed by min(rho, high)); tis-seq (by the sequence's capped product of rho); mis-token / mis-seq (the same weights, tokens / sequences with rho outside [low, high] masked out of the loss); geo-mask (sequences whose geometric mean of rho is outside [low, high] masked); icepop (weight rho inside [low, high], tokens outside masked) (docs/algorithms.md)"""  # noqa: E501
    rollout_correction_kwargs: dict = field(default_factory=dict)
    """bounds of the rollout correction (JSON), {"low": ..., "high": ...}; unset: its source's defaults"""  # noqa: E501
    mismatch_every: int = 0
    """every this many steps, split the gap between the behaviour log-probs and the trainer's current ones into its causes, logged as mismatch/<part>/abs and /k3 (docs/mismatch.md); 0 = off; keeps one copy of the weights per version of the staleness bound"""  # noqa: E501
    loss_agg: str = "auto"
    """loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, or auto (the loss's own default)"""  # noqa: E501
    kl_loss_coef: float = 0.0
    """weight of the KL loss term against a frozen reference model (loaded when > 0); which KL its gradient follows is the estimator's (--kl-estimator)"""  # noqa: E501
    kl_estimator: str = "k3"
    """per-token KL estimator of the KL loss, k1, k2, k3, low_var: as a loss on the policy's own samples, k3 (= low_var, clamped) has the gradient of KL(reference || policy), k2 that of KL(policy || reference), and k1 a gradient of 0 in expectation (docs/algorithms.md)"""  # noqa: E501
    kl_reward_coef: float = 0.0
    """reward penalty: this times the summed k1 KL(behaviour || reference) of each sequence"""
    entropy_coef: float = 0.0
    """entropy bonus: subtract this times the token entropy from the loss"""
    length_penalty: float = 0.0
    """reward penalty per unit of response length (length_unit)"""
    length_unit: str = "tokens"
    """unit of the length penalty: tokens (trained tokens) or turns (multi-turn)"""
    filters: dict = field(default_factory=dict)
    """sequence filters before training, name -> kwargs (JSON): zero_advantage, gibberish, repetition, or module.function"""  # noqa: E501
    expert_data: str = ""
    """JSONL of chats ({"messages": [...]}) mixed into each batch as expert data (policy_loss mix)"""  # noqa: E501
    expert_fraction: float = 0.0
    """fraction of each training batch's sequences that are expert data"""
    teacher: str = ""
    """on-policy distillation: a teacher model (as --model, with the student's tokenizer); its log-prob of each sampled token minus the behaviour log-prob joins that token's advantage ('' = none)"""  # noqa: E501
    distill_coef: float = 1.0
    """weight of the teacher's term: each token's advantage gains this x (teacher - behaviour log-prob, in nats); 0 = plain RL"""  # noqa: E501
    teacher_temperature: float = 1.0
    """temperature of the teacher's log-probs: 1.0 scores each token under the teacher's own distribution (tinker-cookbook, prime-rl; Trinity-RFT's setting defaults to 1.0)"""  # noqa: E501
    # -- trainer
    lr: float = 3e-5
    """AdamW learning rate"""
    lr_schedule: str = "cosine_with_min_lr"
    """learning-rate schedule over --steps, a name of transformers' get_scheduler (cosine_with_min_lr: to 0.1 x lr)"""  # noqa: E501
    lr_warmup_steps: int = 3
    """steps of linear warm-up from 0 to lr"""
    lr_schedule_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the schedule (JSON), e.g. {"min_lr_rate": 0.1} for cosine_with_min_lr"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """compute precision of trainer and engines: auto (bfloat16 where the device computes it natively, else float32)"""  # noqa: E501
    allocator: Literal["auto", "tcmalloc", "mimalloc", "system"] = "auto"
    """memory allocator of the processes on a CPU: auto (tcmalloc where installed, else mimalloc; a GPU: system), tcmalloc, mimalloc, system (the C library's malloc)"""  # noqa: E501
    return_memory: bool = True
    """the trainer returns free pages: mimalloc's before its step's peaks, tcmalloc's every 0.2 s"""
    activation_checkpointing: bool = True
    """recompute decoder blocks' activations in the backward pass (less memory, more compute)"""
    compile_layers: bool = True
    """torch.compile the trainer's blocks: CUDA by default, a CPU if given (bf16, a C++ compiler)"""
    causal_rows: bool = True
    """CUDA: a packed row that holds one sequence attends with is_causal (flash kernels) instead of the packed mask"""  # noqa: E501
    fused_adamw: bool = True
    """CUDA: AdamW in one fused kernel per step"""
    one_gpu_fsdp: bool = False
    """CUDA, one GPU: FSDP2 mixed precision; off: float32 parameters under bf16 autocast"""
    checkpoint_if_needed: bool = True
    """CUDA: unless --activation-checkpointing is given, recompute only where a micro-batch's activations would take over half the free memory"""  # noqa: E501
    head_chunk_elems: int = 0
    """logits the trainer's LM head computes at a time (0: 2**22 on a CPU, 2**28 on a GPU)"""
    token_budget: int = 4096
    """max tokens one forward pass of the trainer computes (a packed micro-batch); the default job's steps fit one: a lower CPU peak (docs/benchmarks.md)"""  # noqa: E501
    trainer_threads: int = 0
    """torch threads per trainer rank (0 = split the cores between ranks and explorer)"""
    checkpoint_interval: int = 20
    """save the resume state every this many trainer steps (0 = never); each write stalls a step"""
    keep_resume_state: bool = False
    """keep the last resume state (RUN_DIR/checkpoints, 12 bytes per parameter) after the run has finished"""  # noqa: E501
    plot: bool = True
    """draw RUN_DIR/plot.png (reward, loss, held-out accuracy by step) when the run has finished"""
    # -- LoRA (peft)
    lora_rank: int = 0
    """LoRA rank: > 0 trains LoRA adapters (peft) on the frozen model; 0 = full fine-tuning"""
    lora_alpha: int = 32
    """LoRA scaling: the adapters add (lora_alpha / lora_rank) B A to each adapted weight"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while training"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: all-linear (not the LM head) or comma-separated module names"""
    # -- outputs
    log_samples: int = 2
    """groups per batch written to samples.log"""
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the final weights: auto (the model's own, from its config.json), float32, bfloat16, float16"""  # noqa: E501
    log: str = "tensorboard"
    """experiment trackers besides RUN_DIR/metrics.jsonl, comma-separated: tensorboard, wandb, mlflow, or none"""  # noqa: E501


def _json_arguments():
    """tyro's reading of dict and list settings: one JSON argument each."""
    import tyro

    registry = tyro.constructors.ConstructorRegistry()

    @registry.primitive_rule
    def json_argument(info):
        # (a list default narrows the type: list[dict] for a preset's list of tables)
        if info.type not in (dict, list) and typing.get_origin(info.type) not in (dict, list):
            return None
        return tyro.constructors.PrimitiveConstructorSpec(
            nargs=1,
            metavar="JSON",
            instance_from_str=lambda args: json.loads(args[0]),
            is_instance=lambda x: isinstance(x, (dict, list)),
            str_from_instance=lambda x: [json.dumps(x)],
        )

    return registry


def _one_line(box: str) -> str:
    """tyro's error box as one line: its text without the frame, the rules, the title and the
    pointer to --help."""
    lines = [re.sub(r"^[\s│╭╰|]*(─+\s)?|(\s─+)?[\s│╮╯|]*$", "", x) for x in box.splitlines()][1:]
    ends = ("For full helptext", "Argument helptext")
    body = itertools.takewhile(lambda x: not x.startswith(ends), lines)
    return " ".join(x for x in body if x and set(x) != {"─"})


# each setting's type, resolved once (Config's annotations are strings)
HINTS = typing.get_type_hints(Config)


def coerce(name: str, value):
    """A TOML (or saved-config) value as setting `name` takes it (its type, one of its choices);
    ValueError (one line) otherwise."""
    hint = HINTS[name]
    choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()
    typ = type(choices[0]) if choices else hint
    if typ in (bool, dict, list):
        if not isinstance(value, typ):
            want = {bool: "true/false", dict: "a table", list: "a list"}[typ]
            raise ValueError(f"config key {name!r}: expected {want}, got {value!r}")
        return value
    try:
        value = typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {name!r}: expected {typ.__name__}, got {value!r}") from None
    if choices and value not in choices:
        raise ValueError(
            f"config key {name!r}: expected one of {', '.join(choices)}, got {value!r}"
        )
    return value


def read_preset(path: Path) -> dict:
    """The settings of TOML preset `path`, coerced; FileNotFoundError / ValueError (one line) for a
    bad file."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    if unknown := set(values) - set(HINTS):
        raise ValueError(f"{path}: unknown config key(s) {sorted(unknown)}")
    return {k: coerce(k, v) for k, v in values.items()}


def parse_config(argv: list[str]) -> Config:
    """A Config: defaults < TOML presets (each --config in turn) < flags. ValueError (one line):
    bad flag, value, TOML key; FileNotFoundError: a --config file that does not exist."""
    import tyro

    presets = []  # every --config, in order: a later file overrides an earlier one
    flags = []  # the rest: tyro parses the flags over the presets' values
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            presets.append(argv[i + 1])
        elif a.startswith("--config="):
            presets.append(a.split("=", 1)[1])
        elif not (a == "--config" or i and argv[i - 1] == "--config"):
            flags.append(a)
    values = {}
    if presets:
        for preset in presets:
            values.update(read_preset(Path(preset)))
    names = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
    defaults = dataclasses.asdict(Config())
    flagged = {n.removeprefix("no_") for n in names} & set(defaults)
    # a preset's run dir counts as a default: the same command run again gets a free one
    # (run.own_run_dir); a --run-dir flag is the user's choice
    given = frozenset(values) - {"run_dir"} | flagged
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            cfg = tyro.cli(
                Config,
                args=flags,
                default=Config(**{**defaults, **values}),
                prog="run.py",
                registry=_json_arguments(),
                description="nanorft: reinforcement fine-tuning of LLMs. Settings: the defaults "
                "below < each --config FILE.toml (TOML, keys = these settings) < flags.",
            )
    except SystemExit as e:
        if e.code:
            raise ValueError(_one_line(errors.getvalue())) from None
        raise
    sys.stderr.write(errors.getvalue())
    cfg = dataclasses.replace(cfg, **task_preset(cfg.task, given))
    cfg.given = given
    check_values(cfg)
    return cfg


def task_preset(task: str, given: frozenset) -> dict:
    """The settings OTHER_TASK_DEFAULTS gives a task other than the default one, those not given."""
    if task == DEFAULT_TASK:
        return {}
    return {k: v for k, v in OTHER_TASK_DEFAULTS.items() if k not in given}


# the unbounded value of a bound that may be off: a task pool that retires no task
NEVER = {"pool_easy": math.inf, "pool_hard": -math.inf}
# the settings that must be at least 1, and at least 0 (`check_values`)
AT_LEAST_ONE = (
    "steps batch_size group_size max_tokens sync_interval eval_interval token_budget bench_k "
    "num_explorers"
).split()
AT_LEAST_ZERO = (
    "lr weight_decay max_grad_norm kl_loss_coef kl_reward_coef entropy_coef length_penalty "
    "eval_temperature buffer_timeout_s sync_timeout_s sync_bucket_mb train_size eval_size "
    "checkpoint_interval log_samples trainer_threads explorer_threads lora_rank eval_k "
    "lr_warmup_steps workflow_retries refill_rounds sync_offset distill_coef top_k"
).split()


def check_values(cfg: Config) -> None:
    """ValueError (one line naming the setting) for a value out of its range."""
    for name in AT_LEAST_ONE:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.workflow_timeout_s <= 0 or cfg.temperature <= 0 or not 0 < cfg.top_p <= 1:
        raise ValueError("need workflow_timeout_s > 0, temperature > 0 and 0 < top_p <= 1")
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if f.type == "float" and not math.isfinite(value) and value != NEVER.get(f.name):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
    for name in AT_LEAST_ZERO:
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(cfg, name)}")
