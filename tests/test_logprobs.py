"""The explorer's behaviour logprobs equal the trainer's recomputation under equal weights."""

import pytest
import torch
import torch.distributed as dist

import run
from buffer import Experience
from conftest import PROMPTS, rollouts
from engines import HFEngine, Sampling
from packing import pack, response_logprobs
from trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """A Trainer needs the default process group: one rank, whichever test of this module runs first."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    cfg = run.parse_config(["--config", "configs/tiny.toml"])
    return cfg, Trainer(cfg, tiny_model, torch.device("cpu"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_explorer_logprobs_match_trainer(tiny_model, trainer, temperature):
    cfg, tr = trainer
    engine = HFEngine(tiny_model, max_batch=5, seed=0)
    exps = rollouts(engine, PROMPTS, 3, Sampling(max_tokens=12, temperature=temperature))
    assert len(exps) == 9 and any(len(e.behaviour_logprobs) > 1 for e in exps)
    b = pack(exps, tr.pad)
    with torch.no_grad():
        lp, _ = response_logprobs(tr.model, b, temperature)
    diff = ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item()
    assert diff < 1e-4, diff
    # and they are real log-probs of sampled tokens: not all zero, all <= 0
    assert (b["behaviour_logprobs"] * b["mask"]).min() < -0.1 and (
        b["behaviour_logprobs"] <= 0
    ).all()


def test_trainer_step_changes_parameters(trainer):
    cfg, tr = trainer
    before = [p.detach().clone() for p in tr.full_parameters()]
    exps = [
        Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    m = tr.step([exps])
    after = tr.full_parameters()
    assert tr.version == 1 and m["loss/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_the_final_save_frees_the_moments_and_writes_the_last_weights(trainer, tmp_path):
    # after the last update the AdamW moments are dead: the save's copies take their memory
    from safetensors.torch import load_file

    cfg, tr = trainer
    exps = [
        Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    tr.step([exps])
    assert tr.opt.state
    tr.save_final(tmp_path / "final")
    assert not tr.opt.state
    saved = load_file(tmp_path / "final" / "model.safetensors")
    named = dict(zip([n for n, _ in tr.named_trained_parameters()], tr.full_parameters()))
    assert len(set(saved) & set(named)) >= len(named) - 1  # (a tied head is saved once)
    for name in set(saved) & set(named):
        assert torch.equal(saved[name], named[name].to(saved[name].dtype))


def test_chat_jsonl_masks_exactly_the_assistant_turns(tiny_model, tmp_path):
    import json

    from transformers import AutoTokenizer

    from extras.offline import load_chat_jsonl

    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": msgs}) + "\n\n" + json.dumps({"messages": msgs[:1]}) + "\n"
    )
    with pytest.raises(ValueError, match="line 3: no assistant message"):
        load_chat_jsonl(path, tok)
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    ((e,),) = load_chat_jsonl(path, tok)
    resp = e.tokens[e.prompt_length :]
    trained = tok.decode([t for t, m in zip(resp, e.action_mask) if m])
    assert (
        trained == "4<|im_end|>6<|im_end|>"
    )  # what the model generates: not the template's newline after it
    assert "and 3+3?" in tok.decode([t for t, m in zip(resp, e.action_mask) if not m])
    full = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
    assert (
        e.tokens == full[:-1] and tok.decode(full[-1:]) == "\n"
    )  # the sequence ends with the last turn's end
    path.write_text('{"messages": "hi"}\n')
    with pytest.raises(ValueError, match="line 1: needs"):
        load_chat_jsonl(path, tok)


def test_chunked_logprobs_and_their_gradient_equal_the_unchunked_ones():
    # the chunked forward and its hand-written backward against the plain expression under autograd in
    # float64: each result within twice the float32 rounding error of the plain expression in float32
    from packing import chunked_logprobs, token_entropy

    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)  # [T, H]
    weight = torch.randn(50, 16, requires_grad=True)  # [V, H]
    targets = torch.randint(0, 50, (37,))
    g_lp, g_ent = torch.randn(37), torch.randn(37)  # an arbitrary upstream gradient
    results = {}
    for name in ("float64", "float32", "chunked"):  # chunked: 4 rows of logits at a time
        if name == "chunked":
            lp, ent = chunked_logprobs(
                hidden, weight, targets, 0.7, entropy=True, chunk_elems=50 * 4
            )
        else:
            dt = getattr(torch, name)
            logits = (hidden.to(dt) @ weight.to(dt).T) / 0.7  # [T, V]
            lp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
            ent = token_entropy(logits)
        gh, gw = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
        results[name] = [x.detach().double() for x in (lp, ent, gh, gw)]
    for exact, plain, chunked in zip(results["float64"], results["float32"], results["chunked"]):
        assert (chunked - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-6
    assert results["chunked"][2].abs().sum() > 0
    # only the log-probs differentiated (the entropy a metric): the gradient of the log-probs alone
    lp, _ = chunked_logprobs(hidden, weight, targets, 0.7, entropy=True, chunk_elems=50 * 4)
    logits = (hidden.double() @ weight.double().T) / 0.7
    exact = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    for a, b in zip(
        torch.autograd.grad((lp * g_lp).sum(), (hidden, weight)),
        torch.autograd.grad((exact * g_lp.double()).sum(), (hidden, weight)),
    ):
        assert torch.allclose(a, b, atol=1e-4) and b.abs().sum() > 0


def test_the_lm_heads_products_take_a_few_shapes_whatever_the_number_of_tokens(monkeypatch):
    # oneDNN keeps a primitive per shape of a matrix product for the whole run: a last chunk of
    # every size from 1 to the chunk's rows grew the trainer's memory step after step
    import packing

    rows_seen = set()
    logits = packing.HeadLogprobs.logits

    def seen(h, *rest):
        rows_seen.add(h.shape[0])
        return logits(h, *rest)

    monkeypatch.setattr(packing.HeadLogprobs, "logits", staticmethod(seen))
    weight = torch.randn(50, 16, requires_grad=True)  # [V, H]: 90 rows a chunk below
    spans_seen = set()  # the rows of each product of the weight's gradient, addmm_(gw, dz.T, h)

    def product(func, args, out):
        if func is torch.ops.aten.addmm_.default and out.shape == weight.shape:
            spans_seen.add(args[2].shape[0])
        return False

    for T in range(1, 200):
        hidden = torch.randn(T, 16, requires_grad=True)
        lp, ent = packing.chunked_logprobs(
            hidden, weight, torch.randint(0, 50, (T,)), 1.0, entropy=True, chunk_elems=50 * 90
        )
        with CountOps(product):
            (lp.sum() + ent.sum()).backward()
        assert lp.shape == ent.shape == (T,) and hidden.grad.shape == (T, 16)
    assert rows_seen == {16, 32, 48, 64, 80}
    assert spans_seen == {80, 160, 240}  # whole chunks


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops for which `counted(func, args, out)` holds."""

    def __init__(self, counted):
        super().__init__()
        self.counted, self.n = counted, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.n += bool(self.counted(func, args, out))
        return out


