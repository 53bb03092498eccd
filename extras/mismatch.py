"""Mismatch attribution (--mismatch-every N): the gap between a batch's behaviour log-probs and
the trainer's current ones, split by cause, on this trainer's own rows.

Each response token's log-prob is recomputed along one path of single changes, from what the
engine recorded to what the trainer computes now:

    L0  behaviour: the engine's incremental decode, in the run's precision, at the behaviour
        version's weights, over the sampling's kept set (top-p / top-k)      (recorded)
    L1  the same in float32                                 precision, engine side = L1 - L0
    L2  the trainer's packed forward, float32               layout and kernels     = L2 - L1
    L3  the trainer's forward in the run's precision        precision, trainer side = L3 - L2
    L4  over the whole vocabulary                           truncation             = L4 - L3
    L5  at the trainer's current weights                    staleness              = L5 - L4

so that per token total = L5 - L0 = precision + layout + truncation + staleness exactly. The
path compares the two computations first at equal weights and equal precision (float32 on both
sides, the only precision both can run), so that `layout` is what incremental decoding with a
KV cache against one packed forward does by itself; the trainer's own precision comes next, then
what truncated sampling renormalises away, and staleness last, measured in the trainer's own
computation. A step whose setting is the same on both ends takes the value before it: float32
runs have no precision part, top_p 1 and top_k 0 no truncation, a batch of the current version
no staleness, each exactly 0.

The engine's side is recomputed with the trainer's own model (its float32 master weights) by
the HF engine's decoding (prefill, then one token at a time over a KV cache): a vLLM engine's
kernels differ from it, and that difference is in L1 - L0 (docs/mismatch.md).
"""

import os

import torch

from packing import left_pad

PARTS = ("precision", "layout", "truncation", "staleness")


def check_config(cfg) -> None:
    """ValueError (one line) where the attribution cannot run: it recomputes the engine's side
    with the trainer's model whole, so one trainer rank and no FSDP sharding."""
    if not cfg.mismatch_every:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.one_gpu_fsdp:
        raise ValueError("--mismatch-every needs one trainer rank without FSDP sharding")


def kept_set_logprobs(logp: torch.Tensor, floors: torch.Tensor, targets: torch.Tensor):
    """Log-probs [B] of `targets` [B] renormalised over the kept set of full-softmax log-probs
    `logp` [B, V]: the tokens at or above `floors` [B] (-inf: all), the target always kept."""
    kept = logp >= floors[:, None]  # [B, V]
    kept = kept.scatter(-1, targets[:, None], True)
    log_kept_mass = torch.logsumexp(logp.masked_fill(~kept, float("-inf")), -1)  # [B]
    return logp.gather(-1, targets[:, None]).squeeze(-1) - log_kept_mass


def floors_of(exps: list, R: int, device) -> torch.Tensor | None:
    """[B, R] each response token's kept-set floor (info "logprob_floors"), -inf after a
    response's end; None when no sequence has floors (top_p 1, top_k 0)."""
    if not any("logprob_floors" in e.info for e in exps):
        return None
    out = torch.full((len(exps), R), float("-inf"), device=device)
    for i, e in enumerate(exps):
        floors = e.info.get("logprob_floors")
        if floors:
            out[i, : len(floors)] = torch.tensor(floors, device=device)
    return out


@torch.no_grad()
def incremental_logprobs(model, exps: list, pad: int, temperature: float, device) -> torch.Tensor:
    """Log-probs [B, R] of each experience's response as the HF engine computes them while it
    samples (engines.HFEngine.generate_batch): the prompts left-padded and prefilled into a KV
    cache, then one token per step, teacher-forced; over the kept set where the experiences
    recorded floors. Positions after a response's end hold 0."""
    from engines import decode_cache

    R = max(len(e.tokens) - e.prompt_length for e in exps)
    responses = torch.full((len(exps), R), pad, dtype=torch.long, device=device)
    for i, e in enumerate(exps):
        response = e.tokens[e.prompt_length :]
        responses[i, : len(response)] = torch.tensor(response, device=device)
    floors = floors_of(exps, R, device)
    prompts = [e.tokens[: e.prompt_length] for e in exps]
    ids, attn, pos = (x.to(device) for x in left_pad(prompts, pad))
    cache = decode_cache()
    out = torch.zeros(len(exps), R, device=device)
    # the engine's model is in eval mode; blocks in training mode with activation checkpointing
    # would drop the KV cache
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        for j in range(R):
            at = None if floors is None else floors[:, j]  # [B]
            out[:, j] = decode_step(model, ids, attn, pos, cache, temperature, responses[:, j], at)
            ids = responses[:, j : j + 1]
            attn = torch.cat([attn, attn.new_ones(len(exps), 1)], 1)
            pos = pos[:, -1:] + 1
    finally:
        for m, training in modes:
            m.training = training
    return out


