"""Trainer: one RL step on an FSDP2 model (`Trainer.step`: shape_rewards, advantages, filters,
loss, optimizer_step) of the algorithm and with the frozen scorers the composition root gives it."""

import math
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
import packing
import perf
import sync
from buffer import Experience
from losses import (
    Algorithm,
    LossInputs,
    aggregate,
    apply_filters,
    kl_estimate,
    length_penalty,
    part_totals,
    resolve_algorithm,
)
from metrics import accumulate, micro_batch_sums, print0, reward_metrics, step_metrics
from schedule import staleness_warning

# packed tokens and rows padded to multiples of these: few tensor shapes, so the CPU allocator
# keeps few blocks (RSS)
TOKEN_MULTIPLE = 128
ROW_MULTIPLE = 32


@dataclass
class StepBatch:
    """One step's global batch as tensors over its N sequences, in group order."""

    exps: list[Experience]
    rewards: torch.Tensor  # [N] float
    group_index: torch.Tensor  # [N] long: the group of each
    episode_index: torch.Tensor  # [N] long: shared by the samples of one multi-turn episode
    offline: torch.Tensor  # [N] bool: expert / offline data (no behaviour log-probs; kept)
    token_counts: torch.Tensor  # [N] float: trained tokens (sum of action_mask)
    row: dict[int, int]  # id(experience) -> its index

    @classmethod
    def of(cls, groups: list[list[Experience]]) -> "StepBatch":
        exps = [e for g in groups for e in g]
        episodes: dict = {}
        return cls(
            exps,
            torch.tensor([e.reward for e in exps], dtype=torch.float),
            torch.tensor([i for i, g in enumerate(groups) for _ in g]),
            torch.tensor(
                [
                    episodes.setdefault(e.info.get("episode_id", ("seq", i)), len(episodes))
                    for i, e in enumerate(exps)
                ]
            ),
            torch.tensor([bool(e.info.get("offline")) for e in exps]),
            torch.tensor([float(sum(e.action_mask)) for e in exps]),
            {id(e): i for i, e in enumerate(exps)},
        )


def check_config(cfg, algorithm: Algorithm) -> None:
    """ValueError (one line) for a bad length unit, sampling, pool or expert setting of `cfg`,
    which runs `algorithm` (resolve_algorithm checked its names); FileNotFoundError."""
    if cfg.length_unit not in ("tokens", "turns"):
        raise ValueError(f"length_unit must be tokens or turns, got {cfg.length_unit!r}")
    # top_p < 1, top_k > 0 train: Trainer.logprobs replays the kept sets the engine recorded (an
    # engine that records none refuses them in its own check; a workflow, at its first batch)
    if not 0 <= cfg.expert_fraction < 1 or not 0 <= cfg.pool_lift_fraction <= 1:
        raise ValueError("need 0 <= expert_fraction < 1 and 0 <= pool_lift_fraction <= 1")
    if algorithm.loss.split_expert and not cfg.expert_fraction > 0:
        raise ValueError(
            f"policy_loss {cfg.policy_loss} and expert_fraction > 0 go together (with expert_data)"
        )
    if cfg.expert_fraction > 0 and not algorithm.loss.split_expert:
        raise ValueError(
            "expert_fraction > 0 needs a policy loss that aggregates expert tokens apart "
            f"(a PolicyLoss with split_expert, as --policy-loss mix); {cfg.policy_loss} does not"
        )
    if cfg.expert_fraction > 0 and not Path(cfg.expert_data).is_file():
        raise FileNotFoundError(f"expert_data file not found: {cfg.expert_data!r}")
    if warning := staleness_warning(cfg, algorithm.loss.trust_region):
        print0(warning)
    if cfg.kl_loss_coef and cfg.kl_estimator == "k1":
        print0(
            "warning: --kl-estimator k1 as a loss has a gradient of 0 in expectation on the "
            "policy's own samples: use k3 (KL(reference || policy)) or k2 (KL(policy || reference))"
        )


def lr_schedule_kwargs(cfg) -> dict:
    """cfg.lr_schedule_kwargs, with min_lr_rate 0.1 for cosine_with_min_lr unless they set a
    floor."""
    kwargs = dict(cfg.lr_schedule_kwargs)
    if cfg.lr_schedule == "cosine_with_min_lr" and not {"min_lr", "min_lr_rate"} & kwargs.keys():
        kwargs["min_lr_rate"] = 0.1
    return kwargs


