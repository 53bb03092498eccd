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

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from buffer import Experience
from losses import ADVANTAGES, POLICY_LOSSES, LossInputs, kl_k3, masked_sum


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


def micro_batches(exps: list[Experience], token_budget: int) -> list[list[Experience]]:
    """Split into consecutive micro-batches whose padded size B * (P + R) stays within
    `token_budget` tokens (a single longer sequence gets a micro-batch of its own)."""
    out: list[list[Experience]] = []
    cur: list[Experience] = []
    P = R = 0
    for e in exps:
        p, r = max(P, e.prompt_length), max(R, len(e.tokens) - e.prompt_length)
        if cur and (len(cur) + 1) * (p + r) > token_budget:
            out.append(cur)
            cur, p, r = [], e.prompt_length, len(e.tokens) - e.prompt_length
        cur.append(e)
        P, R = p, r
    return out + [cur] if cur else out


def response_logprobs(model, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Log-probs [B, R] of `response_ids` under `model` at `temperature` (no top-p), from
    a batch made by `pack`. Only the R + 1 last positions go through the LM head."""
    R = batch["response_ids"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], logits_to_keep=R + 1).logits[:, :R]  # [B, R, V]
    logits = logits.float() / temperature
    picked = logits.gather(-1, batch["response_ids"][..., None]).squeeze(-1)              # [B, R]
    return picked - torch.logsumexp(logits, dim=-1)                                          # [B, R]


class Trainer:
    """FSDP2 policy + AdamW on this rank.

    cfg: run.Config (lr, weight_decay, max_grad_norm, token_budget, temperature, bf16,
    advantage, policy_loss, clip_low, clip_high, seed). Requires an initialised default
    process group.
    """

    def __init__(self, cfg, model_path: str, device: torch.device):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        blocks = set(model._no_split_modules or [])
        for m in model.modules():
            if type(m).__name__ in blocks:
                fully_shard(m)
        self.model = fully_shard(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.99))
        self.version = 0

    def full_parameters(self) -> list[torch.Tensor]:
        """All parameters as full tensors in `named_parameters()` order. Collective: every
        rank must call it; every rank gets the tensors."""
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for _, p in self.model.named_parameters()]

    def step(self, groups: list[list[Experience]]) -> dict[str, float]:
        """One optimiser step on the groups of one batch; returns metrics (rank-0 view of
        the global batch). Increments `self.version`."""
        cfg, t0 = self.cfg, time.perf_counter()
        exps = [e for g in groups for e in g]
        rewards = torch.tensor([e.reward for e in exps], dtype=torch.float)             # [N]
        index = torch.tensor([i for i, g in enumerate(groups) for _ in g])              # [N]
        adv = ADVANTAGES[cfg.advantage](rewards, index)                                 # [N]
        for e, a in zip(exps, adv.tolist()):
            e.info["advantage"] = a
        total_tokens = sum(sum(e.action_mask) for e in exps)
        mine = sorted(exps, key=lambda e: len(e.tokens))[self.rank::self.world]
        mbs = [(mb, True) for mb in micro_batches(mine, cfg.token_budget)]
        n_mb = torch.tensor(len(mbs))
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
        # ranks with fewer micro-batches run masked dummies to keep FSDP's collectives in step
        mbs += [([exps[0]], False)] * (int(n_mb) - len(mbs))
        sums = torch.zeros(5, dtype=torch.float64)  # loss, clipped, kl, |old - new|, tokens
        loss_fn = POLICY_LOSSES[cfg.policy_loss]
        for mb, real in mbs:
            b = {k: v.to(self.device) for k, v in pack(mb, self.pad).items()}
            b["mask"] = b["mask"] * real
            a = torch.tensor([e.info["advantage"] for e in mb], device=self.device)[:, None].expand_as(b["mask"])
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                lp = response_logprobs(self.model, b, cfg.temperature)                # [B, R]
            out = loss_fn(LossInputs(lp, b["old_logprobs"], a, b["mask"]),
                          clip_low=cfg.clip_low, clip_high=cfg.clip_high)
            loss = masked_sum(out["loss"], b["mask"]) / total_tokens * self.world
            loss.backward()
            with torch.no_grad():
                m = b["mask"]
                sums += torch.tensor([masked_sum(out["loss"], m), masked_sum(out["clipped"], m),
                                      masked_sum(kl_k3(lp, b["old_logprobs"]), m),
                                      masked_sum((lp - b["old_logprobs"]).abs(), m), m.sum()],
                                     dtype=torch.float64)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        self.version += 1
        tok = max(float(sums[4]), 1.0)
        lengths = [len(e.logprobs) for e in exps]
        train_s = time.perf_counter() - t0
        return {"loss/policy": float(sums[0]) / tok, "loss/clip_frac": float(sums[1]) / tok,
                "loss/kl_behaviour": float(sums[2]) / tok, "loss/logprob_abs_diff": float(sums[3]) / tok,
                "loss/grad_norm": float(grad_norm), "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if len(exps) > 1 else 0.0,
                "response/len_mean": sum(lengths) / len(lengths), "response/len_max": max(lengths),
                "time/train_s": train_s, "train/micro_batches": int(n_mb),
                "train/tokens_per_s": sum(len(e.tokens) for e in exps) / train_s}

    def save(self, path: str | Path, params: list[torch.Tensor] | None = None) -> None:
        """Write a Hugging Face safetensors directory (rank 0 writes; collective unless
        `params` from `full_parameters` is given)."""
        params = params if params is not None else self.full_parameters()
        if self.rank == 0:
            names = [n for n, _ in self.model.named_parameters()]
            state = {n: p.detach().cpu().contiguous() for n, p in zip(names, params)}
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))
