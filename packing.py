"""The token layouts of a batch: the trainer's forward pass (shared-prompt packing,
micro-batches by token budget, log-probs computed in chunks) and the explorer's left-padded prompts.

The rollouts of a group share their prompt: `pack` puts the prompt once in a row and the
responses after it, with a block mask so that each response sees the prompt and itself
only; `micro_batches` splits a batch so that each packed forward pass stays within the
token budget; `response_logprobs` returns the log-probs of the response tokens, the LM head
applied in chunks (`chunked_logprobs`) so that the logits of a micro-batch never exist at once.
A file of its own: the trainer, the engines and the log-prob tests share these layouts.
"""
from __future__ import annotations

import torch

from buffer import Experience


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists left-padded with `pad` to the longest: input_ids, attention_mask and
    position_ids, each [B, P] long (positions count real tokens only, pads get 0): the
    model input of the explorer's prompts."""
    B, P = len(seqs), max(map(len, seqs))
    ids = torch.full((B, P), pad, dtype=torch.long)
    attn = torch.zeros((B, P), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids[b, P - len(s):] = torch.tensor(s)
            attn[b, P - len(s):] = 1
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def share_prompts(exps: list[Experience], row_tokens: int = 0) -> list[tuple[list[int], list[int]]]:
    """Rows of a shared-prefix packing: consecutive experiences with the same prompt (the
    rollouts of one group) share one row, the prompt once and their responses after it,
    while the row stays within `row_tokens` tokens (0 = no bound; a row always takes at
    least one response). Returns (prompt ids, indices into `exps`) per row."""
    rows: list[tuple[list[int], list[int]]] = []
    for i, e in enumerate(exps):
        prompt, n = e.tokens[:e.prompt_length], len(e.tokens) - e.prompt_length
        if rows and rows[-1][0] == prompt:
            used = len(prompt) + sum(len(exps[j].tokens) - exps[j].prompt_length for j in rows[-1][1])
            if not row_tokens or used + n <= row_tokens:
                rows[-1][1].append(i)
                continue
        rows.append((prompt, [i]))
    return rows


def longest_row(exps: list[Experience], rows: list[tuple[list[int], list[int]]]) -> int:
    """Tokens in the longest of `share_prompts` rows: its prompt and its responses."""
    return max(len(p) + sum(len(exps[i].tokens) - len(p) for i in m) for p, m in rows)


def packed_tokens(exps: list[Experience], row_tokens: int = 0) -> int:
    """Tokens a forward pass over `pack(exps, pad, row_tokens)` computes: rows x the
    longest row."""
    rows = share_prompts(exps, row_tokens)
    return len(rows) * longest_row(exps, rows)


def unpadded_tokens(exps: list[Experience], row_tokens: int = 0) -> int:
    """Tokens of the `share_prompts` rows of `exps` without their padding: each shared prompt
    once, every response (what a forward pass over `pack` needs to compute)."""
    return sum(len(p) + sum(len(exps[i].tokens) - len(p) for i in m) for p, m in share_prompts(exps, row_tokens))


def pack(exps: list[Experience], pad: int, row_tokens: int = 0) -> dict[str, torch.Tensor]:
    """Shared-prefix packing of a micro-batch: each row holds one prompt and the responses
    that continue it (`share_prompts`: a group of 8 rollouts of a 40-token prompt costs
    40 + 8 x R tokens instead of 8 x (40 + R)). A block mask lets every response attend
    to the prompt and to its own earlier tokens only, and its position ids continue the
    prompt's, so each response's log-probs are exactly those of prompt + response alone.

    Returns the model input input_ids [N, L] long, attention_mask [N, 1, L, L] bool (True
    = attend; padding attends to itself only) and position_ids [N, L]; for every response
    token (T in all) its row, the position whose hidden state predicts it (the prompt's
    last position for a response's first token) and its id: rows / positions / targets
    [T] long, and where it goes in the [B, R] response layout: seq / col [T] long; over
    the response region response_ids / behaviour_logprobs / mask [B, R] (R >= 1: an
    empty response gets one masked pad token)."""
    B = len(exps)
    R = max(1, max(len(e.tokens) - e.prompt_length for e in exps))
    rows = share_prompts(exps, row_tokens)
    L = longest_row(exps, rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    pos = torch.zeros((len(rows), L), dtype=torch.long)
    seg = torch.full((len(rows), L), -1, dtype=torch.long)  # 0 = prompt, k = k-th response of the row, -1 = pad
    index: list[tuple[int, int, int, int]] = []  # (row, predicting position, sequence, column) per response token
    for r, (prompt, members) in enumerate(rows):
        P = len(prompt)
        ids[r, :P], pos[r, :P], seg[r, :P] = torch.tensor(prompt, dtype=torch.long), torch.arange(P), 0
        s = P
        for k, i in enumerate(members, 1):
            n = len(exps[i].tokens) - P
            ids[r, s:s + n] = torch.tensor(exps[i].tokens[P:], dtype=torch.long)
            pos[r, s:s + n], seg[r, s:s + n] = torch.arange(P, P + n), k
            index += [(r, P - 1 if j == 0 else s + j - 1, i, j) for j in range(n)]
            s += n
    q, k = seg[:, :, None], seg[:, None, :]                                              # [N, L, 1], [N, 1, L]
    causal = torch.ones(L, L, dtype=torch.bool).tril()                                   # [L, L]
    attn = causal & (q >= 0) & ((k == 0) | (k == q)) | torch.eye(L, dtype=torch.bool)    # [N, L, L]
    rows_i, positions, seq, col = (torch.tensor(x, dtype=torch.long) for x in zip(*index)) if index else \
        (torch.zeros(0, dtype=torch.long),) * 4
    response = torch.full((B, R), pad, dtype=torch.long)
    behaviour, mask = torch.zeros((B, R)), torch.zeros((B, R))
    for b, e in enumerate(exps):
        r = len(e.tokens) - e.prompt_length
        response[b, :r] = torch.tensor(e.tokens[e.prompt_length:], dtype=torch.long)
        behaviour[b, :r] = torch.tensor(e.behaviour_logprobs)
        mask[b, :r] = torch.tensor(e.action_mask, dtype=torch.float)
    return {"input_ids": ids, "attention_mask": attn[:, None], "position_ids": pos, "rows": rows_i,
            "positions": positions, "targets": response[seq, col], "seq": seq, "col": col,
            "response_ids": response, "behaviour_logprobs": behaviour, "mask": mask}


def micro_batches(units: list[list[Experience]], token_budget: int) -> list[list[Experience]]:
    """Split consecutive units (single experiences, or whole groups for group-level losses)
    into micro-batches whose packed size (`packed_tokens`: rows x longest row, the
    rollouts of a group sharing their prompt) stays within `token_budget` tokens; a unit is
    never split (a single larger unit gets a micro-batch of its own)."""
    out: list[list[Experience]] = []
    cur: list[Experience] = []
    for unit in units:
        grown = cur + unit
        if cur and packed_tokens(grown, token_budget) > token_budget:
            out.append(cur)
            grown = list(unit)
        cur = grown
    return out + [cur] if cur else out


def packed_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    rows: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder over a `pack` batch, then the LM head on the hidden states that predict
    response tokens only, in chunks (`chunked_logprobs`): log-probs [T] and entropy
    [T] or None. Trainer models get it as an FSDP forward method (`nanorft_logprobs`), so
    FSDP gathers the root's parameters (embeddings, final norm, LM head) around it."""
    mask = attention_mask
    if model.config._attn_implementation == "eager":  # eager attention adds its mask; sdpa takes booleans
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float).min)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state  # [N, L, H]
    head = model.get_output_embeddings()
    return chunked_logprobs(hidden[rows, positions], head.weight, targets, temperature, entropy, bias=head.bias)


