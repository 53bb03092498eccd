"""Token layouts of a batch: `pack` (shared prompts), `micro_batches`, `response_logprobs` and
`left_pad`; `kept_floor`, the kept set of top-k / top-p sampling that the engine records and the
LM head's log-probs (`HeadLogprobs`) replay."""

import functools

import torch

from buffer import Experience


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists left-padded with `pad`: input_ids, attention_mask, position_ids [B, P] long (pads
    at position 0)."""
    P = max(map(len, seqs))
    ids = torch.tensor([[pad] * (P - len(s)) + list(s) for s in seqs], dtype=torch.long)
    attn = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def share_prompts(exps: list[Experience], row_tokens: int = 0) -> list[tuple[list[int], list[int]]]:
    """Rows (prompt ids, indices into `exps`): consecutive same-prompt experiences within
    `row_tokens` (0: any)."""
    rows: list[tuple[list[int], list[int]]] = []
    for i, e in enumerate(exps):
        prompt = e.tokens[: e.prompt_length]
        if rows and rows[-1][0] == prompt:
            grown = row_length(exps, *rows[-1]) + len(e.tokens) - len(prompt)
            if not row_tokens or grown <= row_tokens:
                rows[-1][1].append(i)
                continue
        rows.append((prompt, [i]))
    return rows


def row_length(exps: list[Experience], prompt: list[int], members: list[int]) -> int:
    """Tokens of a `share_prompts` row: its prompt once and its responses."""
    return len(prompt) + sum(len(exps[i].tokens) - len(prompt) for i in members)


def packed_tokens(exps: list[Experience], row_tokens: int = 0) -> int:
    """Tokens of `pack(exps, pad, row_tokens)`'s rows [N, L]: rows x the longest (the dense layers
    compute fewer)."""
    lengths = [row_length(exps, *row) for row in share_prompts(exps, row_tokens)]
    return len(lengths) * max(lengths)


def pack(
    exps: list[Experience],
    pad: int,
    row_tokens: int = 0,
    multiple: int = 1,
    causal: bool = False,
    token_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """`share_prompts` rows [N, L] under a block mask: each response gets the log-probs of
    prompt + response alone. `packed_sdpa`'s layout: input_ids, position_ids [1, T] (the rows'
    tokens, T a `token_multiple`), token_slots [T] (each one's slot of the rows), attention_mask
    [N, 1, L, L] bool (L a `multiple`); if `causal` and each row holds one sequence: input_ids
    [N, L], position_ids [1, L], no mask or slots. Per response token rows / positions (predicting
    it) / targets / seq / col [T'] long, floors [T'] float (the kept sets' log-prob floors of
    info["logprob_floors"], -inf where an experience has none; None where none has any);
    response_ids / behaviour_logprobs / mask [B, R]."""
    R = max(1, max(len(e.tokens) - e.prompt_length for e in exps))
    rows = share_prompts(exps, row_tokens)
    L = -(-max(row_length(exps, *row) for row in rows) // multiple) * multiple
    # seg: 0 = prompt, k = k-th response of the row, -1 = pad
    ids, pos, seg = (torch.full((len(rows), L), v, dtype=torch.long) for v in (pad, 0, -1))
    # (row, predicting position, sequence, column) per response token
    index: list[tuple[int, int, int, int]] = []
    for r, (prompt, members) in enumerate(rows):
        P = len(prompt)
        ids[r, :P] = torch.tensor(prompt, dtype=torch.long)
        pos[r, :P] = torch.arange(P)
        seg[r, :P] = 0
        s = P
        for k, i in enumerate(members, 1):
            n = len(exps[i].tokens) - P
            ids[r, s : s + n] = torch.tensor(exps[i].tokens[P:], dtype=torch.long)
            pos[r, s : s + n], seg[r, s : s + n] = torch.arange(P, P + n), k
            index += [(r, P - 1 if j == 0 else s + j - 1, i, j) for j in range(n)]
            s += n
    rows_i, positions, seq, col = torch.tensor(index, dtype=torch.long).view(-1, 4).T  # [T'] each
    token_slots = None
    if causal and len(rows) == len(exps):  # causal up to each row's pads, which nothing reads
        attn, pos = None, torch.arange(L)[None]  # [1, L]
    else:
        # extra tokens up to a multiple: in pads' slots
        tail = -int((seg >= 0).sum()) % token_multiple
        if (extra := -((int((seg < 0).sum()) - tail) // L)) > 0:  # too few pads: rows of them
            ids, pos, seg = (
                torch.cat([x, x.new_full((extra, L), v)])
                for x, v in ((ids, pad), (pos, 0), (seg, -1))
            )
        q, k = seg[:, :, None], seg[:, None, :]  # [N, L, 1], [N, 1, L]
        tril = torch.ones(L, L, dtype=torch.bool).tril()  # [L, L]
        # [N, 1, L, L]
        attn = (tril & (q >= 0) & ((k == 0) | (k == q)) | torch.eye(L, dtype=torch.bool))[:, None]
        is_token = seg.flatten() >= 0  # [N x L]
        real, free = is_token.nonzero().squeeze(1), (~is_token).nonzero().squeeze(1)
        token_slots = torch.cat([real, free[:tail]])  # [T]
        positions = (is_token.cumsum(0) - 1)[rows_i * L + positions]
        rows_i = torch.zeros_like(rows_i)
        ids, pos = ids.flatten()[token_slots][None], pos.flatten()[token_slots][None]  # [1, T]
    response = torch.full((len(exps), R), pad, dtype=torch.long)
    behaviour, mask = torch.zeros((len(exps), R)), torch.zeros((len(exps), R))
    floors = None  # [B, R] once an experience has floors
    for b, e in enumerate(exps):
        r = len(e.tokens) - e.prompt_length
        response[b, :r] = torch.tensor(e.tokens[e.prompt_length :], dtype=torch.long)
        behaviour[b, :r] = torch.tensor(e.behaviour_logprobs)
        mask[b, :r] = torch.tensor(e.action_mask, dtype=torch.float)
        if (fl := e.info.get("logprob_floors")) is not None:
            if floors is None:
                floors = torch.full((len(exps), R), float("-inf"))
            floors[b, :r] = torch.tensor(fl, dtype=torch.float)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": pos,
        "token_slots": token_slots,
        "rows": rows_i,
        "positions": positions,
        "targets": response[seq, col],
        "floors": None if floors is None else floors[seq, col],
        "seq": seq,
        "col": col,
        "response_ids": response,
        "behaviour_logprobs": behaviour,
        "mask": mask,
    }


def kept_floor(logp: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor | None:
    """The threshold [B] of the tokens that top-k (0: off), then top-p over the renormalised top-k,
    keep of log-probs logp [B, V] (kept: logp >= it): halfway between the smallest kept log-prob and
    the largest dropped one, so that a recomputation's noise (the trainer's kernels, bf16) flips no
    token not that close to the boundary; ties at it all kept (as vLLM's top-k keeps them). None:
    no truncation (top_p 1, top_k 0). engines.sample_token records it; HeadLogprobs replays it."""
    if top_p >= 1.0 and top_k <= 0:
        return None
    k = top_k if 0 < top_k < logp.shape[-1] else logp.shape[-1]
    # [B, k + 1] descending: the top-k and the first it drops; [B, V] for top-p alone
    vals = logp.topk(k + 1, dim=-1).values if k < logp.shape[-1] else logp.sort(-1, True).values
    kept = torch.full_like(vals[:, 0], k, dtype=torch.long)  # [B] how many of `vals` are kept
    if top_p < 1.0:  # the smallest prefix of the renormalised top-k reaching top_p (>= 1 token)
        probs = torch.softmax(vals[:, :k], dim=-1)  # [B, k]
        kept = ((probs.cumsum(-1) - probs) < top_p).sum(-1).clamp_(min=1)
    smallest = vals.gather(-1, (kept - 1)[:, None]).squeeze(-1)  # [B]
    dropped = vals.gather(-1, kept.clamp(max=vals.shape[1] - 1)[:, None]).squeeze(-1)  # [B]
    # none dropped: 1 below the smallest (finite, for the buffer's JSON)
    return torch.where(kept < vals.shape[1], (smallest + dropped) / 2, smallest - 1)


def micro_batches(units: list[list[Experience]], token_budget: int) -> list[list[Experience]]:
    """Consecutive units (experience lists, never split) in micro-batches within `token_budget`
    packed tokens."""
    out: list[list[Experience]] = []
    for unit in units:
        if out and packed_tokens(out[-1] + unit, token_budget) <= token_budget:
            out[-1] += unit
        else:
            out.append(list(unit))
    return out


@functools.cache
def packed_sdpa() -> str:
    """The name of nanorft's attention in transformers: torch's sdpa; grouped-query heads by sdpa's
    kernel, as the query rows of one attention per key-value head in a decode step
    (`grouped_decode_attention`), repeated under a mask on a GPU. Given a `pack` batch's token_slots
    [T] (a forward kwarg), q, k, v [1, heads, T, D] go to their slots of the rows [N, heads, L, D]
    under the mask [N, 1, L, L], the output back to [1, T, heads, D]: dense layers compute no
    pads."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        is_causal=None,
        token_slots=None,
        **kwargs,
    ):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if attention_mask is not None and attention_mask.numel() == 0:  # packed_logprobs' causal
            attention_mask = None
        grouped = key.shape[1] != query.shape[1]
        if grouped and token_slots is None and query.shape[2] == 1:
            return grouped_decode_attention(query, key, value, attention_mask, scaling), None
        # [1, h, T, D] -> [N, h, L, D]; index_copy_ and index_select: a cheap backward
        if token_slots is not None:
            N, L = attention_mask.shape[0], attention_mask.shape[-1]
            query, key, value = (
                x.new_zeros(N * L, *x.shape[1:])
                .index_copy_(0, token_slots, x)
                .unflatten(0, (N, L))
                .transpose(1, 2)
                for x in (t[0].transpose(0, 1) for t in (query, key, value))
            )
        if grouped and attention_mask is not None and query.is_cuda:
            # a GPU's kernels that take a mask take no grouped heads (sdpa's enable_gqa would fall
            # back to the math kernel): the heads repeated, as transformers' sdpa attention does
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
            grouped = False
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=bool(causal and attention_mask is None and query.shape[2] > 1),
            enable_gqa=grouped,
        ).transpose(1, 2)  # [B, q, H, D]
        if token_slots is None:
            return out.contiguous(), None
        return out.flatten(0, 1).index_select(0, token_slots)[None], None

    AttentionInterface.register("nanorft_sdpa", attention)
    AttentionMaskInterface.register("nanorft_sdpa", sdpa_mask)
    return "nanorft_sdpa"


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of one new token per row under grouped-query heads: query [B, H, 1, D], key and
    value [B, KV, L, D] (H a multiple of KV), mask [B, 1, 1, L] (bool or additive) or None
    -> [B, 1, H, D]. The G = H / KV query heads that share a key-value head are the G query rows of
    one attention over it, so no kernel copies the cache's keys and values once per query head
    (transformers' repeat_kv; sdpa's enable_gqa under a mask on a CPU, or its fallback to the math
    kernel on a GPU). Query head h reads key-value head h // G, as repeat_kv pairs them."""
    B, H, _, D = query.shape
    KV = key.shape[1]
    grouped = query.reshape(B, KV, H // KV, D)  # [B, KV, G, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scale
    )  # [B, KV, G, D]
    return out.reshape(B, 1, H, D)