def test_the_lm_head_is_cast_once_per_pass_under_a_bf16_autocast_without_its_cache():
    # the trainer's autocast keeps no cache of bf16 weights: the head cast its weight again for every chunk
    from packing import chunked_logprobs

    hidden, weight = (
        torch.randn(37, 16, requires_grad=True),
        torch.randn(50, 16, requires_grad=True),
    )
    casts = CountOps(
        lambda func, args, out: (
            func is torch.ops.aten._to_copy.default
            and args[0].shape == weight.shape
            and out.dtype == torch.bfloat16
        )
    )
    with casts, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        lp, _ = chunked_logprobs(
            hidden, weight, torch.randint(0, 50, (37,)), 1.0, chunk_elems=50 * 4
        )  # 10 chunks
    assert casts.n == 1 and lp.isfinite().all()


def test_the_lm_heads_backward_casts_once_and_sums_the_weights_gradient_a_span_at_a_time(
    monkeypatch,
):
    # each [V, H] product of the weight's gradient is a pass over the whole head (under autocast
    # one more to add it): one per span of chunks, the same gradient as one per chunk
    import packing

    hidden = torch.randn(37, 16, requires_grad=True)  # 40 rows padded: 10 chunks of 4
    weight = torch.randn(50, 16, requires_grad=True)  # [V, H]
    targets = torch.randint(0, 50, (37,))
    grads = {}
    for chunks in (1, packing.HEAD_GRAD_CHUNKS["cpu"]):
        monkeypatch.setitem(packing.HEAD_GRAD_CHUNKS, "cpu", chunks)
        for autocast in (True, False):
            weight.grad = None
            casts = CountOps(
                lambda func, args, out: (
                    func is torch.ops.aten._to_copy.default
                    and args[0].shape == weight.shape
                    and out.dtype == torch.bfloat16
                )
            )
            products = CountOps(
                lambda func, args, out: (
                    func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default)
                    and out.shape == weight.shape
                )
            )
            # the trainer's autocast: no cache of cast weights, in the backward too
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast, cache_enabled=False):
                lp, _ = packing.chunked_logprobs(hidden, weight, targets, 1.0, chunk_elems=50 * 4)
                with casts, products:
                    lp.sum().backward()
            assert (casts.n, products.n) == (int(autocast), -(-10 // chunks)), (chunks, autocast)
            grads[chunks, autocast] = weight.grad.clone()
    span = packing.HEAD_GRAD_CHUNKS["cpu"]
    assert span > 1 and grads[1, False].abs().sum() > 0
    assert torch.allclose(grads[span, False], grads[1, False], rtol=1e-5, atol=1e-6)
    # bf16 products: rounded once per span instead of once per chunk
    assert torch.allclose(grads[span, True], grads[1, True], rtol=2e-2, atol=2e-2)


def test_the_trainers_bf16_passes_keep_no_cache_of_cast_weights(tiny_model):
    # with the blocks recomputed in the backward pass, bf16 copies cached by the forward are held for nothing
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--dtype", "bfloat16"])
    tr = Trainer(cfg, tiny_model, torch.device("cpu"))
    seen = []
    block = [m for m in tr.model.modules() if type(m).__name__ in tr.model._no_split_modules][-1]
    block.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_cache_enabled()))
    exps = [
        Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    tr.step([exps])
    assert tr.autocast and seen and not any(seen)


def test_a_tied_embeddings_gradient_is_added_into_the_heads_in_place(tiny_model):
    # autograd added the tied weight's two [V, H] gradients into a third tensor, and the embedding's was dense
    from transformers import AutoModelForCausalLM

    cfg = run.parse_config(["--config", "configs/tiny.toml", "--dtype", "float32"])
    tr = Trainer(cfg, tiny_model, torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    exps = [
        Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    b = pack(exps, 2)
    weight = tr.model.get_input_embeddings().weight
    for accumulated in (False, True):  # the second backward adds into the gradient of the first
        new = CountOps(
            lambda func, args, out: (
                isinstance(out, torch.Tensor)
                and out.shape == weight.shape
                and out.layout == torch.strided
                and not func._schema.is_mutable
            )
        )  # new dense [V, H]
        lp, _ = response_logprobs(tr.model, b, 0.8, head_grad_into_weight=tr.head_grad_into_weight)
        with new:
            (lp * b["mask"]).sum().backward()
        (response_logprobs(plain, b, 0.8)[0] * b["mask"]).sum().backward()
        assert new.n == (
            0 if accumulated else 1
        )  # the head's gradient, then nothing: no product, copy or sum
        assert not weight.grad.is_sparse and torch.allclose(
            weight.grad, plain.get_input_embeddings().weight.grad
        )
        assert all(
            torch.allclose(p.grad, q.grad, atol=1e-6)
            for p, q in zip(tr.model.parameters(), plain.parameters())
        )


@pytest.mark.parametrize("multiple, token_multiple", [(1, 1), (8, 8), (1, 32)])
def test_shared_prompt_packing_gives_each_sequences_own_logprobs_and_gradient(
    tiny_model, multiple, token_multiple
):
    # a group's rollouts share one row (the prompt once); log-probs and gradients equal those of each
    # sequence computed alone; a sequence with another prompt gets a row of its own; the dense layers see the
    # rows' tokens without pads (but up to a multiple: in pads' slots, or a row of pads where there are too few)
    from transformers import AutoModelForCausalLM

    from packing import packed_tokens

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    exps = [
        Experience([5, 6, 7, 8] + r, 4, [0.0] * len(r), [1] * len(r), 0.0, "g", "t", 0)
        for r in ([20, 21, 22], [23], [24, 25], [])
    ] + [Experience([9, 10] + [26, 27], 2, [0.0, 0.0], [1, 1], 0.0, "h", "t", 0)]
    b = pack(exps, 2, 0, multiple, token_multiple=token_multiple)
    T, N, L = {1: (14, 2, 10), 8: (16, 2, 16), 32: (32, 4, 10)}[
        token_multiple
    ]  # rows: 4 + 3 + 1 + 2 + 0; 2 + 2
    assert b["input_ids"].shape == (1, T) and b["token_slots"].unique().numel() == T
    assert b["attention_mask"].shape == (N, 1, L, L) and packed_tokens(exps) == 20 < 5 * (
        4 + 3
    )  # not B x (P + R)
    lp, _ = response_logprobs(model, b, 0.8)
    (lp * b["mask"]).sum().backward()
    plain = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="eager"
    )
    total = 0
    for i, e in enumerate(exps):  # each alone, as one ordinary sequence
        ids = torch.tensor([e.tokens])
        logits = plain(input_ids=ids).logits[0, e.prompt_length - 1 : -1] / 0.8  # [R, V]
        alone = logits.log_softmax(-1).gather(-1, ids[0, e.prompt_length :, None]).squeeze(-1)
        R = len(e.tokens) - e.prompt_length
        assert torch.allclose(lp[i, :R], alone, atol=1e-5), (i, lp[i, :R], alone)
        total = total + alone.sum()
    total.backward()
    diffs = [
        ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        for p, q in zip(model.parameters(), plain.parameters())
    ]
    assert max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("budget", [64, 4096])
def test_on_policy_the_ratio_is_one_in_the_trainers_own_layout(tiny_model, trainer, budget):
    # the step's real layout (token budget, row and token multiples, several groups and
    # micro-batches), not pack()'s defaults: on-policy nothing is clipped, the ratio is 1
    cfg = run.parse_config(["--config", "configs/tiny.toml", "--token-budget", str(budget)])
    fresh = Trainer(cfg, tiny_model, torch.device("cpu"))
    engine = HFEngine(tiny_model, max_batch=8, seed=1)
    exps = rollouts(engine, PROMPTS, 4, Sampling(max_tokens=16, temperature=cfg.temperature))
    for i, e in enumerate(exps):
        e.reward = float(i % 3 == 0)
    groups = [[e for e in exps if e.group_id == g] for g in ("0", "1", "2")]
    m = fresh.step(groups)
    assert m["loss/clipped"] == 0 and m["loss/log_ratio_clamped"] == 0
    assert m["loss/logprob_abs_diff"] < 1e-4, m["loss/logprob_abs_diff"]
    assert abs(m["loss/ratio_max"] - 1) < 1e-4 and abs(m["loss/ratio_min"] - 1) < 1e-4
    assert abs(m["loss/ratio_mean"] - 1) < 1e-4
    assert budget > 64 or m["train/micro_batches"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--lora-rank", "4"]], ids=["full", "lora"])
def test_a_strict_on_policy_run_clips_nothing_at_any_step(tiny_model, tmp_path, lora):
    # float32, sync_interval 1, offset 0: every batch is sampled with the weights the trainer
    # computes its log-probs with, so the ratio is 1 at every step (with LoRA: the adapters too)
    import json

    from conftest import run_py

    run_dir = tmp_path / "run"
    flags = ["--sync-interval", "1", "--sync-offset", "0", "--dtype", "float32", "--steps", "3"]
    res = run_py(
        *["--config", "configs/tiny.toml", "--model", tiny_model, "--run-dir", run_dir],
        *["--reward-fn", "tests.rewards.length_parity", "--eval-size", "0", *flags, *lora],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/clipped" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["loss/clipped"] == 0 and r["loss/logprob_abs_diff"] < 1e-4, r
        assert abs(r["loss/ratio_max"] - 1) < 1e-4 and abs(r["loss/ratio_min"] - 1) < 1e-4, r


@pytest.mark.parametrize("additive", [False, True], ids=["bool-mask", "additive-mask"])
def test_a_grouped_decode_step_attends_as_repeated_key_value_heads_do(additive):
    # transformers' repeat_kv pairs query head h with key-value head h // G; grouping the queries must too
    from packing import grouped_decode_attention

    torch.manual_seed(0)
    B, H, KV, L, D = 3, 6, 2, 7, 8
    query, key, value = torch.randn(B, H, 1, D), torch.randn(B, KV, L, D), torch.randn(B, KV, L, D)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    mask[0, :, :, :3] = False  # left padding of different lengths
    mask[1, :, :, :1] = False
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(H // KV, 1),
        value.repeat_interleave(H // KV, 1),
        attn_mask=mask,
    )  # [B, H, 1, D]
    out = grouped_decode_attention(query, key, value, mask, None)
    assert out.shape == (B, 1, H, D)
    torch.testing.assert_close(out, repeated.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_the_engine_decodes_with_grouped_queries_as_transformers_sdpa_does(tiny_model, tmp_path):
    # four query heads per key-value head, left-padded prompts: the same replies and behaviour log-probs as
    # transformers' own sdpa (repeat_kv), and no decode step hands sdpa a repeated cache
    from unittest import mock

    from conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "gqa3", heads=8, kv_heads=2)
    engine = HFEngine(str(path), max_batch=8, seed=0)
    sampling = Sampling(max_tokens=10, temperature=1.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    queries = []  # the shape [B, heads, rows, D] of every query sdpa saw

    def recording(query, *args, **kwargs):
        queries.append(tuple(query.shape))
        return sdpa(query, *args, **kwargs)

    engine.generator.manual_seed(0)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", recording):
        grouped = rollouts(engine, PROMPTS, 2, sampling)
    assert any(q[1:3] == (2, 4) for q in queries)  # decode steps: 2 key-value heads x 4 query rows
    assert not any(q[1] == 8 and q[2] == 1 for q in queries)  # no step over 8 (repeated) heads
    engine.model.set_attn_implementation("sdpa")
    engine.generator.manual_seed(0)
    repeated = rollouts(engine, PROMPTS, 2, sampling)
    assert [e.tokens for e in grouped] == [e.tokens for e in repeated]
    for a, b in zip(grouped, repeated):
        torch.testing.assert_close(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "temperature,drop_ended",
    [(0.0, 2.0), (1.0, 2.0), (0.0, 0.25)],
    ids=["greedy", "sampled", "dropping"],
)
def test_reading_which_rows_ended_every_few_steps_gives_the_same_replies(
    tiny_model, temperature, drop_ended
):
    # a GPU reads `done` back every few steps, not every step: rows that ended meanwhile only decode padding, and
    # ended rows leave the batch at those reads only (then greedy: a smaller batch draws fewer random numbers)
    sampling = Sampling(max_tokens=12, temperature=temperature)
    replies = []
    for check_every in (1, 4):
        engine = HFEngine(tiny_model, max_batch=8, seed=0, drop_ended=drop_ended)
        engine.check_every = check_every
        engine.eos = torch.tensor([t for t in range(engine.model.config.vocab_size) if t % 7 == 0])
        out = engine.generate_batch(PROMPTS, [3] * len(PROMPTS), sampling)
        replies.append([c for group in out for c in group])
    assert any(c.finish_reason == "stop" and len(c.tokens) < 12 for c in replies[0])
    same = [
        (x.tokens, x.finish_reason, x.behaviour_logprobs)
        == (y.tokens, y.finish_reason, y.behaviour_logprobs)
        for x, y in zip(*replies)
    ]
    # batches of other sizes may round a near tie the other way
    assert all(same) if drop_ended > 1 else sum(same) >= len(same) - 1


def test_causal_rows_build_no_mask_and_so_read_no_positions_on_the_host(trainer, monkeypatch):
    # without a mask transformers reads the position_ids on the host to look for packed
    # sequences: a host sync per micro-batch on a GPU. Causal rows are given an empty 4D mask,
    # which it passes on as it is; their log-probs are still the plain causal model's
    import transformers.masking_utils

    def host_read(position_ids):
        raise AssertionError("position_ids read on the host to look for packed sequences")

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", host_read)
    _, tr = trainer
    exps = [
        Experience([5, 6, 7 + i, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], 0.0, "g", "t", 0)
        for i in range(3)
    ]
    b = pack(exps, tr.pad, causal=True)
    assert b["attention_mask"] is None  # each row one sequence: causal up to its pads
    with torch.no_grad():
        lp, _ = response_logprobs(tr.model, b, 1.0)  # [B, R]
        for i, e in enumerate(exps):  # a plain forward of one sequence, no mask
            logits = tr.model(input_ids=torch.tensor([e.tokens])).logits[0, 2:4]  # [2, V]
            want = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor([[e.tokens[3]], [e.tokens[4]]])
            )
            assert torch.allclose(lp[i], want.squeeze(-1), atol=1e-5)