def response_logprobs(model, batch: dict[str, torch.Tensor], temperature: float,
                      entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of `response_ids` under `model` at `temperature` (no top-p), from
    a batch made by `pack`, and the token entropy [B, R] (nats) when `entropy` (with a
    gradient only when `entropy_grad`). Padding gets 0."""
    forward = getattr(model, "nanorft_logprobs", None) or (lambda *a: packed_logprobs(model, *a))
    lp, ent = forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["rows"],
                      batch["positions"], batch["targets"], temperature, entropy)            # [T], [T]
    B, R = batch["response_ids"].shape
    where = batch["seq"] * R + batch["col"]                                                  # [T]
    out = lp.new_zeros(B * R).index_put((where,), lp).view(B, R)                             # [B, R]
    if not entropy:
        return out, None
    ent = ent if entropy_grad and torch.is_grad_enabled() else ent.detach()
    return out, ent.new_zeros(B * R).index_put((where,), ent).view(B, R)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution. logits [B, T, V] -> [B, T].
    Reference: volcengine/verl verl/utils/torch_functional.py entropy_from_logits @ b178a3c."""
    logz = torch.logsumexp(logits, -1)                                  # [B, T]
    return logz - (torch.softmax(logits, -1) * logits).sum(-1)          # [B, T]


LOGIT_CHUNK_ELEMS = 2 ** 22  # float32 logits held at once by chunked_logprobs: 16 MiB


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     entropy: bool = False, chunk_elems: int = LOGIT_CHUNK_ELEMS,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token under softmax((hidden @ weight.T + bias) / temperature)
    in float32, and the token entropy (nats) when `entropy`; the logits of at most
    `chunk_elems` elements exist at any time. hidden [T, H]; weight [V, H] (the LM head);
    targets [T] long -> logprobs [T], entropy [T] or None.

    The logits of a micro-batch (T x V float32, and a copy for each tensor autograd keeps)
    are never materialised: each chunk is computed, reduced and dropped, and recomputed in
    the backward pass, whose gradient is written out by hand (`HeadLogprobs`), exactly that
    of the unchunked expression. Same idea as Liger-Kernel's fused linear cross entropy
    (linkedin/Liger-Kernel src/liger_kernel/ops/fused_linear_cross_entropy.py), which gives
    a cross entropy, not the log-probs, and needs Triton (GPU)."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float)
        return empty, (empty if entropy else None)
    rows = max(1, chunk_elems // weight.shape[0])
    lp, ent = HeadLogprobs.apply(hidden, weight, bias, targets, temperature, rows, entropy)
    return lp, (ent if entropy else None)


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    return torch.nn.functional.linear(h, weight, bias).float().div_(temperature)        # [c, V]


class HeadLogprobs(torch.autograd.Function):
    """`chunked_logprobs`'s forward and backward, `rows` rows of logits at a time.
    Forward: logits z = (h W^T + b) / temperature, log Z = logsumexp(z), log-prob z_t - log Z,
    and (when `entropy`) H = log Z - sum_v p_v z_v with p = softmax(z). Backward, from the
    logits recomputed: dz_v = g_lp (1[v = t] - p_v) - g_H p_v (z_v - (log Z - H)), then
    dh = dz W / temperature, dW = dz^T h / temperature, db = sum dz / temperature (the
    cross-entropy gradient of Liger-Kernel's fused linear cross entropy, plus the
    entropy's). Runs under the autocast state of the forward (bf16 products on a CPU
    with native bf16)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, entropy):
        lps, logzs, ents = [], [], []
        for i in range(0, hidden.shape[0], rows):
            z = _head_logits(hidden[i:i + rows], weight, bias, temperature)           # [c, V]
            logz = torch.logsumexp(z, -1)                                             # [c]
            lps.append(z.gather(-1, targets[i:i + rows, None]).squeeze(-1) - logz)   # [c]
            logzs.append(logz)
            if entropy:
                ents.append(logz - torch.softmax(z, -1).mul_(z).sum(-1))                 # [c] (token_entropy)
        lp, logz = torch.cat(lps), torch.cat(logzs)                                   # [T], [T]
        ent = torch.cat(ents) if entropy else lp.new_zeros(0)                         # [T] or [0]
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)  # an output nobody differentiates brings None, not zeros
        ctx.save_for_backward(hidden, weight, bias, targets, logz, ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, logz, ent = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        gh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight, dtype=torch.float) if ctx.needs_input_grad[1] else None
        gb = torch.zeros_like(bias, dtype=torch.float) if bias is not None and ctx.needs_input_grad[2] else None
        g_lp = torch.zeros_like(logz) if g_lp is None else g_lp.float()              # [T]
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for i in range(0, hidden.shape[0], ctx.rows):
                c = slice(i, i + ctx.rows)
                h, t = hidden[c], targets[c]
                z = _head_logits(h, weight, bias, ctx.temperature)                    # [c, V]
                p = (z - logz[c, None]).exp_()                                        # [c, V]
                scale = g_lp[c, None]                                                 # [c, 1]
                if g_ent is not None:
                    scale = scale + g_ent[c, None].float() * (z - (logz[c] - ent[c])[:, None])  # [c, V]
                dz = p.mul_(scale).neg_().scatter_add_(-1, t[:, None], g_lp[c, None]).div_(ctx.temperature)
                dz = dz if enabled else dz.to(weight.dtype)                           # [c, V]
                if gh is not None:
                    gh[c] = (dz @ weight).to(gh.dtype)                                # [c, H]
                if gw is not None:
                    gw += (dz.T @ (h if enabled else h.to(weight.dtype))).float()     # [V, H]
                if gb is not None:
                    gb += dz.float().sum(0)                                           # [V]
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None)