def packed_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    token_slots: torch.Tensor | None,
    rows: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    head_grad_into_weight: bool = False,
    head_chunk_elems: int = 0,
    floors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [T'] and entropy [T'] or None of a `pack` batch, the LM head on predicting
    positions only; switches `model` to `packed_sdpa` (plain sdpa where no slots are given).
    `head_grad_into_weight`, `head_chunk_elems`, `floors` [T']: `chunked_logprobs`'
    grad_into_weight, chunk_elems and floors; floors may come as their int32 bits
    (`response_logprobs`: FSDP2's mixed precision casts a floating input to bf16)."""
    if model.config._attn_implementation != packed_sdpa():
        model.set_attn_implementation(packed_sdpa())
    if attention_mask is None:  # causal rows: an empty 4D mask, which transformers passes on;
        # for none it would read the position_ids on the host (a GPU sync) for packed sequences
        attention_mask = torch.ones(0, 1, 0, 0, dtype=torch.bool, device=input_ids.device)
    hidden = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        token_slots=token_slots,
    ).last_hidden_state  # [N, L, H] or [1, T, H]
    head = model.get_output_embeddings()
    if floors is not None and not floors.is_floating_point():
        floors = floors.view(torch.float32)
    return chunked_logprobs(
        hidden[rows, positions],
        head.weight,
        targets,
        temperature,
        entropy,
        chunk_elems=head_chunk_elems,
        bias=head.bias,
        grad_into_weight=head_grad_into_weight,
        floors=floors,
    )


def response_logprobs(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float,
    entropy: bool = False,
    entropy_grad: bool = False,
    head_grad_into_weight: bool = False,
    head_chunk_elems: int = 0,
    replay: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of a `pack` batch's responses and, if `entropy`, their entropy [B, R]
    (nats); padding 0. `head_grad_into_weight`, `head_chunk_elems`: see `packed_logprobs`.
    `replay`: over the kept sets of the batch's floors [T'] (`chunked_logprobs`), where it has
    any; else over the full vocabulary."""
    forward = getattr(model, "nanorft_logprobs", None) or (lambda *a: packed_logprobs(model, *a))
    keys = "input_ids attention_mask position_ids token_slots rows positions targets".split()
    inputs = [batch[k] for k in keys]
    floors = batch.get("floors") if replay else None
    if floors is not None:  # FSDP2 would cast float32 floors to its bf16 compute dtype
        floors = floors.float().view(torch.int32)
    # [T'], [T']
    lp, ent = forward(
        *inputs, temperature, entropy, head_grad_into_weight, head_chunk_elems, floors
    )
    B, R = batch["response_ids"].shape
    where = batch["seq"] * R + batch["col"]  # [T]
    out = lp.new_zeros(B * R).index_put((where,), lp).view(B, R)  # [B, R]
    if not entropy:
        return out, None
    ent = ent if entropy_grad and torch.is_grad_enabled() else ent.detach()
    return out, ent.new_zeros(B * R).index_put((where,), ent).view(B, R)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of logits [B, T, V] -> [B, T]; verl/utils/torch_functional.py
    entropy_from_logits @ b178a3c."""
    logz = torch.logsumexp(logits, -1)  # [B, T]
    return logz - (torch.softmax(logits, -1) * logits).sum(-1)  # [B, T]


# float32 logits per chunk of the LM head: 16 MiB on a CPU (a GPU needs many rows a chunk to keep
# its matmuls busy); whole multiples of 16 rows (padded): a few shapes, each a kept oneDNN primitive
HEAD_CHUNK_ELEMS = {"cpu": 2**22, "cuda": 2**28}
HEAD_ROW_MULTIPLE = 16
# the backward's chunks per product of the weight's gradient, their dz kept (8 MiB a chunk in bf16)
HEAD_GRAD_CHUNKS = {"cpu": 4, "cuda": 1}


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    chunk_elems: int = 0,
    bias: torch.Tensor | None = None,
    grad_into_weight: bool = False,
    floors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs [T] of `targets` [T] under
    softmax((hidden [T, H] @ weight [V, H].T + bias) / temperature), and the entropy [T],
    `chunk_elems` (0: HEAD_CHUNK_ELEMS) logits at a time (Liger-Kernel's
    fused_linear_cross_entropy.py). `grad_into_weight`: the backward adds the weight's gradient into
    `weight.grad` in place instead of returning a new [V, H] (a weight tied to a sparse embedding,
    whose gradient autograd would otherwise add into one more [V, H]). `floors` [T] float32
    (sampling-mask replay): each token's distribution is renormalised over its kept set, the
    tokens whose full log-prob is >= its floor, and its target (-inf: the full vocabulary); None:
    the full vocabulary everywhere. Zero rows pad the tokens to a multiple of HEAD_ROW_MULTIPLE."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float)
        return empty, (empty if entropy else None)
    chunk_elems = chunk_elems or HEAD_CHUNK_ELEMS.get(hidden.device.type, 2**22)
    rows = max(1, chunk_elems // weight.shape[0])
    multiple = min(HEAD_ROW_MULTIPLE, rows)
    rows = rows // multiple * multiple
    pad = -hidden.shape[0] % multiple
    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))  # [T + pad, H]
    targets = torch.nn.functional.pad(targets, (0, pad))  # [T + pad]
    if floors is not None:
        floors = torch.nn.functional.pad(floors, (0, pad), value=-torch.inf)  # [T + pad]
    lp, ent = HeadLogprobs.apply(
        hidden, weight, bias, targets, temperature, rows, entropy, grad_into_weight, floors
    )
    return lp[: len(lp) - pad], (ent[: len(lp) - pad] if entropy else None)