def decode_step(model, ids, attn, pos, cache, temperature: float, target, floors) -> torch.Tensor:
    """One step of `incremental_logprobs`: the log-probs [B] of `target` [B] after `ids` [B, S]
    (attention mask `attn` [B, P], positions `pos` [B, S]) over the KV cache `cache`, over the
    kept set above `floors` [B] (None: the whole vocabulary)."""
    logits = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]  # [B, V]
    logp = torch.log_softmax(logits.float() / temperature, -1)  # [B, V]
    if floors is None:
        return logp.gather(-1, target[:, None]).squeeze(-1)
    return kept_set_logprobs(logp, floors, target)


def packed_logprobs(trainer, exps: list, float32: bool, replay: bool) -> torch.Tensor:
    """The trainer's log-probs [B, R] of `exps` by its packed forward (Trainer.logprobs), in
    float32 or the run's precision, over the kept set (`replay`) or the whole vocabulary."""
    with torch.no_grad():
        _, lp, _ = trainer.logprobs(trainer.model, exps, False, float32=float32, replay=replay)
    return lp.float()


def path(policy, exps: list, version: int) -> list[torch.Tensor]:
    """L0 .. L5 (the module's docstring), each [B, R], of `exps` sampled at `version`, whose
    weights `policy` (extras.old_policy.OldPolicy) keeps; the trainer's weights are its own
    again after."""
    trainer = policy.trainer
    R = max(len(e.tokens) - e.prompt_length for e in exps)
    L0 = torch.zeros(len(exps), R, device=trainer.device)
    for i, e in enumerate(exps):
        L0[i, : len(e.behaviour_logprobs)] = torch.tensor(e.behaviour_logprobs)
    run_in_float32 = not trainer.autocast
    truncated = floors_of(exps, R, trainer.device) is not None
    with policy.weights_of(version):
        L1 = L0
        if not run_in_float32:
            L1 = incremental_logprobs(
                trainer.model, exps, trainer.pad, trainer.cfg.temperature, trainer.device
            )
        L2 = packed_logprobs(trainer, exps, float32=True, replay=True)
        L3 = L2 if run_in_float32 else packed_logprobs(trainer, exps, float32=False, replay=True)
        L4 = packed_logprobs(trainer, exps, float32=False, replay=False) if truncated else L3
    L5 = L4
    if version != trainer.version:
        L5 = packed_logprobs(trainer, exps, float32=False, replay=False)
    return [L0, L1, L2, L3, L4, L5]


def parts(levels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each part's signed log-prob difference [B, R] from `path`'s L0 .. L5, and "total"."""
    L0, L1, L2, L3, L4, L5 = (x.double() for x in levels)
    return {
        "precision": (L1 - L0) + (L3 - L2),
        "layout": L2 - L1,
        "truncation": L4 - L3,
        "staleness": L5 - L4,
        "total": L5 - L0,
    }


def attribute(policy, exps: list) -> dict[str, float]:
    """`mismatch/<part>/abs` (the mean |delta log-prob| over the trained tokens) and
    `mismatch/<part>/k3` (the k3 estimate of KL(before || after) of the part's delta, sampled
    from the behaviour policy) of each part and the total, over the sequences `exps` (not
    offline) whose behaviour version's weights `policy` (extras.old_policy.OldPolicy) keeps;
    `mismatch/tokens`: how many tokens they are. Needs one unsharded trainer rank
    (`check_config`)."""
    trainer = policy.trainer
    sums: dict[str, torch.Tensor] = {}
    tokens = 0.0
    kept = policy.kept.versions(trainer.version)
    for version in sorted({e.model_version for e in exps} & kept):
        of_version = [e for e in exps if e.model_version == version and not e.info.get("offline")]
        if not of_version:
            continue
        R = max(len(e.tokens) - e.prompt_length for e in of_version)
        mask = torch.zeros(len(of_version), R, dtype=torch.float64, device=trainer.device)
        for i, e in enumerate(of_version):
            mask[i, : len(e.action_mask)] = torch.tensor(e.action_mask, dtype=torch.float64)
        for name, delta in parts(path(policy, of_version, version)).items():
            k3 = torch.expm1(delta.clamp(-20, 20)) - delta
            for stat, value in (("abs", delta.abs()), ("k3", k3)):
                key = f"mismatch/{name}/{stat}"
                sums[key] = sums.get(key, 0.0) + (value * mask).sum()
        tokens += float(mask.sum())
    out = {k: float(v) / max(tokens, 1.0) for k, v in sums.items()}
    out["mismatch/tokens"] = tokens
    return out
