"""The explorer's behaviour logprobs equal the trainer's recomputation under equal weights."""
import pytest
import torch
import torch.distributed as dist

import run
from buffer import Experience
from conftest import PROMPTS, rollouts
from explorer import HFEngine, Sampling
from trainer import Trainer, pack, response_logprobs


@pytest.fixture(scope="module")
def trainer(tiny_model):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = run.parse_config(["--config", "configs/tiny.toml"])
    return cfg, Trainer(cfg, tiny_model, torch.device("cpu"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_explorer_logprobs_match_trainer(tiny_model, trainer, temperature):
    cfg, tr = trainer
    engine = HFEngine(tiny_model, max_batch=5, seed=0)
    exps = rollouts(engine, PROMPTS, 3, Sampling(max_tokens=12, temperature=temperature))
    assert len(exps) == 9 and any(len(e.logprobs) > 1 for e in exps)
    b = pack(exps, tr.pad)
    with torch.no_grad():
        lp, _ = response_logprobs(tr.model, b, temperature)
    diff = ((lp - b["old_logprobs"]).abs() * b["mask"]).max().item()
    assert diff < 1e-4, diff
    # and they are real log-probs of sampled tokens: not all zero, all <= 0
    assert (b["old_logprobs"] * b["mask"]).min() < -0.1 and (b["old_logprobs"] <= 0).all()


def test_trainer_step_changes_parameters(trainer):
    cfg, tr = trainer
    before = [p.detach().clone() for p in tr.full_parameters()]
    exps = [Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
            for i in range(4)]
    m = tr.step([exps])
    after = tr.full_parameters()
    assert tr.version == 1 and m["loss/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_chat_jsonl_masks_exactly_the_assistant_turns(tiny_model, tmp_path):
    import json

    from transformers import AutoTokenizer

    from workflows import load_chat_jsonl

    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": msgs}) + "\n\n" + json.dumps({"messages": msgs[:1]}) + "\n")
    with pytest.raises(ValueError, match="line 3: no assistant message"):
        load_chat_jsonl(path, tok)
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    ((e,),) = load_chat_jsonl(path, tok)
    resp = e.tokens[e.prompt_length:]
    trained = tok.decode([t for t, m in zip(resp, e.action_mask) if m])
    assert trained.replace("<|im_end|>", "").split() == ["4", "6"]
    assert "and 3+3?" in tok.decode([t for t, m in zip(resp, e.action_mask) if not m])
    assert e.tokens == list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))
    path.write_text('{"messages": "hi"}\n')
    with pytest.raises(ValueError, match="line 1: needs"):
        load_chat_jsonl(path, tok)