class HeadLogprobs(torch.autograd.Function):
    """`chunked_logprobs`, `rows` rows of logits z at a time; the backward recomputes them:
    dz_v = g_lp (1[v = t] - p_v) - g_H p_v (z_v - (log Z - H)), under the forward's autocast. With
    floors, p is the kept set's renormalised distribution (0 outside it) and Z its normaliser: the
    same formula, the kept set recomputed as the forward found it."""

    @staticmethod
    def logits(
        h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
    ) -> torch.Tensor:
        return torch.nn.functional.linear(h, weight, bias).float().div_(temperature)  # [c, V]

    @staticmethod
    def keep_only(
        p: torch.Tensor, z: torch.Tensor, floors: torch.Tensor, logz: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """p [c, V] (a function of logits z [c, V]) zeroed in place outside the kept sets: the
        tokens of full log-prob z - logz >= floors [c] (logz [c] the full normalisers), and the
        targets t [c] (sampled, so kept, whatever the recomputation's noise)."""
        at_target = p.gather(-1, t[:, None])  # [c, 1]
        p.masked_fill_(z < (floors + logz)[:, None], 0.0)
        return p.scatter_(-1, t[:, None], at_target)

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, rows, entropy, grad_into_weight, floors
    ):
        lps, logzs, logks, ents = [], [], [], []
        device = hidden.device.type
        # cast once, not in each chunk's product
        cast = weight
        if torch.is_autocast_enabled(device):
            cast = weight.to(torch.get_autocast_dtype(device))
        for i in range(0, hidden.shape[0], rows):
            z = HeadLogprobs.logits(hidden[i : i + rows], cast, bias, temperature)  # [c, V]
            t = targets[i : i + rows]  # [c]
            zt = z.gather(-1, t[:, None]).squeeze(-1)  # [c]
            if floors is None:
                logz = torch.logsumexp(z, -1)  # [c]
                logzs.append(logz)
                lps.append(zt - logz)  # [c]
                if entropy:
                    ents.append(logz - torch.softmax(z, -1).mul_(z).sum(-1))  # [c] (token_entropy)
                continue
            # one exp of z serves both normalisers (not a logsumexp, then a softmax over the kept
            # set: twice the passes over [c, V]), shifted by the largest logit m
            m = z.max(-1).values  # [c]
            p = (z - m[:, None]).exp_()  # [c, V]
            logz = m + p.sum(-1).log()  # [c]
            logzs.append(logz)
            HeadLogprobs.keep_only(p, z, floors[i : i + rows], logz, t)
            mass = p.sum(-1)  # [c] the kept set's mass, relative to exp(m)
            # [c] its normaliser; a target alone in its kept set, of a mass below float32's: its
            # own logit
            logk = torch.where(mass > 0, m + mass.log(), zt)
            logks.append(logk)
            lps.append(zt - logk)  # [c]
            if entropy:  # of the kept set's renormalised distribution
                ents.append(torch.where(mass > 0, logk - p.mul_(z).sum(-1) / mass, 0.0))  # [c]
        lp, logz = torch.cat(lps), torch.cat(logzs)  # [T], [T]
        logk = None if floors is None else torch.cat(logks)  # [T]
        ent = torch.cat(ents) if entropy else lp.new_zeros(0)  # [T] or [0]
        ctx.temperature = temperature
        ctx.rows = rows
        ctx.grad_into_weight = grad_into_weight
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.set_materialize_grads(False)  # an output nobody differentiates brings None, not zeros
        ctx.save_for_backward(hidden, weight, bias, targets, logz, ent, floors, logk)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, logz, ent, floors, logk = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        gh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        into_grad = ctx.needs_input_grad[1] and ctx.grad_into_weight
        gw = None
        if into_grad:
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            gw = weight.grad
        elif ctx.needs_input_grad[1]:
            gw = torch.zeros_like(weight, dtype=torch.float)
        # needs_input_grad is False for a bias of None
        gb = torch.zeros_like(bias, dtype=torch.float) if ctx.needs_input_grad[2] else None
        g_lp = torch.zeros_like(logz) if g_lp is None else g_lp.float()  # [T]
        # [T] the normaliser of each token's distribution: the full one's, or its kept set's
        norm = logz if floors is None else logk
        cast = weight.to(dtype if enabled else weight.dtype)  # [V, H] the products' dtype, once
        # the weight's gradient a product per span of chunks (each a pass over [V, H], under
        # autocast one more to add it), a span of several padded to whole chunks by zero rows: a
        # few shapes, each a kept oneDNN primitive
        chunks = HEAD_GRAD_CHUNKS.get(device, 1)
        span = ctx.rows * chunks
        whole = ctx.rows if chunks > 1 else 1
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for j in range(0, hidden.shape[0], span):
                hs = hidden[j : j + span].to(cast.dtype)  # [s, H]
                dzs = hs.new_empty(-(-len(hs) // whole) * whole, weight.shape[0])  # [s', V]
                dzs[len(hs) :].zero_()
                for i in range(0, len(hs), ctx.rows):
                    c = slice(j + i, j + i + ctx.rows)
                    z = HeadLogprobs.logits(hs[i : i + ctx.rows], cast, bias, ctx.temperature)
                    p = (z - norm[c, None]).exp_()  # [c, V]
                    if floors is not None:  # outside the kept set: no probability, no gradient
                        p = HeadLogprobs.keep_only(p, z, floors[c], logz[c], targets[c])
                    scale = g_lp[c, None]  # [c, 1]
                    if g_ent is not None:
                        # [c, V]
                        scale = scale + g_ent[c, None].float() * (z - (norm[c] - ent[c])[:, None])
                    dz = p.mul_(scale).neg_().scatter_add_(-1, targets[c, None], g_lp[c, None])
                    dz.div_(ctx.temperature)  # [c, V] float32
                    if gb is not None:
                        gb += dz.sum(0)  # [V]
                    dz = dzs[i : i + len(dz)].copy_(dz)  # [c, V]
                    if gh is not None:
                        gh[c] = (dz @ cast).to(gh.dtype)  # [c, H]
                # [V, H]: a bf16 product added; a float32 one accumulated in place
                if gw is not None:
                    hs = torch.nn.functional.pad(hs, (0, 0, 0, len(dzs) - len(hs)))  # [s', H]
                    gw.add_(dzs.T @ hs) if enabled else gw.addmm_(dzs.T, hs)
        gw = None if gw is None or into_grad else gw.to(weight.dtype)
        gb = None if gb is None else gb.to(bias.dtype)
        return gh, gw, gb, None, None, None, None, None, None