def lr_schedule(cfg, opt) -> Callable[[int], float]:
    """The factor of cfg.lr at each 0-based step (transformers' get_scheduler); ValueError (one
    line)."""
    from transformers import get_scheduler

    kwargs = lr_schedule_kwargs(cfg)
    try:
        factor = get_scheduler(
            cfg.lr_schedule,
            opt,
            num_warmup_steps=cfg.lr_warmup_steps,
            num_training_steps=cfg.steps,
            scheduler_specific_kwargs=kwargs,
        ).lr_lambdas[0]
        factor(0)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise ValueError(
            f"lr_schedule {cfg.lr_schedule!r} with {kwargs}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    # get_scheduler applied factor(0); optimizer_step sets each step's own
    for group in opt.param_groups:
        group["lr"] = cfg.lr
    return factor


class Trainer:
    """FSDP2 policy + AdamW on this rank for `cfg` in an initialised process group, training
    `algorithm` (default: resolve_algorithm of cfg's names in the core's registries).
    `reference` and `teacher` make the frozen scorers from this trainer once its policy is
    built: the reference policy, which `algorithm.needs_ref` asks for (KL terms, DPO), and
    --teacher's (on-policy distillation). A scorer scores this rank's rows each step
    (`compute(rows, filler)`) and gives a micro-batch's log-probs (`micro_batch`); the
    reference also `kl_reward_penalty`, the teacher `advantages` (their per-token term).
    `old_policy` makes the hook of pi_old, the rollout correction and the mismatch attribution:
    `prepare(batch, rows, filler)` before each step's micro-batches gives (`corrected` or None,
    metrics) (see forward_backward). ValueError (one line): a bad algorithm, a scorer the
    config needs and was not given."""

    def __init__(
        self,
        cfg,
        model_path: str,
        device: torch.device,
        algorithm: Algorithm | None = None,
        reference: Callable[["Trainer"], object] | None = None,
        teacher: Callable[["Trainer"], object] | None = None,
        old_policy: Callable[["Trainer"], object] | None = None,
    ):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # FSDP2's default: CUDA wherever a GPU is visible
        self.mesh = init_device_mesh(device.type, (self.world,))
        torch.manual_seed(cfg.seed)
        self.algorithm = algorithm or resolve_algorithm(cfg)
        self.needs_ref = self.algorithm.needs_ref
        if self.needs_ref and reference is None:
            raise ValueError(
                "the KL terms or the policy loss need a reference model and none was given "
                "(components.make_trainer builds one)"
            )
        if cfg.teacher and teacher is None:
            raise ValueError(
                f"--teacher {cfg.teacher}: no teacher was given (components.make_trainer builds it)"
            )
        self.cuda = device.type == "cuda"
        # one CPU rank: FSDP2 only copies
        self.sharded = self.world > 1 or self.cuda and self.cfg.one_gpu_fsdp
        # FSDP2 mixed precision on CUDA
        self.fsdp_bf16 = cfg.dtype == "bfloat16" and self.cuda and self.sharded
        self.autocast = cfg.dtype == "bfloat16" and not self.fsdp_bf16  # where FSDP2 does not cast
        # tokens the dense layers of the forward passes computed (packed, pads included)
        self.computed_tokens = 0
        if device.type == "cpu":
            models.limit_heap_fragmentation()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad = models.pad_token_id(self.tokenizer)
        # the LM head adds its gradient into the tied embedding's (shard sets it)
        self.head_grad_into_weight = False
        self.model = self.shard(self.pretrained(model_path))
        self.final_dtype = models.final_dtype(model_path, cfg.save_dtype)
        # the frozen reference policy of the KL terms and DPO
        self.ref = reference(self) if self.needs_ref else None
        # --teacher: on-policy distillation's per-token advantage term
        self.teacher = teacher(self) if cfg.teacher else None
        self.old_policy = old_policy(self) if old_policy else None
        # one CPU rank: fused, no temporaries
        fused = (self.cfg.fused_adamw if self.cuda else not self.sharded) or None
        self.opt = torch.optim.AdamW(
            [p for _, p in self.named_trained_parameters()],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.99),
            fused=fused,
        )
        self.lr_factor = lr_schedule(cfg, self.opt)
        self.version = 0
        # rank 0: the loop's position in data it reads (--expert-data), saved with the resume state
        self.loop_state: dict = {}

    def pretrained(self, model_path: str):
        """The model at `model_path` in float32 on the device, attending by `packed_sdpa`
        (`pack`'s layout)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=packing.packed_sdpa()
        ).to(self.device)

    def shard(self, model):
        """`model` with FSDP2 on each decoder block and the root (if `sharded`); activation
        checkpointing."""
        policy = MixedPrecisionPolicy()
        if self.fsdp_bf16:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        blocks = set(model._no_split_modules or [])
        c = model.config
        ckpt = self.cfg.activation_checkpointing
        asked = "activation_checkpointing" in self.cfg.given
        if ckpt and self.cuda and self.cfg.checkpoint_if_needed and not asked:
            # only where a micro-batch's activations (~80 B per token, layer, hidden unit) > half
            # the free memory
            activations = 80 * self.cfg.token_budget * c.num_hidden_layers * c.hidden_size
            ckpt = activations > torch.cuda.mem_get_info(self.device)[0] / 2
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        for m in model.modules():
            if type(m).__name__ in blocks:
                # transformers recomputes a block in training mode only; its submodules stay in
                # eval mode (no dropout)
                m.training = ckpt
                if perf.compiles_layers(self.cfg, self.device.type)[0]:
                    m.forward = perf.compiled(m.forward, dynamic=not self.cuda)
                if self.sharded:
                    fully_shard(m, mesh=self.mesh, mp_policy=policy)
        if self.sharded:
            # FSDP2 gathers the root's parameters (embedding, norm, head) around a forward: the
            # packed log-probs, which call the model's parts, become one (packing.response_logprobs)
            model.nanorft_logprobs = MethodType(packing.packed_logprobs, model)
            model = fully_shard(model, mesh=self.mesh, mp_policy=policy)
            register_fsdp_forward_method(model, "nanorft_logprobs")
        # tied: autograd would add the head's gradient (a Python backward's) to the embedding's
        # into a new [V, H]; a sparse embedding gradient added into the head's in place does not.
        # A GPU keeps it dense: the sparse backward's boolean index of the pads waits for the GPU
        elif (e := model.get_input_embeddings()).weight is model.get_output_embeddings().weight:
            e.sparse = e.weight.requires_grad and not self.cuda
            self.head_grad_into_weight = e.weight.requires_grad
        return model

    def resume_at(self, version: int, loop_state: dict) -> None:
        """Continue from a resume state (checkpoints.load_resume_state): the weight version it
        had reached and the loop's position, its weights and optimizer already loaded."""
        self.version = version
        self.loop_state = loop_state

    def resume_tensors(self) -> dict:
        """What a resume state keeps of this trainer sharded beside the optimizer's state, loaded
        back in place (checkpoints.py): nothing here, the weights come back whole from the
        state's Hugging Face copy; a subclass that trains part of a frozen model keeps that part."""
        return {}

    def named_trained_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of what this trainer trains and publishes, in `named_parameters()`
        order."""
        return list(self.model.named_parameters())

    def full_parameters(self) -> list[torch.Tensor]:
        """The `named_trained_parameters` as full tensors. Collective: every rank gets them."""
        return next(self.parameter_buckets(0))

    @torch.no_grad()  # full_tensor() of a parameter would otherwise record the gather for autograd
    def parameter_buckets(self, bucket_elems: int):
        """The `named_trained_parameters` as full tensors, one bucket (sync.bucket_ranges) per
        advance. Collective."""
        params = [p for _, p in self.named_trained_parameters()]
        for r in sync.bucket_ranges([p.numel() for p in params], bucket_elems):
            yield [self.full_tensor(params[i]) for i in r]

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The whole of a (sharded) parameter; with one rank its local tensor, not a copy."""
        if not isinstance(param, DTensor):
            return param.detach()
        return param.full_tensor() if self.world > 1 else param.detach().to_local()

    def logprobs(
        self,
        model,
        mb: list[Experience],
        padding: bool,
        entropy: bool = False,
        temperature: float | None = None,
        float32: bool = False,
        replay: bool | None = None,
    ):
        """(`pack` of `mb` on the device, mask 0 if `padding`; log-probs [B, R] at `temperature`
        (default: the sampling temperature); entropy [B, R] or None). `float32`: without the
        trainer's bfloat16 autocast (the mismatch attribution's float32 side). `replay`: over the
        kept sets of a top-k / top-p rollout, as sampled (the policy's; None: --kept-set-replay);
        False: the full vocabulary (a frozen reference's or teacher's: a KL is to their full
        distributions)."""
        temperature = self.cfg.temperature if temperature is None else temperature
        replay = self.cfg.kept_set_replay if replay is None else replay
        causal = self.cuda and self.cfg.causal_rows
        budget = self.cfg.token_budget
        packed = packing.pack(mb, self.pad, budget, ROW_MULTIPLE, causal, TOKEN_MULTIPLE)
        b = {k: v if v is None else self.to_device(v) for k, v in packed.items()}
        b["mask"] = b["mask"] * (not padding)
        self.computed_tokens += b["input_ids"].numel()
        # no cache of bf16 weights: each is cast once per pass anyway, and the blocks' recompute
        # casts again (a cache would only hold memory)
        autocast = self.autocast and not float32
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=autocast, cache_enabled=False
        ):
            # [B, R]
            lp, ent = packing.response_logprobs(
                model,
                b,
                temperature,
                entropy,
                entropy_grad=bool(self.cfg.entropy_coef),
                head_grad_into_weight=self.head_grad_into_weight,
                head_chunk_elems=self.cfg.head_chunk_elems,
                replay=replay,
            )
        return b, lp, ent

    def step(
        self, groups: list[list[Experience]], progress: Callable[[str], None] | None = None
    ) -> dict[str, float]:
        """One optimiser step on a batch's groups (the same on every rank): rewards ->
        advantages -> filters -> `forward_backward` of each micro-batch -> `optimizer_step`.
        `progress` is told which micro-batch runs. Returns the global batch's metrics."""
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.computed_tokens = 0
        batch = StepBatch.of(groups)
        # this rank's share of the rows
        my_rows = self.rows(groups)[self.rank :: self.world]
        # a padding micro-batch: this sequence, masked out
        filler = batch.exps[0]
        for frozen in filter(None, (self.ref, self.teacher)):
            frozen.compute(my_rows, filler)
        rewards, m = self.shape_rewards(batch, my_rows)
        adv = self.advantages(batch, rewards)
        keep, filtered = apply_filters(self.algorithm.filters, self.cfg.filters, batch, adv)
        my_rows = [kept for row in my_rows if (kept := [e for e in row if keep[batch.row[id(e)]]])]
        sums: dict[str, torch.Tensor] = {}
        corrected = None
        token_counts = batch.token_counts
        if self.old_policy is not None:
            corrected, more = self.old_policy.prepare(batch, my_rows, filler)
            m.update(more)
        if corrected is not None:
            token_counts = corrected.token_counts
            accumulate(sums, corrected.sums)
        totals = self.loss_totals(batch, keep, token_counts)
        micro = self.rank_micro_batches(my_rows, filler)
        for i, (mb, padding) in enumerate(micro):
            if progress is not None:
                progress(f"micro-batch {i + 1}/{len(micro)}")
            out = self.forward_backward(mb, padding, batch, adv, rewards, totals, corrected)
            accumulate(sums, out)
        grad_norm = self.optimizer_step()
        self.version += 1
        train_s = time.perf_counter() - t0
        # busy: the process's CPU seconds on a CPU (threads lent by the explorer count), else wall
        busy_s = time.process_time() - cpu0 if self.device.type == "cpu" else train_s
        m.update(self.reduce_metrics(sums, my_rows, busy_s))
        m.update(
            step_metrics(
                batch,
                adv,
                keep,
                filtered,
                grad_norm=grad_norm,
                lr=self.opt.param_groups[0]["lr"],
                micro_batches=len(micro),
                train_s=train_s,
                computed_tokens=self.computed_tokens,
                device=self.device,
            )
        )
        return m

    def rows(self, groups: list[list[Experience]]) -> list[list[Experience]]:
        """The rows of shared-prompt packing (whole groups for a group-level loss), shortest
        first."""
        if self.algorithm.loss.needs_groups:
            return [list(g) for g in groups]
        rows = []
        for g in groups:
            for _, members in packing.share_prompts(g, self.cfg.token_budget):
                rows.append([g[i] for i in members])
        return sorted(rows, key=packing.packed_tokens)

    def shape_rewards(self, batch: StepBatch, my_rows: list[list]) -> tuple[torch.Tensor, dict]:
        """Rewards [N] minus the KL reward and length penalties, and the rollouts' reward
        metrics."""
        cfg = self.cfg
        rewards = batch.rewards
        m = reward_metrics(rewards[~batch.offline])
        if cfg.kl_reward_coef:
            rewards = self.ref.kl_reward_penalty(rewards, batch, my_rows, m)
        if cfg.length_penalty:  # per trained token, or per turn of a multi-turn episode
            lengths = batch.token_counts  # [N]
            if cfg.length_unit == "turns":
                turns = [e.info.get("turns", 1) for e in batch.exps]
                lengths = torch.tensor(turns, dtype=torch.float)  # [N]
            rewards = length_penalty(rewards, lengths, cfg.length_penalty)
        return rewards, m

    def advantages(self, batch: StepBatch, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages [N] of the configured estimator from rewards [N] (losses.py's contract)."""
        return self.algorithm.advantage(
            rewards,
            batch.group_index,
            batch.episode_index,
            batch.token_counts,
            **self.cfg.advantage_kwargs,
        ).float()

    def loss_totals(self, batch: StepBatch, keep: torch.Tensor, token_counts: torch.Tensor):
        """Micro-batch indices [n] -> the kept global batch's (tokens, sequences) on the device (no
        sync per micro-batch), or a split_expert loss's [n], [n]; `token_counts` [N]: trained."""
        if self.algorithm.loss.split_expert:
            part_tokens, part_seqs = part_totals(token_counts, batch.offline, keep)
            return lambda rows: (self.to_device(part_tokens[rows]), self.to_device(part_seqs[rows]))
        whole = (self.to_device(token_counts[keep].sum()), self.to_device(keep.sum()))
        return lambda rows: whole

    def rank_micro_batches(
        self, rows: list[list[Experience]], filler: Experience
    ) -> list[tuple[list, bool]]:
        """This rank's (micro-batch, padding) pairs, padded with masked `filler`s to the ranks'
        largest count."""
        mbs = [(mb, False) for mb in packing.micro_batches(rows, self.cfg.token_budget)]
        n = torch.tensor(len(mbs), device=self.device)  # NCCL takes device tensors only
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return mbs + [([filler], True)] * (int(n) - len(mbs))

    def forward_backward(
        self,
        mb: list[Experience],
        padding: bool,
        batch: StepBatch,
        adv: torch.Tensor,
        rewards: torch.Tensor,
        totals,
        corrected=None,
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of micro-batch `mb` through the policy loss, its ratio anchored
        at pi_old and each token weighed and masked by the rollout correction if `corrected`
        (its `micro_batch(rows, R)`: pi_old, weight and keep [B, R] of the batch's rows `rows`);
        returns "loss/policy" (its share), "tokens", metric sums and the importance ratio's
        extremes, as 0-dim tensors on the trainer's device."""
        cfg = self.cfg
        agg = self.algorithm.agg
        b, lp, ent = self.logprobs(self.model, mb, padding, entropy=True)
        mask = b["mask"]  # [B, R]
        behaviour = b["behaviour_logprobs"]  # [B, R]
        # each sequence's index in the step's batch
        idx = torch.tensor([batch.row[id(e)] for e in mb])  # [B]
        offline = self.to_device(batch.offline[idx])  # [B]
        ref_lp = self.ref.micro_batch(mb, padding, behaviour) if self.ref else None  # [B, R]
        adv_t = self.to_device(adv[idx])[:, None].expand(*mask.shape)  # [B, R]
        old = None
        weight = keep = 1.0
        if corrected is not None and not padding:
            old, weight, keep = corrected.micro_batch(idx.tolist(), mask.shape[1])  # [B, R] each
        terms = {}  # per-token metrics [B, R] of the scorers and the loss
        if self.teacher:  # per-token terms of the advantage, and their metrics
            adv_t, terms = self.teacher.advantages(adv_t, mb, padding, behaviour, mask, offline)
        groups = torch.unique(batch.group_index[idx], return_inverse=True)[1]  # [B] from 0
        inputs = LossInputs(
            logprobs=lp,
            behaviour_logprobs=behaviour,
            advantages=adv_t,
            action_mask=mask,
            rewards=self.to_device(rewards[idx]),
            group_index=self.to_device(groups),
            ref_logprobs=ref_lp,
            expert=offline,
            old_logprobs=old,
        )
        out = self.algorithm.loss.fn(inputs, **cfg.policy_loss_kwargs)
        per_token = out["loss"] * weight  # [B, R]
        if cfg.kl_loss_coef:
            per_token = per_token + cfg.kl_loss_coef * kl_estimate(lp, ref_lp, cfg.kl_estimator)
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * ent
        (aggregate(per_token, mask * keep, agg, *totals(idx)) * self.world).backward()
        with torch.no_grad():
            terms.update({f"loss/{k}": v for k, v in out.items() if k != "loss"})
            if ref_lp is not None:
                terms["loss/kl_ref"] = kl_estimate(lp, ref_lp, cfg.kl_estimator)
            share = aggregate(out["loss"] * weight, mask * keep, agg, *totals(idx))
            return micro_batch_sums(share, lp, behaviour, ent, mask, offline, terms)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (any shape) on the trainer's device: from a CPU to a GPU through pinned memory
        without waiting (a copy from pageable memory waits for the stream: a host sync)."""
        if self.cuda and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def optimizer_step(self) -> float:
        """Clip the gradients, AdamW step at the scheduled rate, zero them; the norm before
        clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        # a function of the step: a resumed run goes on where it was
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * self.lr_factor(self.version)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(grad_norm)

    def reduce_metrics(
        self, sums: dict[str, torch.Tensor], rows: list[list[Experience]], busy_s: float
    ) -> dict[str, float]:
        """All ranks' metrics: `loss/policy`, each metric of `sums` as a mean over its tokens,
        the extremes (`*_max`, `*_min`); the tokens the step computed and predicted
        (perf.TrainerMeter counts their model FLOPs) and the seconds it kept the ranks busy."""
        exps = [e for row in rows for e in row]
        # each row's tokens once: a group's shared prompt, then its responses; no padding
        shared = packing.share_prompts(exps, self.cfg.token_budget)
        packed = sum(packing.row_length(exps, *row) for row in shared)
        predicted = sum(len(e.tokens) - e.prompt_length for e in exps)
        # the extremes (the importance ratio's, the correction's) over every rank's tokens: one
        # all_reduce of MAX, the minima negated
        highs = sorted(k for k in sums if k.endswith("_max"))
        lows = sorted(k for k in sums if k.endswith("_min"))
        extremes = self.float64_vector([sums.pop(k) for k in highs] + [-sums.pop(k) for k in lows])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        values = extremes.tolist()
        signs = [1.0] * len(highs) + [-1.0] * len(lows)
        # (offline data alone has no ratio: infinite extremes are left out)
        extreme = {k: s * v for k, s, v in zip(highs + lows, signs, values) if math.isfinite(v)}
        names = sorted(sums)
        flat = self.float64_vector([packed, predicted, busy_s] + [sums[k] for k in names])
        dist.all_reduce(flat)
        packed, predicted, busy_s, *summed = flat.tolist()
        total = dict(zip(names, summed))
        tokens = max(total.pop("tokens", 1.0), 1.0)
        return {
            **extreme,
            "loss/policy": total.pop("loss/policy", 0.0),
            **{k: v / tokens for k, v in total.items()},
            "train/packed_tokens": packed,
            "train/predicted_tokens": predicted,
            "time/train_busy_s": busy_s,
        }

    def float64_vector(self, values: list) -> torch.Tensor:
        """Numbers and 0-dim tensors as one float64 vector [n] on the trainer's device (NCCL's)."""
        return torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values]
        )

    def save(
        self,
        path: str | Path,
        params: list[torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Rank 0 writes a Hugging Face directory of the weights in `dtype`. Collective unless
        `params` is given."""
        params = params if params is not None else self.full_parameters()
        if self.rank == 0:
            state = {
                n: p.detach().to("cpu", dtype).contiguous()
                for (n, _), p in zip(self.named_trained_parameters(), params)
            }
            models.save_pretrained(self.model, self.tokenizer, path, state, dtype)

    def save_final(self, path: str | Path, params: list[torch.Tensor] | None = None) -> None:
        """The run's final weights at `path` in `final_dtype`, after its last update: the AdamW
        moments go first, so that the copies the save makes take their memory, not new memory.
        Collective unless `params` is given."""
        self.opt.state.clear()
        self.save(path, params, self.final_dtype)
