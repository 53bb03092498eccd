"""Trainer: one RL step on an FSDP2 model, stage by stage.

`Trainer.step` reads top to bottom: reference log-probs (when a KL term or DPO needs them)
-> `shape_rewards` (KL and length penalties) -> `advantages` (losses.ADVANTAGES) ->
`apply_filters` -> `loss` of each micro-batch of this rank's share (the policy loss of
losses.POLICY_LOSSES, + KL - entropy, aggregated over the global batch; backward) ->
`optimizer_step` (clip, AdamW) -> `reduce_metrics`. The model is sharded with FSDP2 per
decoder block and at the root (a single CPU rank, with nothing to shard, keeps the plain
model). The loop around it (batches, publishes, metrics) is loop.TrainLoop; with
--lora-rank > 0, `make_trainer` builds extras/lora.py's LoraTrainer instead.
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

import models
import sync
from buffer import Experience
from losses import (LossInputs, accepts, aggregate, kl_estimate, length_penalty, masked_sum, part_totals,
                    resolve_algorithm)
from metrics import peak_rss_gib
from packing import (micro_batches, pack, packed_logprobs, packed_tokens, response_logprobs, share_prompts,
                     unpadded_tokens)
from perf import matmul_params, mfu, train_flops, unit_peak

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "opmd", "grpo_stepwise")  # baselines from the other rollouts of a group
# an experience's length for the length penalty: trained tokens, or turns (multi-turn)
LENGTH_UNITS = {"tokens": lambda e: sum(e.action_mask), "turns": lambda e: e.info.get("turns", 1)}


@dataclass
class StepBatch:
    """One step's global batch as tensors over its N sequences, in group order."""

    exps: list[Experience]
    rewards: torch.Tensor           # [N] float
    group_index: torch.Tensor       # [N] long: the group of each
    trajectory_index: torch.Tensor  # [N] long: shared by the samples of one multi-turn episode
    offline: torch.Tensor           # [N] bool: expert / offline data (no behaviour log-probs, never filtered)
    token_counts: torch.Tensor      # [N] float: trained tokens (sum of action_mask)
    row: dict[int, int]             # id(experience) -> its index

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


def check_config(cfg) -> None:
    """Raise ValueError (one line) for an unknown or mis-configured advantage, loss,
    aggregation, KL estimator, filter, task pool, expert-data or LoRA setting (run.prepare
    calls it before any process starts); FileNotFoundError for missing expert data."""
    resolve_algorithm(cfg)
    if cfg.length_unit not in LENGTH_UNITS:
        raise ValueError(f"length_unit must be {' or '.join(LENGTH_UNITS)}, got {cfg.length_unit!r}")
    if cfg.top_p < 1 and cfg.mode != "bench":
        raise ValueError(f"top_p {cfg.top_p} < 1 is for mode bench only: the behaviour logprobs would be those of the "
                         "renormalised nucleus, the trainer's of the full softmax; train with top_p 1")
    if not 0 <= cfg.expert_fraction < 1 or not 0 <= cfg.pool_lift_fraction <= 1:
        raise ValueError("need 0 <= expert_fraction < 1 and 0 <= pool_lift_fraction <= 1")
    if cfg.group_size < 2 and cfg.advantage in GROUP_ADVANTAGES and not cfg.train_data:
        raise ValueError(f"advantage {cfg.advantage} compares the rollouts of a group: it needs group_size >= 2")
    if (cfg.policy_loss == "mix") != (cfg.expert_fraction > 0):
        raise ValueError("policy_loss mix and expert_fraction > 0 go together (with expert_data)")
    if cfg.expert_fraction > 0 and not Path(cfg.expert_data).is_file():
        raise FileNotFoundError(f"expert_data file not found: {cfg.expert_data!r}")
    if cfg.lora_rank:
        models.lora("check_config")(cfg)


def lr_schedule_kwargs(cfg) -> dict:
    """cfg.lr_schedule_kwargs, with min_lr_rate 0.1 (the floor, a fraction of cfg.lr) for
    cosine_with_min_lr where they give neither min_lr nor min_lr_rate."""
    kwargs = dict(cfg.lr_schedule_kwargs)
    if cfg.lr_schedule == "cosine_with_min_lr" and not {"min_lr", "min_lr_rate"} & kwargs.keys():
        kwargs["min_lr_rate"] = 0.1
    return kwargs


