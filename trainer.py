"""Trainer: the train step on an FSDP2 model, and the model it trains.

The model is sharded with FSDP2 `fully_shard` per decoder block and at the root, over
the default process group (gloo on CPU, NCCL on CUDA) as a device mesh of the trainer's
device type (a single CPU rank, with nothing to shard, keeps the plain model). `Trainer.step` is a short sequence of stages, each a method: rewards
shaped (KL and length penalties), advantages (losses.ADVANTAGES), filters, the sequences
split over the ranks and into micro-batches of at most `token_budget` padded tokens, the
response logprobs recomputed under the current policy and the policy loss
(losses.POLICY_LOSSES) aggregated over the whole batch, then grad-norm clipping and AdamW.
The loop around it (reading batches, publishing weights, metrics) is loop.TrainLoop.
Here too: the algorithm's settings checked (`check_config`) and the resume states.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

import sync
from metrics import peak_rss_gib
from perf import matmul_params, mfu, train_flops, unit_peak
from buffer import Experience
import models
from packing import (micro_batches, pack, packed_logprobs, packed_tokens, response_logprobs, share_prompts,
                     unpadded_tokens)
from losses import (ADVANTAGES, AGGREGATIONS, FILTERS, KL_ESTIMATORS, POLICY_LOSSES, LossInputs, accepts, aggregate,
                    kl_estimate, length_penalty, masked_sum, part_totals, resolve)


GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opmd", "grpo_stepwise")  # baselines from the other rollouts of a group


# ----------------------------------------------------------------------------- processes

LENGTH_UNITS = {"tokens": lambda e: sum(e.action_mask), "turns": lambda e: e.info.get("turns", 1)}
"""The length of an experience for the length penalty: trained tokens, or turns (multi-turn)."""


@dataclass
class StepBatch:
    """One step's global batch as tensors over its N sequences, in group order.

    exps: the experiences; rewards [N] float; group_index [N] long (the group of each);
    trajectory_index [N] long (sequences of one multi-turn trajectory share it); offline
    [N] bool (expert / offline data: no behaviour log-probs, never filtered); token_counts
    [N] float (trained tokens: sum of action_mask); row: id(experience) -> its index."""

    exps: list[Experience]
    rewards: torch.Tensor
    group_index: torch.Tensor
    trajectory_index: torch.Tensor
    offline: torch.Tensor
    token_counts: torch.Tensor
    row: dict[int, int]

    @classmethod
    def of(cls, groups: list[list[Experience]]) -> "StepBatch":
        exps = [e for g in groups for e in g]
        trajectories: dict = {}
        return cls(exps, torch.tensor([e.reward for e in exps], dtype=torch.float),
                   torch.tensor([i for i, g in enumerate(groups) for _ in g]),
                   torch.tensor([trajectories.setdefault(e.info.get("trajectory_id", ("seq", i)), len(trajectories))
                                 for i, e in enumerate(exps)]),
                   torch.tensor([bool(e.info.get("offline")) for e in exps]),
                   torch.tensor([float(sum(e.action_mask)) for e in exps]),
                   {id(e): i for i, e in enumerate(exps)})


def resolve_algorithm(cfg) -> tuple[Callable, Callable, str, dict[str, Callable]]:
    """(advantage function, policy loss, loss aggregation, filters by name) of config.Config
    `cfg` (advantage(_kwargs), policy_loss(_kwargs), loss_agg, filters, kl_estimator,
    length_unit), resolved from the registries of losses.py or import paths. Raises
    ValueError (one line) for an unknown name or keyword."""
    advantage_fn = resolve(cfg.advantage, ADVANTAGES, "advantage", cfg.advantage_kwargs)
    loss_fn = resolve(cfg.policy_loss, POLICY_LOSSES, "policy_loss", cfg.policy_loss_kwargs)
    filters = {}
    for name, kwargs in cfg.filters.items():
        if not isinstance(kwargs, dict):
            raise ValueError(f"filters: the value of {name!r} must be a table of keyword arguments, got {kwargs!r}")
        filters[name] = resolve(name, FILTERS, "filter", kwargs)
    if cfg.loss_agg != "auto" and cfg.loss_agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {cfg.loss_agg!r}; known: auto, {', '.join(AGGREGATIONS)}")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {cfg.kl_estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    if cfg.length_unit not in LENGTH_UNITS:
        raise ValueError(f"length_unit must be {' or '.join(LENGTH_UNITS)}, got {cfg.length_unit!r}")
    agg = getattr(loss_fn, "agg", "token-mean") if cfg.loss_agg == "auto" else cfg.loss_agg
    return advantage_fn, loss_fn, agg, filters


def check_config(cfg) -> None:
    """Raise ValueError (one line) for an unknown or mis-configured advantage, loss,
    aggregation, KL estimator, filter, task pool or expert-data setting (run.prepare calls
    it before any process starts); FileNotFoundError for missing expert data."""
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
    if cfg.lora_rank and (cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1 or not cfg.lora_target_modules.strip()):
        raise ValueError("LoRA needs lora_alpha > 0, 0 <= lora_dropout < 1 and lora_target_modules")
    models.lora_config(cfg)  # ValueError without peft


def lr_schedule_kwargs(cfg) -> dict:
    """The keyword arguments of cfg.lr_schedule: cfg.lr_schedule_kwargs, and for
    cosine_with_min_lr min_lr_rate 0.1 (the floor, a fraction of cfg.lr) where they give
    neither min_lr nor min_lr_rate."""
    kwargs = dict(cfg.lr_schedule_kwargs)
    if cfg.lr_schedule == "cosine_with_min_lr" and not {"min_lr", "min_lr_rate"} & kwargs.keys():
        kwargs["min_lr_rate"] = 0.1
    return kwargs


def lr_schedule(cfg, opt) -> Callable[[int], float]:
    """The factor of cfg.lr at each trainer step (0-based) under cfg.lr_schedule, from
    transformers' get_scheduler (the schedules of its Trainer and of TRL) over cfg.steps
    steps with cfg.lr_warmup_steps of linear warm-up (the factor is 0 at step 0, as there)
    and `lr_schedule_kwargs(cfg)`. Raises ValueError (one line) for an unknown schedule or
    keyword."""
    from transformers import get_scheduler

    kwargs = lr_schedule_kwargs(cfg)
    try:
        sched = get_scheduler(cfg.lr_schedule, opt, num_warmup_steps=cfg.lr_warmup_steps,
                              num_training_steps=cfg.steps, scheduler_specific_kwargs=kwargs)
        factor = sched.lr_lambdas[0]
        factor(0)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"lr_schedule {cfg.lr_schedule!r} with {kwargs}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    for group in opt.param_groups:  # get_scheduler applied factor(0); optimizer_step sets each step's own
        group["lr"] = cfg.lr
    return factor


class Trainer:
    """FSDP2 policy + AdamW on this rank (and a frozen FSDP2 reference model when a KL term
    or DPO needs one).

    cfg: config.Config (lr, weight_decay, max_grad_norm, token_budget, temperature, dtype (resolved: bfloat16 or float32),
    activation_checkpointing, save_dtype,
    advantage(_kwargs), policy_loss(_kwargs), loss_agg, kl_loss_coef, kl_estimator,
    kl_reward_coef, entropy_coef, length_penalty, length_unit, filters, seed). Requires an
    initialised default process group. Raises ValueError for an unknown loss, advantage,
    filter or keyword (losses.resolve).
    """

    def __init__(self, cfg, model_path: str, device: torch.device):
        from transformers import AutoConfig, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # FSDP2's default mesh is the accelerator's (CUDA wherever a GPU is visible), whatever `device` says
        self.mesh = init_device_mesh(device.type, (self.world,))
        torch.manual_seed(cfg.seed)
        self.advantage_fn, self.loss_fn, self.agg, self.filters = resolve_algorithm(cfg)
        self.masked_filters = {name for name, fn in self.filters.items() if accepts(fn, "action_mask")}
        self.adv_counts = accepts(self.advantage_fn, "token_counts")  # REINFORCE++ whitens over tokens
        bf16 = cfg.dtype == "bfloat16"
        self.fsdp_bf16 = bf16 and device.type == "cuda"  # FSDP2 mixed precision on CUDA, autocast on CPU
        self.autocast = bf16 and not self.fsdp_bf16
        # one CPU rank has nothing to shard: FSDP2 would only copy the weights into and out of its buffers
        # (the default job's step: 18.6 instead of 16.5 s, 0.24 GiB more; docs/benchmarks.md "The limit and MFU")
        self.sharded = self.world > 1 or device.type != "cpu"
        self.computed_tokens = 0  # tokens the forward passes computed (packed rows x length, padding included)
        self.cores = None  # sync.CoreShare: threads lent by an idle explorer (set by TrainLoop)
        self.progress: Callable[[str], None] = lambda text: None  # rank 0's step bar shows where the step is
        if device.type == "cpu":
            models.limit_heap_fragmentation()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.model_path = model_path
        self.lora = models.lora_config(cfg, model_path)  # None: full fine-tuning
        self.model = self._load(model_path, self.lora)
        own = AutoConfig.from_pretrained(model_path).dtype
        own = getattr(torch, own) if isinstance(own, str) else own or torch.float32
        self.final_dtype = own if cfg.save_dtype == "auto" else getattr(torch, cfg.save_dtype)
        self.needs_ref = bool(cfg.kl_loss_coef or cfg.kl_reward_coef or getattr(self.loss_fn, "needs_ref", False))
        # the reference policy: a frozen copy of the model, or with LoRA the model with its adapters disabled
        self.ref = self._load(model_path).requires_grad_(False).eval() if self.needs_ref and not self.lora else None
        # a single CPU rank: the fused kernel, without the unfused step's temporaries (0.1 GiB less peak RSS on
        # the default job: docs/benchmarks.md); FSDP2's sharded parameters keep the default implementation
        self.opt = torch.optim.AdamW([p for _, p in self.published()], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.99), fused=not self.sharded or None)
        self.lr_factor = lr_schedule(cfg, self.opt)
        self.version = 0
        self.matmul = matmul_params(model_path)  # (body, head) parameters per token: model FLOPs for perf/trainer_mfu
        self.peak = unit_peak(device.type, cfg.dtype)  # FLOP/s of one core (CPU) or device (CUDA)
        # rank 0: the loop's own position, saved with the resume state (trainer.pt) and restored by checkpoints.load_resume_state
        # (loop.TrainLoop: "expert_drawn", the groups the MIX expert sampler has drawn)
        self.loop_state: dict = {}

    def _load(self, model_path: str, lora=None):
        """The model at `model_path` in float32 on `device`, sharded over `mesh` (FSDP2, unless
        a single CPU rank: `sharded`); with a peft `lora` config, fresh LoRA adapters on it
        (peft.get_peft_model: the base frozen, each block sharded with its adapters). Attention is sdpa whatever the checkpoint's config
        asks: `pack`'s [N, 1, L, L] boolean mask is one that sdpa (and eager) take;
        flash-attention and flex-attention reject or misread it."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     attn_implementation="sdpa").to(self.device)
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.fsdp_bf16 else \
            MixedPrecisionPolicy()
        blocks = set(model._no_split_modules or [])
        if self.cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for m in model.modules():
            if type(m).__name__ in blocks:
                # transformers recomputes a block only when the block is in training mode; its submodules
                # stay in eval mode (no dropout: the behaviour policy sampled without it)
                m.training = self.cfg.activation_checkpointing
                for name, sub in m.named_modules():  # LoRA dropout, when asked for, applies while training
                    sub.training = sub.training or (isinstance(sub, torch.nn.Dropout) and "lora_dropout" in name)
                m.register_forward_pre_hook(self._lent_cores)  # also runs in each recompute of the backward pass
                if self.sharded:
                    fully_shard(m, mesh=self.mesh, mp_policy=policy)
        model.nanorft_logprobs = MethodType(packed_logprobs, model)
        if self.sharded:
            model = fully_shard(model, mesh=self.mesh, mp_policy=policy)
            register_fsdp_forward_method(model, "nanorft_logprobs")
        return model

    def published(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of what this trainer trains and sends the explorer, in
        `named_parameters()` order: every parameter, or with LoRA the adapters only."""
        return models.published_parameters(self.model, self.lora is not None)

    def full_parameters(self) -> list[torch.Tensor]:
        """The `published` parameters as full tensors. Collective: every rank must call it;
        every rank gets the tensors."""
        return next(self.parameter_buckets(0))

    @torch.no_grad()  # full_tensor() of a parameter would otherwise record the gather for autograd
    def parameter_buckets(self, bucket_elems: int):
        """The `published` parameters as full tensors, gathered one bucket
        (sync.bucket_ranges: at most `bucket_elems` elements; 0 = all) at a time as the
        generator is advanced: O(bucket) extra memory; no gradient. Collective: every rank
        must advance it as far as the others."""
        params = [p for _, p in self.published()]
        for r in sync.bucket_ranges([p.numel() for p in params], bucket_elems):
            yield [(params[i].detach().to_local() if self.world == 1 else params[i].full_tensor())  # one rank: no copy
                   if isinstance(params[i], DTensor) else params[i].detach() for i in r]

    def _plan(self, units: list[list[Experience]], dummy: Experience) -> list[tuple[list[Experience], bool]]:
        """Micro-batches of this rank's units, padded with masked copies of `dummy` (flag
        False) to the largest count over the ranks, so FSDP's collectives stay in step."""
        mbs = [(mb, True) for mb in micro_batches(units, self.cfg.token_budget)]
        n = torch.tensor(len(mbs), device=self.device)  # NCCL takes device tensors only
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return mbs + [([dummy], False)] * (int(n) - len(mbs))

    def _lent_cores(self, *_) -> None:
        """Before each decoder block (forward and recompute): take or give back the threads
        an idle explorer lends (sync.CoreShare), so that a core lent or reclaimed in the
        middle of a step is used within one block, not at the next micro-batch."""
        if self.cores is not None:
            self.cores.apply()

    def _forward(self, model, mb: list[Experience], real: bool, entropy: bool = False):
        self._lent_cores()
        b = {k: v.to(self.device) for k, v in pack(mb, self.pad, self.cfg.token_budget).items()}
        b["mask"] = b["mask"] * real
        self.computed_tokens += b["input_ids"].numel()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            lp, ent = response_logprobs(model, b, self.cfg.temperature, entropy,
                                        entropy_grad=bool(self.cfg.entropy_coef))  # [B, R]
        return b, lp, ent

    def _ref_logprobs(self, units: list[list[Experience]], dummy: Experience) -> dict[int, torch.Tensor]:
        """Reference-model log-probs of this rank's sequences: id(experience) -> [R]."""
        out = {}
        off = self.model.disable_adapter() if self.lora else contextlib.nullcontext()  # LoRA: the base is the reference
        with torch.no_grad(), off:
            for mb, real in self._plan(units, dummy):
                _, lp, _ = self._forward(self.ref if self.ref is not None else self.model, mb, real)
                for i, e in enumerate(mb if real else []):
                    out[id(e)] = lp[i, :len(e.behaviour_logprobs)].float().cpu()
        return out

    def step(self, groups: list[list[Experience]]) -> dict[str, float]:
        """One optimiser step on the groups of one batch (the same list on every rank;
        expert sequences carry info["offline"]); returns metrics (rank-0 view of the global
        batch). Increments `self.version`. The stages, each a method of its own:

        reference log-probs (if needed) -> `shape_rewards` (- KL penalty, - length penalty)
        -> `advantages` -> `apply_filters` -> micro-batches of the kept sequences ->
        `accumulate_gradients` (loss + KL to the reference - entropy bonus, aggregated over
        the global batch) -> `optimizer_step` (clip, AdamW) -> `reduce_metrics`."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.computed_tokens = 0
        batch = StepBatch.of(groups)
        by_group = getattr(self.loss_fn, "needs_groups", False)
        units = [list(g) for g in groups] if by_group else sorted(  # one unit per shared-prompt row, by length
            ([g[i] for i in members] for g in groups for _, members in share_prompts(g, self.cfg.token_budget)),
            key=packed_tokens)
        mine = units[self.rank::self.world]
        ref = self._ref_logprobs(mine, batch.exps[0]) if self.needs_ref else {}
        rewards, m = self.shape_rewards(batch, mine, ref)
        adv = self.advantages(batch, rewards)
        keep, filtered = self.apply_filters(batch, adv)
        mine = [kept for u in mine if (kept := [e for e in u if keep[batch.row[id(e)]]])]
        plan = self._plan(mine, batch.exps[0])
        objective, sums = self.accumulate_gradients(plan, batch, adv, rewards, ref, self.loss_totals(batch, keep))
        grad_norm = self.optimizer_step()
        self.version += 1
        lengths = [len(e.behaviour_logprobs) for e in batch.exps]
        train_s = time.perf_counter() - t0
        m.update(self.utilisation(mine, train_s, time.process_time() - cpu0))
        rollout = ~batch.offline
        if rollout.any():
            m.update({"advantage/mean": float(adv[rollout].mean()), "advantage/abs_mean": float(adv[rollout].abs().mean())})
        m.update({**filtered, **self.reduce_metrics(objective, sums),
                  "loss/grad_norm": grad_norm, "train/lr": self.opt.param_groups[0]["lr"], "filter/kept": int(keep.sum()),
                  "train/expert_seqs": int(batch.offline.sum()), "train/micro_batches": len(plan),
                  "response/len_mean": sum(lengths) / len(lengths), "response/len_max": max(lengths),
                  "time/train_s": train_s, "train/tokens_per_s": sum(len(e.tokens) for e in batch.exps) / train_s,
                  "train/computed_tokens": self.computed_tokens, "train/sequence_tokens": sum(len(e.tokens) for e in batch.exps),
                  "memory/trainer_peak_rss_gib": peak_rss_gib()})
        if self.device.type == "cuda":
            m["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            m["memory/reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
        return m

    def utilisation(self, units: list[list[Experience]], wall_s: float, cpu_s: float) -> dict[str, float]:
        """perf/trainer_model_flops (perf.train_flops of the trained `units` of every
        rank, a reference pass counted at 2N per token) and perf/trainer_mfu: those FLOPs over
        the peak of what the ranks used, CPU seconds x one core's peak on a CPU (lent cores
        count), `wall_s` x the device's peak on CUDA. Collective."""
        exps = [e for u in units for e in u]
        tokens = unpadded_tokens(exps, self.cfg.token_budget)
        predicted = sum(len(e.tokens) - e.prompt_length for e in exps)
        flops = train_flops(*self.matmul, tokens, predicted, passes=3 + self.needs_ref)
        busy = cpu_s if self.device.type == "cpu" else wall_s
        total = torch.tensor([flops, busy], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return {"perf/trainer_model_flops": float(total[0]),
                "perf/trainer_mfu": mfu(float(total[0]), float(total[1]), self.peak)}

    def shape_rewards(self, batch: StepBatch, mine: list[list[Experience]],
                      ref: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards [N] after the KL reward penalty (kl_reward_coef x the sum of k1
        KL(behaviour || reference) over the policy's tokens; rollouts only, gathered from
        every rank's share `mine`) and the length penalty; and the reward metrics of the
        rollouts as they came (expert / offline data carries a fixed reward)."""
        cfg, rewards, m = self.cfg, batch.rewards, {}
        rollout_rewards = rewards[~batch.offline]                                        # [N_rollout]
        if len(rollout_rewards):
            m["reward/mean"] = float(rollout_rewards.mean())
            m["reward/std"] = float(rollout_rewards.std()) if len(rollout_rewards) > 1 else 0.0
        if cfg.kl_reward_coef:
            local = [(batch.row[id(e)],
                      float((kl_estimate(torch.tensor(e.behaviour_logprobs), ref[id(e)], "k1")
                             * torch.tensor(e.action_mask)).sum()))
                     for u in mine for e in u if not batch.offline[batch.row[id(e)]]]  # offline: no behaviour logprobs
            every = [None] * self.world
            dist.all_gather_object(every, local)
            kl = torch.zeros(len(batch.exps))                                              # [N]
            for part in every:
                for i, v in part:
                    kl[i] = v
            rewards = rewards - cfg.kl_reward_coef * kl
            m["reward/kl_penalty"] = float(cfg.kl_reward_coef * kl.mean())
        if cfg.length_penalty:
            units = LENGTH_UNITS[cfg.length_unit]
            rewards = length_penalty(rewards, torch.tensor([float(units(e)) for e in batch.exps]), cfg.length_penalty)
        return rewards, m

    def advantages(self, batch: StepBatch, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages [N] of the configured estimator (losses.ADVANTAGES) from rewards [N],
        with the group and trajectory index of each sequence (and the trained-token counts
        for an estimator that takes `token_counts`: REINFORCE++)."""
        counts = {"token_counts": batch.token_counts} if self.adv_counts else {}
        return self.advantage_fn(rewards, batch.group_index, batch.trajectory_index, **counts,
                                 **self.cfg.advantage_kwargs).float()

    def apply_filters(self, batch: StepBatch, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
        """Which sequences [N] (bool) every configured filter keeps (expert / offline
        sequences are never filtered), and `filter/<name>`: how many each one dropped."""
        keep, m = torch.ones(len(batch.exps), dtype=torch.bool), {}
        for name, fn in self.filters.items():
            dropped = 0
            for i, e in enumerate(batch.exps):
                mask = {"action_mask": e.action_mask} if name in self.masked_filters else {}
                if keep[i] and not batch.offline[i] and not fn(e.tokens, e.behaviour_logprobs, float(adv[i]), **mask,
                                                                **self.cfg.filters[name]):
                    keep[i], dropped = False, dropped + 1
            m[f"filter/{name}"] = dropped
        return keep, m

    def loss_totals(self, batch: StepBatch, keep: torch.Tensor):
        """The normalisers of the loss aggregation: rows [n] -> (tokens, sequences) of the
        kept global batch, or for MIX (`split_expert`) of each row's own part ([n], [n])."""
        if getattr(self.loss_fn, "split_expert", False):
            part_tokens, part_seqs = part_totals(batch.token_counts, batch.offline, keep)  # [N], [N]
            return lambda rows: (part_tokens[rows].to(self.device), part_seqs[rows].to(self.device))
        whole = (float(batch.token_counts[keep].sum()), int(keep.sum()))
        return lambda rows: whole

    def accumulate_gradients(self, plan, batch: StepBatch, adv: torch.Tensor, rewards: torch.Tensor,
                             ref: dict[int, torch.Tensor], totals) -> tuple[float, dict[str, torch.Tensor]]:
        """Forward and backward over this rank's micro-batches `plan` (from `_plan`): the
        policy loss (+ kl_loss_coef x KL to the reference, - entropy_coef x entropy) per
        token [B, R], aggregated over the global batch (`totals`), times the world size
        (FSDP averages the gradients over ranks). Returns this rank's aggregated policy
        loss and sums over its tokens of the per-token metrics (and "tokens")."""
        cfg, dev = self.cfg, lambda x: x.to(self.device)
        sums: dict[str, torch.Tensor] = {}
        objective = 0.0  # the aggregated policy loss (without KL and entropy terms)
        for i, (mb, real) in enumerate(plan):
            self.progress(f"micro-batch {i + 1}/{len(plan)}")
            b, lp, ent = self._forward(self.model, mb, real, entropy=True)
            mask, behaviour = b["mask"], b["behaviour_logprobs"]                          # [B, R]
            rows = torch.tensor([batch.row[id(e)] for e in mb])
            ref_lp = None
            if self.needs_ref:
                ref_lp = torch.zeros_like(behaviour)
                for i, e in enumerate(mb if real else []):
                    ref_lp[i, :len(e.behaviour_logprobs)] = ref[id(e)].to(self.device)
            out = self.loss_fn(LossInputs(lp, behaviour, dev(adv[rows][:, None].expand(*mask.shape)), mask,
                                          dev(rewards[rows]),
                                          dev(torch.unique(batch.group_index[rows], return_inverse=True)[1]),
                                          ref_lp, dev(batch.offline[rows])), **cfg.policy_loss_kwargs)
            loss_tok = out["loss"]
            if cfg.kl_loss_coef:
                loss_tok = loss_tok + cfg.kl_loss_coef * kl_estimate(lp, ref_lp, cfg.kl_estimator)
            if cfg.entropy_coef:
                loss_tok = loss_tok - cfg.entropy_coef * ent
            (aggregate(loss_tok, mask, self.agg, *totals(rows)) * self.world).backward()
            with torch.no_grad():
                objective += float(aggregate(out["loss"], mask, self.agg, *totals(rows)))
                rollout = ~dev(batch.offline[rows])[:, None]  # expert tokens have no behaviour log-probs
                parts = {"loss/entropy": ent,
                         "loss/kl_behaviour": kl_estimate(behaviour, lp, "k3") * rollout,
                         "loss/logprob_abs_diff": (lp - behaviour).abs() * rollout,
                         **{f"loss/{k}": v for k, v in out.items() if k != "loss"}}
                if ref_lp is not None:
                    parts["loss/kl_ref"] = kl_estimate(lp, ref_lp, cfg.kl_estimator)
                for k, v in parts.items():
                    sums[k] = sums.get(k, 0) + masked_sum(v.float(), mask).double().cpu()
                sums["tokens"] = sums.get("tokens", 0) + mask.sum().double().cpu()
        return objective, sums

    def optimizer_step(self) -> float:
        """Clip the gradient norm to max_grad_norm, AdamW step at this step's learning rate
        (cfg.lr x `lr_schedule`'s factor of self.version), zero the gradients; returns the
        norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        for group in self.opt.param_groups:  # a function of the step: a resumed run goes on where it was
            group["lr"] = self.cfg.lr * self.lr_factor(self.version)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(grad_norm)

    def reduce_metrics(self, objective: float, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum over ranks: `loss/policy` (the aggregated policy loss of the global batch) and
        each per-token metric as a mean over the global batch's trained tokens. Collective."""
        names = sorted(sums)
        flat = torch.tensor([objective] + [float(sums[k]) for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(flat)
        m = {"loss/policy": float(flat[0])}
        if names:
            tok = max(float(flat[1 + names.index("tokens")]), 1.0)
            m.update({k: float(v) / tok for k, v in zip(names, flat[1:]) if k != "tokens"})
        return m

    def save(self, path: str | Path, params: list[torch.Tensor] | None = None,
             dtype: torch.dtype = torch.float32) -> None:
        """Write a Hugging Face safetensors directory with the weights cast to `dtype`
        (float32 = exactly the trained weights; rank 0 writes; collective unless `params`
        from `full_parameters` is given); with LoRA, a peft adapter directory of the adapters
        (models.save_adapter) and the tokenizer."""
        params = params if params is not None else self.full_parameters()
        if self.rank == 0 and self.lora:
            named = [(n, p.detach().to("cpu", dtype)) for (n, _), p in zip(self.published(), params)]
            models.save_adapter(self.model, path, named, self.lora)
            self.tokenizer.save_pretrained(str(path))
        elif self.rank == 0:
            names = [n for n, _ in self.model.named_parameters()]
            state = {n: p.detach().to("cpu", dtype).contiguous() for n, p in zip(names, params)}
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))
            conf = Path(path) / "config.json"  # save_pretrained records the live model's float32
            conf.write_text(json.dumps({**json.loads(conf.read_text()), "dtype": str(dtype).removeprefix("torch.")},
                                       indent=2))

    def save_final(self, path: str | Path, params: list[torch.Tensor] | None = None) -> None:
        """The run's final weights at `path` in `final_dtype`: a Hugging Face directory; with
        LoRA, the adapters (float32) in path/adapter (peft) and the model with them merged
        (models.merge_adapter) at `path`. Collective unless `params` is given."""
        if not self.lora:
            return self.save(path, params, self.final_dtype)
        self.save(Path(path) / "adapter", params)
        if self.rank == 0:
            models.merge_adapter(Path(path) / "adapter", path, self.final_dtype)
            self.tokenizer.save_pretrained(str(path))
