"""Trainer: FSDP2 model, batching by token budget, train step, sending weights, saving.

Every trainer rank (torchrun) holds a `Trainer`. The model is sharded with FSDP2
`fully_shard` per decoder block and at the root, over the default process group (gloo on
CPU, NCCL on CUDA). A step takes the groups of one explorer batch (the same list on every
rank), computes advantages (losses.ADVANTAGES), splits the sequences over the ranks and
into micro-batches of at most `token_budget` padded tokens, recomputes the response
logprobs under the current policy, and applies the policy loss (losses.POLICY_LOSSES)
aggregated as a token-mean over the whole batch. Then grad-norm clipping and AdamW.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from buffer import Experience
from losses import (ADVANTAGES, FILTERS, POLICY_LOSSES, LossInputs, accepts, aggregate, kl_estimate,
                    length_penalty, masked_sum, part_totals, resolve, token_entropy)


def resume_state(run_dir: str | Path) -> Path | None:
    """The newest complete resume state of a run (named by checkpoints/resume-latest), or
    None when the run has none yet."""
    marker = Path(run_dir) / "checkpoints" / "resume-latest"
    return marker.parent / marker.read_text().strip() if marker.is_file() else None


def pack(exps: list[Experience], pad: int) -> dict[str, torch.Tensor]:
    """Pad a list of experiences into tensors: prompts left-padded to P, responses
    right-padded to R, so every response starts at column P.

    Returns input_ids / attention_mask / position_ids [B, P + R] and, over the response
    region, response_ids / old_logprobs / mask [B, R]. R >= 1 (an empty response gets one
    masked pad token).
    """
    B = len(exps)
    P = max(e.prompt_length for e in exps)
    R = max(1, max(len(e.tokens) - e.prompt_length for e in exps))
    ids = torch.full((B, P + R), pad, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    old = torch.zeros((B, R))
    mask = torch.zeros((B, R))
    for b, e in enumerate(exps):
        p, r = e.prompt_length, len(e.tokens) - e.prompt_length
        ids[b, P - p:P + r] = torch.tensor(e.tokens)
        attn[b, P - p:P + r] = 1
        old[b, :r] = torch.tensor(e.logprobs)
        mask[b, :r] = torch.tensor(e.action_mask, dtype=torch.float)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
            "response_ids": ids[:, P:], "old_logprobs": old, "mask": mask}


def micro_batches(units: list[list[Experience]], token_budget: int) -> list[list[Experience]]:
    """Split consecutive units (single experiences, or whole groups for group-level losses)
    into micro-batches whose padded size B * (P + R) stays within `token_budget` tokens;
    a unit is never split (a single larger unit gets a micro-batch of its own)."""
    out: list[list[Experience]] = []
    cur: list[Experience] = []
    for unit in units:
        grown = cur + unit
        P = max(e.prompt_length for e in grown)
        R = max(len(e.tokens) - e.prompt_length for e in grown)
        if cur and len(grown) * (P + R) > token_budget:
            out.append(cur)
            grown = list(unit)
        cur = grown
    return out + [cur] if cur else out


def response_logprobs(model, batch: dict[str, torch.Tensor], temperature: float,
                      entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of `response_ids` under `model` at `temperature` (no top-p), from
    a batch made by `pack`, and the token entropy [B, R] (nats) when `entropy` (with a
    gradient only when `entropy_grad`: the softmax over the vocabulary is not kept for
    the backward pass otherwise). Only the R + 1 last positions go through the LM head."""
    R = batch["response_ids"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], logits_to_keep=R + 1).logits[:, :R]  # [B, R, V]
    logits = logits.float() / temperature
    picked = logits.gather(-1, batch["response_ids"][..., None]).squeeze(-1)              # [B, R]
    lp = picked - torch.logsumexp(logits, dim=-1)                                          # [B, R]
    if not entropy:
        return lp, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return lp, token_entropy(logits if entropy_grad else logits.detach())