def lr_schedule(cfg, opt) -> Callable[[int], float]:
    """The factor of cfg.lr at each trainer step (0-based): transformers' get_scheduler
    cfg.lr_schedule over cfg.steps with cfg.lr_warmup_steps of linear warm-up (factor 0 at
    step 0). Raises ValueError (one line) for an unknown schedule or keyword."""
    from transformers import get_scheduler

    kwargs = lr_schedule_kwargs(cfg)
    try:
        factor = get_scheduler(cfg.lr_schedule, opt, num_warmup_steps=cfg.lr_warmup_steps, num_training_steps=cfg.steps,
                               scheduler_specific_kwargs=kwargs).lr_lambdas[0]
        factor(0)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(f"lr_schedule {cfg.lr_schedule!r} with {kwargs}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    for group in opt.param_groups:  # get_scheduler applied factor(0); optimizer_step sets each step's own
        group["lr"] = cfg.lr
    return factor


def make_trainer(cfg, model_path: str, device: torch.device) -> "Trainer":
    """The Trainer of `cfg`: with --lora-rank > 0 extras/lora.py's LoraTrainer (peft adapters
    on the frozen model; ValueError without peft)."""
    return (models.lora("LoraTrainer") if cfg.lora_rank else Trainer)(cfg, model_path, device)


class Trainer:
    """FSDP2 policy + AdamW on this rank (and a frozen reference model when a KL term or DPO
    needs one), for config.Config `cfg` (dtype resolved). Requires an initialised default
    process group. Raises ValueError for an unknown loss, advantage, filter or keyword."""

    lora = None  # the peft LoraConfig of extras/lora.py's LoraTrainer: resume states then hold the adapters only

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
        self.sharded = self.world > 1 or device.type != "cpu"
        self.computed_tokens = 0  # tokens the forward passes computed (packed rows x length, padding included)
        self.cores = None  # sync.CoreShare: threads lent by an idle explorer (set by TrainLoop)
        self.progress: Callable[[str], None] = lambda text: None  # rank 0's step bar shows where the step is
        if device.type == "cpu":
            models.limit_heap_fragmentation()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad = models.pad_token_id(self.tokenizer)
        self.model = self._shard(self._pretrained(model_path))
        own = AutoConfig.from_pretrained(model_path).dtype
        own = getattr(torch, own) if isinstance(own, str) else own or torch.float32
        self.final_dtype = own if cfg.save_dtype == "auto" else getattr(torch, cfg.save_dtype)
        self.needs_ref = bool(cfg.kl_loss_coef or cfg.kl_reward_coef or getattr(self.loss_fn, "needs_ref", False))
        self.ref = self._load_reference(model_path) if self.needs_ref else None
        # one CPU rank: the fused kernel, without the unfused step's temporaries (FSDP2's DTensors: the default)
        self.opt = torch.optim.AdamW([p for _, p in self.published()], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.99), fused=not self.sharded or None)
        self.lr_factor = lr_schedule(cfg, self.opt)
        self.version = 0
        self.matmul = matmul_params(model_path)  # (body, head) parameters per token: model FLOPs for perf/trainer_mfu
        self.peak = unit_peak(device.type, cfg.dtype)  # FLOP/s of one core (CPU) or device (CUDA)
        # rank 0: the loop's own position, saved with the resume state (loop.TrainLoop: "expert_drawn")
        self.loop_state: dict = {}

    # ------------------------------------------------------------------------- the model

    def _pretrained(self, model_path: str):
        """The model at `model_path` in float32 on the device, with sdpa attention whatever the
        checkpoint asks: flash- and flex-attention reject or misread `pack`'s boolean mask."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                    attn_implementation="sdpa").to(self.device)

    def _shard(self, model):
        """`model` sharded over `mesh` with FSDP2, each decoder block and the root (unless a
        single CPU rank: `sharded`), with activation checkpointing as configured."""
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
                m.register_forward_pre_hook(self._lent_cores)  # also runs in each recompute of the backward pass
                if self.sharded:
                    fully_shard(m, mesh=self.mesh, mp_policy=policy)
        model.nanorft_logprobs = MethodType(packed_logprobs, model)
        if self.sharded:
            model = fully_shard(model, mesh=self.mesh, mp_policy=policy)
            register_fsdp_forward_method(model, "nanorft_logprobs")
        return model

    def _load_reference(self, model_path: str):
        """The frozen reference policy of the KL terms and DPO: the model as loaded, sharded."""
        return self._shard(self._pretrained(model_path)).requires_grad_(False).eval()

    @contextlib.contextmanager
    def reference(self):
        """The reference policy's model, to compute log-probs with."""
        yield self.ref

    def published(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of what this trainer trains and publishes, in `named_parameters()` order."""
        return list(self.model.named_parameters())

    def full_parameters(self) -> list[torch.Tensor]:
        """The `published` parameters as full tensors. Collective: every rank gets them."""
        return next(self.parameter_buckets(0))

    @torch.no_grad()  # full_tensor() of a parameter would otherwise record the gather for autograd
    def parameter_buckets(self, bucket_elems: int):
        """The `published` parameters as full tensors, gathered one bucket (sync.bucket_ranges:
        at most `bucket_elems` elements; 0 = all) at a time as the generator is advanced.
        Collective: every rank must advance it as far as the others."""
        params = [p for _, p in self.published()]
        for r in sync.bucket_ranges([p.numel() for p in params], bucket_elems):
            yield [(params[i].detach().to_local() if self.world == 1 else params[i].full_tensor())  # one rank: no copy
                   if isinstance(params[i], DTensor) else params[i].detach() for i in r]

    def _lent_cores(self, *_) -> None:
        """Before each decoder block (forward and recompute): take or give back the threads an
        idle explorer lends (sync.CoreShare), so that a core lent mid-step is used at once."""
        if self.cores is not None:
            self.cores.apply()

    def _forward(self, model, mb: list[Experience], padding: bool, entropy: bool = False):
        """`pack` of `mb` on the device (mask 0 when `padding`) and its response log-probs and
        entropy [B, R] (None unless `entropy`) under `model`."""
        self._lent_cores()
        b = {k: v.to(self.device) for k, v in pack(mb, self.pad, self.cfg.token_budget).items()}
        b["mask"] = b["mask"] * (not padding)
        self.computed_tokens += b["input_ids"].numel()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            lp, ent = response_logprobs(model, b, self.cfg.temperature, entropy,
                                        entropy_grad=bool(self.cfg.entropy_coef))  # [B, R]
        return b, lp, ent

    # ------------------------------------------------------------------------- the step

    def step(self, groups: list[list[Experience]]) -> dict[str, float]:
        """One optimiser step on the groups of one batch (the same list on every rank); returns
        the metrics of the global batch. Increments `self.version`."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.computed_tokens = 0
        batch = StepBatch.of(groups)
        # the rows of shared-prompt packing (whole groups for a group-level loss), shortest first
        rows = [list(g) for g in groups] if getattr(self.loss_fn, "needs_groups", False) else sorted(
            ([g[i] for i in members] for g in groups for _, members in share_prompts(g, self.cfg.token_budget)),
            key=packed_tokens)
        my_rows = rows[self.rank::self.world]  # this rank's share
        filler = batch.exps[0]  # a padding micro-batch: this sequence, masked out
        ref = self.reference_logprobs(my_rows, filler) if self.needs_ref else {}
        rewards, m = self.shape_rewards(batch, my_rows, ref)
        adv = self.advantages(batch, rewards)
        keep, filtered = self.apply_filters(batch, adv)
        my_rows = [kept for row in my_rows if (kept := [e for e in row if keep[batch.row[id(e)]]])]
        totals = self.loss_totals(batch, keep)
        sums: dict[str, float] = {}
        micro = self.rank_micro_batches(my_rows, filler)
        for i, (mb, padding) in enumerate(micro):
            self.progress(f"micro-batch {i + 1}/{len(micro)}")
            for k, v in self.loss(mb, padding, batch, adv, rewards, ref, totals).items():
                sums[k] = sums.get(k, 0.0) + v
        grad_norm = self.optimizer_step()
        self.version += 1
        train_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        m.update(self.reduce_metrics(sums, self.model_flops(my_rows), cpu_s if self.device.type == "cpu" else train_s))
        if (rollout := ~batch.offline).any():
            m.update({"advantage/mean": float(adv[rollout].mean()),
                      "advantage/abs_mean": float(adv[rollout].abs().mean())})
        lengths = [len(e.behaviour_logprobs) for e in batch.exps]
        tokens = sum(len(e.tokens) for e in batch.exps)
        m.update({**filtered, "loss/grad_norm": grad_norm, "train/lr": self.opt.param_groups[0]["lr"],
                  "filter/kept": int(keep.sum()), "train/expert_seqs": int(batch.offline.sum()),
                  "train/micro_batches": len(micro), "response/len_mean": sum(lengths) / len(lengths),
                  "response/len_max": max(lengths), "time/train_s": train_s, "train/tokens_per_s": tokens / train_s,
                  "train/computed_tokens": self.computed_tokens, "train/sequence_tokens": tokens,
                  "memory/trainer_peak_rss_gib": peak_rss_gib()})
        if self.device.type == "cuda":
            m["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            m["memory/reserved_gib"] = torch.cuda.memory_reserved(self.device) / 2**30
        return m

    def reference_logprobs(self, rows: list[list[Experience]], filler: Experience) -> dict[int, torch.Tensor]:
        """Log-probs under the reference policy of this rank's sequences: id(experience) -> [R]."""
        out = {}
        with torch.no_grad(), self.reference() as ref:
            for mb, padding in self.rank_micro_batches(rows, filler):
                _, lp, _ = self._forward(ref, mb, padding)
                for i, e in enumerate([] if padding else mb):
                    out[id(e)] = lp[i, :len(e.behaviour_logprobs)].float().cpu()
        return out

    def shape_rewards(self, batch: StepBatch, my_rows: list[list], ref: dict) -> tuple[torch.Tensor, dict]:
        """Rewards [N] minus the KL reward penalty (kl_reward_coef x the sum of k1 KL(behaviour
        || reference) over the policy's tokens, rollouts only) and the length penalty; and the
        reward metrics of the rollouts as they came."""
        cfg, rewards, m = self.cfg, batch.rewards, {}
        rollout_rewards = rewards[~batch.offline]                                        # [N_rollout]
        if len(rollout_rewards):
            m["reward/mean"] = float(rollout_rewards.mean())
            m["reward/std"] = float(rollout_rewards.std()) if len(rollout_rewards) > 1 else 0.0
        if cfg.kl_reward_coef:
            kl = torch.zeros(len(batch.exps), device=self.device)                         # [N]
            for e in (e for row in my_rows for e in row if not batch.offline[batch.row[id(e)]]):  # offline: no behaviour
                kl[batch.row[id(e)]] = (kl_estimate(torch.tensor(e.behaviour_logprobs), ref[id(e)], "k1")
                                        * torch.tensor(e.action_mask)).sum()
            dist.all_reduce(kl)  # each sequence is on one rank
            kl = kl.cpu()
            rewards = rewards - cfg.kl_reward_coef * kl
            m["reward/kl_penalty"] = float(cfg.kl_reward_coef * kl.mean())
        if cfg.length_penalty:
            unit = LENGTH_UNITS[cfg.length_unit]
            rewards = length_penalty(rewards, torch.tensor([float(unit(e)) for e in batch.exps]), cfg.length_penalty)
        return rewards, m

    def advantages(self, batch: StepBatch, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages [N] of the configured estimator (losses.ADVANTAGES) from rewards [N] (and
        trained-token counts for an estimator that takes `token_counts`: REINFORCE++)."""
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
        """The normalisers of the loss aggregation: indices [n] -> (tokens, sequences) of the
        kept global batch, or for a `split_expert` loss (MIX) each one's own part's ([n], [n])."""
        if getattr(self.loss_fn, "split_expert", False):
            part_tokens, part_seqs = part_totals(batch.token_counts, batch.offline, keep)  # [N], [N]
            return lambda rows: (part_tokens[rows].to(self.device), part_seqs[rows].to(self.device))
        whole = (float(batch.token_counts[keep].sum()), int(keep.sum()))
        return lambda rows: whole

    def rank_micro_batches(self, rows: list[list[Experience]], filler: Experience) -> list[tuple[list, bool]]:
        """This rank's `rows` as micro-batches (packing.micro_batches), pairs (experiences, padding),
        padded with masked ones of `filler` to the ranks' largest count: FSDP's collectives stay in step."""
        mbs = [(mb, False) for mb in micro_batches(rows, self.cfg.token_budget)]
        n = torch.tensor(len(mbs), device=self.device)  # NCCL takes device tensors only
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return mbs + [([filler], True)] * (int(n) - len(mbs))

    def loss(self, mb: list[Experience], padding: bool, batch: StepBatch, adv: torch.Tensor, rewards: torch.Tensor,
             ref: dict, totals) -> dict[str, float]:
        """Forward and backward of micro-batch `mb`: the policy loss (losses.POLICY_LOSSES) +
        kl_loss_coef x KL to the reference - entropy_coef x entropy per token [B, R], aggregated
        over the global batch (`totals`), times the world size (FSDP averages gradients over
        ranks). Returns "loss/policy" (its share), "tokens" and each metric's sum over tokens."""
        cfg, dev = self.cfg, lambda x: x.to(self.device)
        b, lp, ent = self._forward(self.model, mb, padding, entropy=True)
        mask, behaviour = b["mask"], b["behaviour_logprobs"]                              # [B, R]
        idx = torch.tensor([batch.row[id(e)] for e in mb])                                # [B]
        ref_lp = None
        if self.needs_ref:
            ref_lp = torch.zeros_like(behaviour)                                          # [B, R]
            for i, e in enumerate([] if padding else mb):
                ref_lp[i, :len(e.behaviour_logprobs)] = ref[id(e)].to(self.device)
        out = self.loss_fn(LossInputs(lp, behaviour, dev(adv[idx][:, None].expand(*mask.shape)), mask, dev(rewards[idx]),
                                      dev(torch.unique(batch.group_index[idx], return_inverse=True)[1]), ref_lp,
                                      dev(batch.offline[idx])), **cfg.policy_loss_kwargs)
        per_token = out["loss"]                                                           # [B, R]
        if cfg.kl_loss_coef:
            per_token = per_token + cfg.kl_loss_coef * kl_estimate(lp, ref_lp, cfg.kl_estimator)
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * ent
        (aggregate(per_token, mask, self.agg, *totals(idx)) * self.world).backward()
        with torch.no_grad():
            rollout = ~dev(batch.offline[idx])[:, None]  # expert tokens have no behaviour log-probs
            parts = {"loss/entropy": ent,
                     "loss/kl_behaviour": kl_estimate(behaviour, lp, "k3") * rollout,
                     "loss/logprob_abs_diff": (lp - behaviour).abs() * rollout,
                     **{f"loss/{k}": v for k, v in out.items() if k != "loss"}}
            if ref_lp is not None:
                parts["loss/kl_ref"] = kl_estimate(lp, ref_lp, cfg.kl_estimator)
            return {"loss/policy": float(aggregate(out["loss"], mask, self.agg, *totals(idx))),
                    **{k: float(masked_sum(v.float(), mask)) for k, v in parts.items()}, "tokens": float(mask.sum())}

    def optimizer_step(self) -> float:
        """Clip the gradient norm to max_grad_norm, AdamW step at cfg.lr x `lr_schedule`'s
        factor of self.version, zero the gradients; returns the norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        for group in self.opt.param_groups:  # a function of the step: a resumed run goes on where it was
            group["lr"] = self.cfg.lr * self.lr_factor(self.version)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(grad_norm)

    def model_flops(self, rows: list[list[Experience]]) -> float:
        """perf.train_flops of this rank's trained `rows` (a reference pass counted as a forward)."""
        exps = [e for row in rows for e in row]
        return train_flops(*self.matmul, unpadded_tokens(exps, self.cfg.token_budget),
                           sum(len(e.tokens) - e.prompt_length for e in exps), passes=3 + self.needs_ref)

    def reduce_metrics(self, sums: dict[str, float], flops: float, busy_s: float) -> dict[str, float]:
        """Sums over ranks in one all_reduce: `loss/policy` of the global batch, each per-token
        metric of `sums` as a mean over its trained tokens, perf/trainer_model_flops and
        perf/trainer_mfu (`busy_s`: CPU seconds on a CPU, wall seconds on CUDA). Collective."""
        names = sorted(sums)
        flat = torch.tensor([flops, busy_s] + [sums[k] for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(flat)
        flops, busy_s, *summed = flat.tolist()
        total = dict(zip(names, summed))
        tokens = max(total.pop("tokens", 1.0), 1.0)
        return {"loss/policy": total.pop("loss/policy", 0.0), **{k: v / tokens for k, v in total.items()},
                "perf/trainer_model_flops": flops, "perf/trainer_mfu": mfu(flops, busy_s, self.peak)}

    def save(self, path: str | Path, params: list[torch.Tensor] | None = None,
             dtype: torch.dtype = torch.float32) -> None:
        """Write a Hugging Face directory (and the tokenizer) of the weights cast to `dtype`;
        rank 0 writes. Collective unless `params` from `full_parameters` is given."""
        params = params if params is not None else self.full_parameters()
        if self.rank == 0:
            names = [n for n, _ in self.model.named_parameters()]
            state = {n: p.detach().to("cpu", dtype).contiguous() for n, p in zip(names, params)}
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))
            conf = Path(path) / "config.json"  # save_pretrained records the live model's float32
            conf.write_text(json.dumps({**json.loads(conf.read_text()), "dtype": str(dtype).removeprefix("torch.")},
                                       indent=2))

    def save_final(self, path: str | Path, params: list[torch.Tensor] | None = None) -> None:
        """The run's final weights at `path` in `final_dtype`. Collective unless `params` is given."""
        self.save(path, params, self.final_dtype)