class Trainer:
    """FSDP2 policy + AdamW on this rank (and a frozen FSDP2 reference model when a KL term
    or DPO needs one).

    cfg: run.Config (lr, weight_decay, max_grad_norm, token_budget, temperature, bf16, save_dtype,
    advantage(_kwargs), policy_loss(_kwargs), loss_agg, kl_loss_coef, kl_estimator,
    kl_reward_coef, entropy_coef, length_penalty, length_unit, filters, seed). Requires an
    initialised default process group. Raises ValueError for an unknown loss, advantage,
    filter or keyword (losses.resolve).
    """

    def __init__(self, cfg, model_path: str, device: torch.device):
        from transformers import AutoConfig, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        self.advantage_fn = resolve(cfg.advantage, ADVANTAGES, "advantage", cfg.advantage_kwargs)
        self.loss_fn = resolve(cfg.policy_loss, POLICY_LOSSES, "policy_loss", cfg.policy_loss_kwargs)
        self.agg = getattr(self.loss_fn, "agg", "token-mean") if cfg.loss_agg == "auto" else cfg.loss_agg
        self.filters = {name: resolve(name, FILTERS, "filter", kw) for name, kw in cfg.filters.items()}
        self.masked_filters = {name for name, fn in self.filters.items() if accepts(fn, "action_mask")}
        self.adv_counts = accepts(self.advantage_fn, "token_counts")  # REINFORCE++ whitens over tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.model = self._load(model_path)
        own = AutoConfig.from_pretrained(model_path).dtype
        own = getattr(torch, own) if isinstance(own, str) else own or torch.float32
        self.final_dtype = own if cfg.save_dtype == "auto" else getattr(torch, cfg.save_dtype)
        needs_ref = cfg.kl_loss_coef or cfg.kl_reward_coef or getattr(self.loss_fn, "needs_ref", False)
        self.ref = self._load(model_path).requires_grad_(False).eval() if needs_ref else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.99))
        self.version = 0
        self.before_resume_marker = None  # tests: called after a resume state is written, before it is named

    def _load(self, model_path: str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        blocks = set(model._no_split_modules or [])
        for m in model.modules():
            if type(m).__name__ in blocks:
                fully_shard(m)
        return fully_shard(model)

    def full_parameters(self) -> list[torch.Tensor]:
        """All parameters as full tensors in `named_parameters()` order. Collective: every
        rank must call it; every rank gets the tensors."""
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for _, p in self.model.named_parameters()]

    def _plan(self, units: list[list[Experience]], dummy: Experience) -> list[tuple[list[Experience], bool]]:
        """Micro-batches of this rank's units, padded with masked copies of `dummy` (flag
        False) to the largest count over the ranks, so FSDP's collectives stay in step."""
        mbs = [(mb, True) for mb in micro_batches(units, self.cfg.token_budget)]
        n = torch.tensor(len(mbs))
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return mbs + [([dummy], False)] * (int(n) - len(mbs))

    def _forward(self, model, mb: list[Experience], real: bool, entropy: bool = False):
        b = {k: v.to(self.device) for k, v in pack(mb, self.pad).items()}
        b["mask"] = b["mask"] * real
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            lp, ent = response_logprobs(model, b, self.cfg.temperature, entropy,
                                        entropy_grad=bool(self.cfg.entropy_coef))  # [B, R]
        return b, lp, ent

    def _ref_logprobs(self, units: list[list[Experience]], dummy: Experience) -> dict[int, torch.Tensor]:
        """Reference-model log-probs of this rank's sequences: id(experience) -> [R]."""
        out = {}
        with torch.no_grad():
            for mb, real in self._plan(units, dummy):
                _, lp, _ = self._forward(self.ref, mb, real)
                for i, e in enumerate(mb if real else []):
                    out[id(e)] = lp[i, :len(e.logprobs)].float().cpu()
        return out

    def step(self, groups: list[list[Experience]]) -> dict[str, float]:
        """One optimiser step on the groups of one batch (the same list on every rank;
        expert sequences carry info["offline"]); returns metrics (rank-0 view of the global
        batch). Increments `self.version`.

        Order: reference log-probs (if needed) -> rewards (- KL penalty, - length penalty)
        -> advantages -> filters -> micro-batches of the kept sequences -> loss (+ KL to the
        reference, - entropy bonus) aggregated over the global batch -> AdamW."""
        cfg, t0 = self.cfg, time.perf_counter()
        exps = [e for g in groups for e in g]
        pos = {id(e): i for i, e in enumerate(exps)}
        rewards = torch.tensor([e.reward for e in exps], dtype=torch.float)               # [N]
        group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g])          # [N]
        traj_ids = {}
        traj = torch.tensor([traj_ids.setdefault(e.info.get("trajectory_id", ("seq", i)), len(traj_ids))
                             for i, e in enumerate(exps)])                                # [N]
        expert = torch.tensor([bool(e.info.get("offline")) for e in exps])                # [N] no behaviour logprobs
        token_counts = torch.tensor([float(sum(e.action_mask)) for e in exps])           # [N] trained tokens
        by_group = getattr(self.loss_fn, "needs_groups", False)
        units = [list(g) for g in groups] if by_group else [[e] for e in sorted(exps, key=lambda e: len(e.tokens))]
        mine = units[self.rank::self.world]
        m: dict[str, float] = {}
        if not expert.all():  # rollouts only: expert / offline data carries a fixed reward
            rollout_rewards = rewards[~expert]                                            # [N_rollout]
            m["reward/mean"] = float(rollout_rewards.mean())
            m["reward/std"] = float(rollout_rewards.std()) if len(rollout_rewards) > 1 else 0.0
        ref = self._ref_logprobs(mine, exps[0]) if self.ref is not None else {}
        if cfg.kl_reward_coef:  # sum of k1 KL(behaviour || reference) over the policy's tokens, from every rank
            local = [(pos[id(e)], float((kl_estimate(torch.tensor(e.logprobs), ref[id(e)], "k1")
                                         * torch.tensor(e.action_mask)).sum()))
                     for u in mine for e in u if not expert[pos[id(e)]]]  # offline data: no behaviour logprobs
            every = [None] * self.world
            dist.all_gather_object(every, local)
            kl = torch.zeros(len(exps))
            for part in every:
                for i, v in part:
                    kl[i] = v
            rewards = rewards - cfg.kl_reward_coef * kl
            m["reward/kl_penalty"] = float(cfg.kl_reward_coef * kl.mean())
        if cfg.length_penalty:
            unit = {"tokens": lambda e: sum(e.action_mask), "turns": lambda e: e.info.get("turns", 1)}[cfg.length_unit]
            rewards = length_penalty(rewards, torch.tensor([float(unit(e)) for e in exps]), cfg.length_penalty)
        counts = {"token_counts": token_counts} if self.adv_counts else {}
        adv = self.advantage_fn(rewards, group_index, traj, **counts, **cfg.advantage_kwargs).float()   # [N]
        for e, a in zip(exps, adv.tolist()):
            e.info["advantage"] = a
        keep = [True] * len(exps)
        for name, fn in self.filters.items():
            dropped = 0
            for i, e in enumerate(exps):
                mask = {"action_mask": e.action_mask} if name in self.masked_filters else {}
                if keep[i] and not expert[i] and not fn(e.tokens, e.logprobs, float(adv[i]), **mask, **cfg.filters[name]):
                    keep[i], dropped = False, dropped + 1
            m[f"filter/{name}"] = dropped
        mine = [kept for u in mine if (kept := [e for e in u if keep[pos[id(e)]]])]
        total_seqs = sum(keep)
        if getattr(self.loss_fn, "split_expert", False):  # MIX: each part normalised over itself
            part_tokens, part_seqs = part_totals(token_counts, expert, torch.tensor(keep))               # [N], [N]
            totals = lambda idx: (part_tokens[idx].to(self.device), part_seqs[idx].to(self.device))  # noqa: E731
        else:
            whole = (float(token_counts[torch.tensor(keep)].sum()), total_seqs)
            totals = lambda idx: whole  # noqa: E731
        sums: dict[str, torch.Tensor] = {}
        objective = 0.0  # the aggregated policy loss (without KL and entropy terms)
        plan = self._plan(mine, exps[0])
        for mb, real in plan:
            b, lp, ent = self._forward(self.model, mb, real, entropy=True)
            mask, old = b["mask"], b["old_logprobs"]
            idx = torch.tensor([pos[id(e)] for e in mb])
            ref_lp = None
            if self.ref is not None:
                ref_lp = torch.zeros_like(old)
                for i, e in enumerate(mb if real else []):
                    ref_lp[i, :len(e.logprobs)] = ref[id(e)].to(self.device)
            dev = lambda x: x.to(self.device)  # noqa: E731
            out = self.loss_fn(LossInputs(lp, old, dev(adv[idx][:, None].expand(*mask.shape)), mask, dev(rewards[idx]),
                                          dev(torch.unique(group_index[idx], return_inverse=True)[1]),
                                          ref_lp, dev(expert[idx])), **cfg.policy_loss_kwargs)
            loss_tok = out["loss"]
            if cfg.kl_loss_coef:
                loss_tok = loss_tok + cfg.kl_loss_coef * kl_estimate(lp, ref_lp, cfg.kl_estimator)
            if cfg.entropy_coef:
                loss_tok = loss_tok - cfg.entropy_coef * ent
            (aggregate(loss_tok, mask, self.agg, *totals(idx)) * self.world).backward()
            with torch.no_grad():
                objective += float(aggregate(out["loss"], mask, self.agg, *totals(idx)))
                rollout = ~dev(expert[idx])[:, None]  # expert tokens have no behaviour log-probs
                parts = {"loss/entropy": ent,
                         "loss/kl_behaviour": kl_estimate(old, lp, "k3") * rollout,
                         "loss/logprob_abs_diff": (lp - old).abs() * rollout,
                         **{f"loss/{k}": v for k, v in out.items() if k != "loss"}}
                if ref_lp is not None:
                    parts["loss/kl_ref"] = kl_estimate(lp, ref_lp, cfg.kl_estimator)
                for k, v in parts.items():
                    sums[k] = sums.get(k, 0) + masked_sum(v.float(), mask).double().cpu()
                sums["tokens"] = sums.get("tokens", 0) + mask.sum().double().cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        names = sorted(sums)
        flat = torch.tensor([objective] + [float(sums[k]) for k in names], dtype=torch.float64)
        dist.all_reduce(flat)
        m["loss/policy"] = float(flat[0])
        if names:
            tok = max(float(flat[1 + names.index("tokens")]), 1.0)
            m.update({k: float(v) / tok for k, v in zip(names, flat[1:]) if k != "tokens"})
        self.version += 1
        lengths = [len(e.logprobs) for e in exps]
        train_s = time.perf_counter() - t0
        if not expert.all():
            m.update({"advantage/mean": float(adv[~expert].mean()), "advantage/abs_mean": float(adv[~expert].abs().mean())})
        m.update({"loss/grad_norm": float(grad_norm), "filter/kept": total_seqs,
                  "train/expert_seqs": int(expert.sum()), "train/micro_batches": len(plan),
                  "response/len_mean": sum(lengths) / len(lengths), "response/len_max": max(lengths),
                  "time/train_s": train_s,
                  "train/tokens_per_s": sum(len(e.tokens) for e in exps) / train_s})
        return m

    def save_state(self, run_dir: str | Path, step: int) -> Path:
        """Resume state after `step` steps: model and optimizer (torch.distributed.checkpoint,
        sharded as they are), version and RNG, plus full HF weights in hf/ for the explorer.
        Collective. Written to RUN_DIR/checkpoints/resume-{step:06d}/; only when it is
        complete does the marker checkpoints/resume-latest (written to a temporary file, then
        renamed over the old one) name it, and only then are older states deleted: at every
        moment the marker names a complete state, whatever is killed when. Returns the
        directory."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        root = Path(run_dir) / "checkpoints"
        path = root / f"resume-{step:06d}"
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # a partial state left by a crash
            path.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
        self.save(path / "hf")
        if self.rank == 0:
            torch.save({"step": step, "version": self.version, "rng": torch.get_rng_state()}, path / "trainer.pt")
            if self.before_resume_marker is not None:
                self.before_resume_marker()
            tmp = root / ".resume-latest.tmp"
            tmp.write_text(path.name)
            os.replace(tmp, root / "resume-latest")
            for old in root.glob("resume-[0-9]*"):
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def load_state(self, path: str | Path) -> int:
        """Load a `save_state` directory (`resume_state(run_dir)`); returns the number of
        steps it had done. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        meta = torch.load(Path(path) / "trainer.pt", weights_only=False)
        self.version = meta["version"]
        torch.set_rng_state(meta["rng"])
        return meta["step"]

    def save(self, path: str | Path, params: list[torch.Tensor] | None = None,
             dtype: torch.dtype = torch.float32) -> None:
        """Write a Hugging Face safetensors directory with the weights cast to `dtype`
        (float32 = exactly the trained weights; rank 0 writes; collective unless `params`
        from `full_parameters` is given)."""
        params = params if params is not None else self.full_parameters()
        if self.rank == 0:
            names = [n for n, _ in self.model.named_parameters()]
            state = {n: p.detach().to("cpu", dtype).contiguous() for n, p in zip(names, params)}
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))
            conf = Path(path) / "config.json"  # save_pretrained records the live model's float32
            conf.write_text(json.dumps({**json.loads(conf.read_text()), "dtype": str(dtype).removeprefix("torch.")},
                                       indent=2))
