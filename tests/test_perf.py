"""Model FLOPs, the measured peak and MFU (perf.py); prefill once per distinct prompt
(engines.HFEngine); evaluations after their version's last batch (run.explorer_loop);
the choice of the memory allocator (launch.allocator)."""

import json
import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import launch
import perf
import run
from buffer import Experience
from engines import Engine, HFEngine, Sampling
from trainer import Trainer


def test_flop_formulas_against_hand_computed_values():
    # 6 x (body x tokens + head x predicted): 6 x (10 x 7 + 3 x 4) = 492
    assert perf.train_flops(10, 3, tokens=7, predicted=4) == 492
    assert perf.train_flops(10, 3, tokens=7, predicted=4, passes=4) == 656  # + a reference forward
    # 2 x (body x prompt + (body + head) x sampled): 2 x (10 x 5 + 13 x 2) = 152
    assert perf.generate_flops(10, 3, prompt_tokens=5, sampled=2) == 152
    assert perf.mfu(1e9, 2.0, 1e9) == 0.5
    assert perf.mfu(1e9, 0.0, 1e9) == 0.0 and perf.mfu(1e9, 1.0, 0.0) == 0.0


def test_matmul_params_of_the_tiny_model(tiny_model):
    # 2 layers, hidden 64, 2 heads of 32 (q, o: 64 x 64), 1 KV head (k, v: 32 x 64), MLP 3 x 64 x 128; tied head
    vocab = json.load(open(f"{tiny_model}/config.json"))["vocab_size"]
    body = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128)
    assert perf.matmul_params(tiny_model) == (body, vocab * 64)


def test_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NANORFT_CACHE", str(tmp_path))
    peak = perf.peak_flops("cpu", "float32", 1)
    assert peak > 1e8  # any CPU that runs torch multiplies faster than 0.1 GFLOP/s
    cached = json.loads((tmp_path / "peak.json").read_text())
    assert list(cached.values()) == [peak]
    key = next(iter(cached))
    (tmp_path / "peak.json").write_text(json.dumps({key: 123.0}))
    assert perf.peak_flops("cpu", "float32", 1) == 123.0  # read back, not measured again
    assert perf.unit_peak("cpu", "float32") > 0
    # a cache that cannot be written (here a file where the directory should be) only means measuring again
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NANORFT_CACHE", str(tmp_path / "file" / "cache"))
    assert perf.peak_flops("cpu", "float32", 1) > 1e8


def test_each_distinct_prompt_is_prefilled_once(tiny_model):
    engine = HFEngine(tiny_model, max_batch=64, seed=0)
    rows = []
    engine.model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    prompts = [[5, 6, 7], [8, 9]]
    out = engine.generate_batch(prompts, [4, 3], Sampling(max_tokens=5))
    assert [len(o) for o in out] == [4, 3]
    assert rows[0] == (2, 3)  # the prefill: 2 distinct prompts, not 7 rollouts
    assert all(r[0] == 7 and r[1] == 1 for r in rows[1:])  # then every rollout decodes
    # the engine's prefilled tokens count each prompt once (and so its model FLOPs)
    from conftest import rollouts

    before = engine.prefilled_tokens
    exps = rollouts(engine, prompts, 3, Sampling(max_tokens=5))
    sampled = sum(len(e.behaviour_logprobs) for e in exps)
    assert engine.prefilled_tokens - before == 5
    meter = perf.ExplorerMeter(perf.matmul_params(tiny_model), "cpu", "float32")
    record = {"perf/explorer_prefilled_tokens": 5, "perf/explorer_sampled_tokens": sampled}
    flops = meter.measure({**record, "perf/explorer_busy_s": 1.0})["perf/explorer_model_flops"]
    assert flops == perf.generate_flops(*perf.matmul_params(tiny_model), 5, sampled)


def test_a_single_cpu_rank_trains_the_plain_model_and_reports_its_model_flops(tiny_model):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = run.parse_config(["--config", "configs/tiny.toml"])
    tr = Trainer(cfg, tiny_model, torch.device("cpu"))
    # one group: a 3-token prompt and 4 responses of 2 tokens: 3 + 8 tokens computed, 8 predicted
    exps = [
        Experience([5, 6, 7, 20 + i, 30 + i], 3, [-2.0, -2.0], [1, 1], float(i % 2), "g", "t", 0)
        for i in range(4)
    ]
    # one CPU rank keeps the plain model: FSDP2 would only copy weights into and out of its buffers
    from torch.distributed.tensor import DTensor

    assert not any(isinstance(p, DTensor) for p in tr.model.parameters())
    m = tr.step([exps])
    assert (m["train/packed_tokens"], m["train/predicted_tokens"]) == (11, 8)
    matmul = perf.matmul_params(tiny_model)
    m.update(perf.TrainerMeter(matmul, "cpu", cfg.dtype, passes=3).measure(m))
    body, head = perf.matmul_params(tiny_model)
    assert m["perf/trainer_model_flops"] == 6 * (body * 11 + head * 8)
    assert 0 < m["perf/trainer_mfu"] < 1


class Fake(Engine):
    """An engine for explore that generates nothing; `calls` records what explore asks."""

    def __init__(self):
        super().__init__()
        self.calls = []


def test_an_evaluation_runs_after_its_versions_last_batch(monkeypatch):
    engine = Fake()

    class Recorder:
        def __init__(self):
            self.engine = engine

        def resume(self, buffer):
            return 0

        def plan_batch(self, batch, buffer):
            engine.calls.append(("batch", batch, engine.version))
            return types.SimpleNamespace(tasks=[])

        def rollout(self, tasks):
            return []

        def write_batch(self, plan, groups, buffer):
            return {}

        def evaluate(self, version):
            engine.calls.append(("eval", version))
            return None

    cfg = run.parse_config(["--eval-interval", "2", "--sync-interval", "2"])

    class Pace:
        def join(self):
            pass

        def before_batch(self, batch):
            engine.version = 2 * (batch // 2)  # schedule.required_version with interval 2, offset 0
            return True

        def final(self):
            engine.version = 4

    run.explorer_loop(cfg, Recorder(), None, Pace(), lambda r: None, 4)
    # the trainer trains on batches 0 and 1 (2 and 3) while the explorer evaluates version 0 (2)
    assert engine.calls == [
        ("batch", 0, 0),
        ("batch", 1, 0),
        ("eval", 0),
        ("batch", 2, 2),
        ("batch", 3, 2),
        ("eval", 2),
        ("eval", 4),
    ]


def test_a_prefix_common_to_all_prompts_is_prefilled_once_and_logprobs_stay_exact(tiny_model):
    from buffer import Experience
    from packing import pack, response_logprobs

    engine = HFEngine(tiny_model, max_batch=64, seed=0)
    rows = []
    engine.model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    prompts = [
        [5, 6, 7, 8, 9, 20, 21],
        [5, 6, 7, 8, 9, 30],
        [5, 6, 7, 8, 9, 40, 41, 42],
    ]  # 5 tokens in common
    out = engine.generate_batch(prompts, [2, 2, 2], Sampling(max_tokens=6))
    assert rows[:2] == [
        (1, 5),
        (3, 3),
    ]  # the common prefix once, then each prompt's own tokens once
    exps = [
        Experience(
            p + c.tokens, len(p), c.behaviour_logprobs, [1] * len(c.tokens), 0.0, str(i), "t", 0
        )
        for i, (p, cs) in enumerate(zip(prompts, out))
        for c in cs
    ]
    b = pack(exps, engine.pad)
    with torch.no_grad():
        lp, _ = response_logprobs(engine.model, b, 1.0)  # each sequence computed from scratch
    assert ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max() < 1e-4
    assert (b["behaviour_logprobs"] * b["mask"]).min() < -0.1


def test_ended_rows_leave_the_decode_batch_with_the_same_tokens_and_exact_logprobs(tiny_model):
    # every decode step ran all rows until the longest sequence ended, ended ones as padding
    from packing import pack, response_logprobs

    reference = HFEngine(tiny_model, max_batch=64, seed=0, drop_ended=2.0)  # no row leaves
    engine = HFEngine(tiny_model, max_batch=64, seed=0)
    prompts = [[5, 6, 7, 8 + i] for i in range(8)]
    full = [
        c.tokens
        for cs in reference.generate_batch(prompts, [1] * 8, Sampling(max_tokens=10, temperature=0))
        for c in cs
    ]
    ends = {full[0][1], full[3][4], full[5][6]}  # sequences end at different steps
    reference.eos = engine.eos = torch.tensor(sorted(ends))
    kept = [
        c.tokens
        for cs in reference.generate_batch(prompts, [1] * 8, Sampling(max_tokens=10, temperature=0))
        for c in cs
    ]
    rows = []
    engine.model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    dropped = [
        c.tokens
        for cs in engine.generate_batch(prompts, [1] * 8, Sampling(max_tokens=10, temperature=0))
        for c in cs
    ]
    assert (
        dropped == kept and len({len(t) for t in kept}) > 1
    )  # greedy: the same tokens, ending at different steps
    assert kept == [
        next(t[: j + 1] for j, x in enumerate(t) if x in ends) if ends & set(t) else t for t in full
    ]
    assert rows[-1] < 8  # the last decode steps ran the rows still going only
    # sampled: the behaviour log-probs of each row are those of its own prompt and tokens
    engine.eos = torch.arange(
        0, engine.model.config.vocab_size, 8
    )  # about an eighth of the random model's mass
    out = engine.generate_batch(prompts, [3] * 8, Sampling(max_tokens=10))
    exps = [
        Experience(
            p + c.tokens, len(p), c.behaviour_logprobs, [1] * len(c.tokens), 0.0, str(i), "t", 0
        )
        for i, (p, cs) in enumerate(zip(prompts, out))
        for c in cs
    ]
    assert len({len(e.behaviour_logprobs) for e in exps}) > 1
    b = pack(exps, engine.pad)
    with torch.no_grad():
        lp, _ = response_logprobs(engine.model, b, 1.0)
    assert ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max() < 1e-4


def test_the_engines_grouped_query_attention_equals_transformers_sdpa(tiny_model):
    from transformers import AutoModelForCausalLM

    from packing import left_pad

    engine = HFEngine(tiny_model, seed=0)
    assert engine.model.config._attn_implementation == "nanorft_sdpa"
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    ids, attn, pos = left_pad(
        [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]], engine.pad
    )  # padding: a mask
    with torch.no_grad():
        a = engine.model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        b = ref(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    assert torch.allclose(a, b, atol=1e-5) and a.abs().max() > 0


def test_onednns_primitive_cache_is_capped_before_anything_runs_unless_the_user_set_it(
    monkeypatch, capsys
):
    # every packed length's primitives stayed in the trainer's memory for the whole run
    import run

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert run.main(["--max-staleness", "-2"]) == 2  # stopped at the flags: the cap set before
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert "max_staleness" in capsys.readouterr().err
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert run.main(["--max-staleness", "-2"]) == 2
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


def test_the_first_installed_allocator_is_chosen_and_a_missing_one_refused(monkeypatch):
    from config import parse_config

    monkeypatch.setattr(launch, "gpu_count", lambda: 0)
    found = {"mimalloc": "/x/libmimalloc.so", "tcmalloc": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(
        launch, "ALLOCATORS", {k: (lambda k=k: found.get(k)) for k in ("tcmalloc", "mimalloc")}
    )
    assert launch.allocator(parse_config([])) == ("tcmalloc", "libtcmalloc_minimal.so.4")
    assert launch.allocator(parse_config(["--allocator", "mimalloc"])) == (
        "mimalloc",
        "/x/libmimalloc.so",
    )
    assert launch.allocator(parse_config(["--allocator", "system"])) == ("system", None)
    monkeypatch.setattr(
        launch, "gpu_count", lambda: 1
    )  # auto keeps the C library's malloc on a GPU machine
    assert launch.allocator(parse_config([])) == ("system", None)
    assert launch.allocator(parse_config(["--allocator", "mimalloc"])) == (
        "mimalloc",
        "/x/libmimalloc.so",
    )
    monkeypatch.setattr(launch, "gpu_count", lambda: 0)
    del found["tcmalloc"]
    assert launch.allocator(parse_config([])) == ("mimalloc", "/x/libmimalloc.so")
    found.clear()  # none installed
    assert launch.allocator(parse_config([])) == ("system", None)
    assert "pip install cmeel-mimalloc" in launch.allocator_banner(parse_config([]))
    with pytest.raises(
        ValueError, match="--allocator mimalloc: not installed .pip install cmeel-mimalloc"
    ):
        launch.allocator(parse_config(["--allocator", "mimalloc"]))


def test_the_mimalloc_wheel_of_requirements_is_found():
    lib = launch.allocator_library("mimalloc")
    assert lib is not None and Path(lib).is_file() and "libmimalloc" in lib, lib


@pytest.mark.parametrize("given", [None, "1"])
def test_mimalloc_runs_without_transparent_huge_pages_unless_the_user_says(given):
    # mimalloc's huge pages, faulted in 2 MiB at a time, raised the trainer's peak RSS (benchmarks/allocators.py)
    import subprocess
    import sys

    env = {
        k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MIMALLOC_")
    }
    env |= {"MIMALLOC_ALLOW_THP": given} if given else {}
    code = (
        "import os, launch; launch.preload_allocator(['--allocator', 'mimalloc']); "
        "print(os.environ.get('LD_PRELOAD', ''), os.environ.get('MIMALLOC_ALLOW_THP'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(launch.__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "libmimalloc" in out[0] and out[1] == (given or "0")


def test_offline_training_takes_all_the_cores(monkeypatch):
    # SFT / DPO (mode train with --train-data) has no explorer beside it: it left half the cores idle
    from config import parse_config

    monkeypatch.setattr(launch.os, "cpu_count", lambda: 4)
    threads = {}
    for name, argv, world in [
        ("both", [], 1),
        ("async train", ["--mode", "train"], 1),
        ("explore", ["--mode", "explore"], 1),
        ("sft", ["--mode", "train", "--train-data", "x.jsonl"], 1),
        ("sft, 2 ranks", ["--mode", "train", "--train-data", "x.jsonl"], 2),
    ]:
        cfg = parse_config(argv)
        launch.split_threads(cfg, world)
        threads[name] = (cfg.trainer_threads, cfg.explorer_threads)
    assert threads["both"] == threads["async train"] == (2, 2) and threads["explore"][1] == 2
    assert threads["sft"][0] == 4 and threads["sft, 2 ranks"][0] == 2


def test_the_decode_cache_writes_each_step_into_reserved_room():
    # transformers' DynamicLayer copied the whole KV cache at every decode step (torch.cat)
    from engines import decode_cache

    torch.manual_seed(0)
    kv = [
        (torch.randn(2, 1, n, 4), torch.randn(2, 1, n, 4)) for n in (3, 1, 1, 2)
    ]  # [B, KV, tokens, D]
    cache = decode_cache()
    cache.update(*kv[0], 0)
    layer = cache.layers[0]
    layer.reserve(5)
    room = layer.keys.data_ptr()
    for i in (1, 2):  # within the reserved room: written in place
        keys, values = cache.update(*kv[i], 0)
        assert keys.data_ptr() == room
        assert torch.equal(keys, torch.cat([k for k, _ in kv[: i + 1]], 2))
        assert torch.equal(values, torch.cat([v for _, v in kv[: i + 1]], 2))
    keys, values = cache.update(*kv[3], 0)  # past the room: concatenated, still right
    assert torch.equal(keys, torch.cat([k for k, _ in kv], 2)) and cache.get_seq_length() == 7
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[0].values[0], torch.cat([v for _, v in kv], 2)[1])


def test_the_explorer_lends_its_threads_while_its_pace_waits():
    # the explorer marks itself idle while it waits for weights and busy while it generates
    import torch.multiprocessing as mp

    import perf

    flags = mp.get_context("spawn").Array("i", 2)
    seen = []

    class Pace:
        def join(self):
            pass

        def before_batch(self, batch):
            seen.append(("wait", flags[1]))
            return batch < 1

        def inflight(self):
            pass

        def final(self):
            seen.append(("final", flags[1]))

    pace = perf.LendingPace(Pace(), perf.CoreShare(flags, 1, 1, 1))
    assert pace.before_batch(0) and flags[1] == 1  # generating: busy
    assert not pace.before_batch(1)
    pace.final()
    assert seen == [("wait", 0), ("wait", 0), ("final", 0)] and flags[1] == 0


def allocator_script(allocator: str, script: str) -> str:
    """The stdout of `script` run by Python with `allocator` preloaded, its own returns of free
    pages off (mimalloc's after 10 minutes); skips where the allocator is not installed."""
    import subprocess
    import sys

    lib = launch.allocator_library(allocator)
    if lib is None:
        pytest.skip(
            f"needs {allocator} (tcmalloc: apt-get install libtcmalloc-minimal4; CI installs it)"
        )
    env = {**os.environ, **launch.ALLOCATOR_ENV.get(allocator, {}), "LD_PRELOAD": lib}
    env["MIMALLOC_PURGE_DELAY"] = "600000"
    env["TCMALLOC_RELEASE_RATE"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


SCRIPT_HEAD = """import sys, time
sys.path.insert(0, {root!r})
import torch, perf
from transformers import AutoModelForCausalLM
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
model = AutoModelForCausalLM.from_pretrained({model!r})
opt = torch.optim.AdamW(model.parameters())
if {returns}:
    perf.return_free_memory(model, opt)
"""


@pytest.mark.parametrize("returns", [False, True])
def test_under_mimalloc_the_trainer_returns_free_pages_before_its_steps_peaks(tiny_model, returns):
    # mimalloc keeps the pages of a freed tensor resident until its delay passes: with
    # return_free_memory the RSS has fallen back when the decoder's forward pass ends, when the
    # LM head's backward ends and when the optimiser is about to step (each read by a hook
    # registered after return_free_memory's); without it, at none of them
    from conftest import ROOT

    script = SCRIPT_HEAD.format(root=str(ROOT), model=tiny_model, returns=returns)
    script += """
def freed_then_read(at):  # a freed 512 MiB tensor, then the RSS fallen since it was freed
    def hook(*args):
        x = torch.ones(2**27)  # every page touched
        before = rss_mib()
        del x
        marks[at] = lambda: round(before - rss_mib())
    return hook
def read(at):
    return lambda *args: fallen.update({at: marks[at]()})
marks, fallen = {}, {}
decoder = model.get_decoder()
decoder.register_forward_pre_hook(freed_then_read("forward"))
def after_forward(module, args, output):
    read("forward")()
    freed_then_read("head")()
    output[0].register_hook(read("head"))
decoder.register_forward_hook(after_forward)
opt.register_step_pre_hook(read("step"))
model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
freed_then_read("step")()
opt.step()
print(fallen["forward"], fallen["head"], fallen["step"])
"""
    fallen_mib = [int(x) for x in allocator_script("mimalloc", script).split()[-3:]]
    if returns:
        assert min(fallen_mib) > 256, fallen_mib
    else:
        assert max(fallen_mib) < 256, fallen_mib


@pytest.mark.parametrize("returns", [False, True])
def test_under_tcmalloc_the_trainer_returns_free_pages_every_fifth_of_a_second(tiny_model, returns):
    # tcmalloc returns nothing by itself (its release rate 0 here): with return_free_memory a
    # thread returns the freed tensor's pages within a bounded wait; without it, nothing does
    from conftest import ROOT

    script = SCRIPT_HEAD.format(root=str(ROOT), model=tiny_model, returns=returns)
    script += f"""
x = torch.ones(2**27)  # 512 MiB, every page touched
before = rss_mib()
del x
deadline = time.monotonic() + (60 if {returns} else 2)
while rss_mib() > before - 256 and time.monotonic() < deadline:  # a condition, bounded
    time.sleep(0.05)
print(round(before - rss_mib()))
"""
    returned_mib = int(allocator_script("tcmalloc", script).split()[-1])
    if returns:
        assert returned_mib > 256
    else:
        assert returned_mib < 256


def test_a_resume_state_of_one_rank_makes_no_collectives(tiny_model, tmp_path, monkeypatch):
    # a large collective over gloo copies its data in a thread of gloo's, whose OpenMP team (a
    # thread more than the cores) leaves the trainer's threads sleeping instead of spinning
    # between parallel regions for the rest of the run: a lending trainer's step took 17% longer
    # after the first resume state of the default job (dcp's metadata, gathered as objects)
    from checkpoints import load_resume_state, save_resume_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(
        run.parse_config(["--config", "configs/tiny.toml"]), tiny_model, torch.device("cpu")
    )
    called = []
    for name in (
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
    ):
        collective = getattr(dist, name)
        monkeypatch.setattr(
            dist, name, lambda *a, name=name, f=collective, **k: called.append(name) or f(*a, **k)
        )
    load_resume_state(trainer, save_resume_state(trainer, tmp_path, 1))
    assert called == []


BF16_ONEDNN = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_packed_linear_layers_equal_f_linear_and_follow_in_place_weight_changes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128, dtype=torch.bfloat16),
        torch.nn.Linear(128, 32, bias=False, dtype=torch.bfloat16),
        torch.nn.Linear(32, 8),  # float32: left as it is
    )
    names = [n for n, _ in model.named_parameters()]
    layers = list(model)

    def reference(x):
        h = torch.nn.functional.linear(x, layers[0].weight, layers[0].bias)
        return torch.nn.functional.linear(h, layers[1].weight)

    packed = perf.pack_linear_weights(model)
    if not BF16_ONEDNN:  # this torch's oneDNN computes no bf16: nothing replaced
        assert packed == 0 and type(model[0]) is torch.nn.Linear
        return
    assert packed == 2
    assert [type(m) for m in model] == [perf.PackedLinear, perf.PackedLinear, torch.nn.Linear]
    assert [n for n, _ in model.named_parameters()] == names  # a weight sync's names and order
    with torch.no_grad():
        for shape in ((1, 64), (5, 64), (2, 3, 64)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            out = model[1](model[0](x))
            assert out.shape == (*shape[:-1], 32) and out.abs().max() > 0
            assert torch.equal(out, reference(x))
        # a weight sync writes in place (copy_): the next call multiplies by the new weights
        model[0].weight.copy_(torch.randn(128, 64, dtype=torch.bfloat16))
        model[1].weight.mul_(-1)
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        assert torch.equal(model[1](model[0](x)), reference(x))
        # another dtype than the weights': F.linear (here under autocast, as the engine runs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model[0](x.float())
        assert torch.equal(y, torch.nn.functional.linear(x, layers[0].weight, layers[0].bias))


@pytest.mark.skipif(not BF16_ONEDNN, reason="this torch's oneDNN computes no bf16 here")
def test_a_bf16_cpu_engine_samples_the_same_tokens_on_packed_weights_before_and_after_a_sync(
    tiny_model, tmp_path
):
    import components
    from config import Config
    from conftest import PROMPTS, rollouts

    cfg = Config(run_dir=str(tmp_path), dtype="bfloat16", engine="hf", explorer_threads=1)
    packed = components.make_engine(cfg, tiny_model, 0, "cpu")
    plain = HFEngine(tiny_model, **HFEngine.settings(cfg, 0, "cpu"))
    linears = [m for m in packed.model.modules() if isinstance(m, perf.PackedLinear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    # the head's weight stays the embedding's: a sync writes it once
    assert packed.model.lm_head.weight is packed.model.model.embed_tokens.weight
    sampling = Sampling(6, temperature=1.0)
    for new_weights in (None, tmp_path / "weights"):
        if new_weights is not None:  # as a sync or a checkpoint load writes them: copy_
            torch.manual_seed(1)
            with torch.no_grad():
                for p in plain.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            plain.model.save_pretrained(new_weights)
            packed.load_weights(new_weights)
        for engine in (packed, plain):
            engine.generator.manual_seed(7)
        a = [(e.tokens, e.behaviour_logprobs) for e in rollouts(packed, PROMPTS, 3, sampling)]
        b = [(e.tokens, e.behaviour_logprobs) for e in rollouts(plain, PROMPTS, 3, sampling)]
        assert a == b and len({tuple(t) for t, _ in a}) > 1


def test_the_trainer_compiles_its_blocks_where_it_pays_and_says_why_not():
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder

    def decide(device: str, *flags: str) -> tuple[bool, str]:
        return perf.compiles_layers(
            run.parse_config(["--config", "configs/tiny.toml", *flags]), device
        )

    assert decide("cuda", "--dtype", "float32") == (True, "CUDA")
    assert decide("cuda", "--no-compile-layers") == (False, "--no-compile-layers")
    assert decide("cpu", "--dtype", "float32", "--compile-layers") == (False, "float32 on a CPU")
    # a CPU compiles only when asked: the compiler's memory would break the default job's bound
    compiles, why = decide("cpu", "--dtype", "bfloat16")
    assert not compiles and why.startswith("a CPU: --compile-layers compiles them")
    # inductor's search for the compiler is cached: cleared before and after the missing one
    cpp_builder.cpp_compiler_search.cache_clear()
    with inductor_config.patch({"cpp.cxx": (None, "/no/such/g++")}):
        compiles, why = decide("cpu", "--dtype", "bfloat16", "--compile-layers")
    cpp_builder.cpp_compiler_search.cache_clear()
    assert not compiles and why.startswith("no C++ compiler for torch.compile") and "g++" in why
    try:
        found = bool(cpp_builder.get_cpp_compiler())
    except RuntimeError:
        found = False
    assert decide("cpu", "--dtype", "bfloat16", "--compile-layers")[0] is found


def test_a_bf16_cpu_trainer_compiles_its_blocks_once_for_every_length(tiny_model):
    # its decoder blocks ran eagerly: each bf16 cast, norm and activation a kernel and a pass over memory
    from torch._dynamo.utils import counters

    flags = ["--config", "configs/tiny.toml", "--dtype", "bfloat16"]
    compiles, why = perf.compiles_layers(run.parse_config(flags + ["--compile-layers"]), "cpu")
    if not compiles:
        pytest.skip(f"the blocks run eagerly here: {why}")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch._dynamo.reset()
    trainers = {
        setting: Trainer(run.parse_config(flags + [setting]), tiny_model, torch.device("cpu"))
        for setting in ("--compile-layers", "--no-compile-layers")
    }
    compiled, eager = trainers.values()
    # two steps of different packed lengths (128 and 256 tokens); the second step's loss and
    # gradient come from the weights the first step updated
    graphs = []
    for n in (23, 39):
        group = [
            Experience([5, 6, 7] + [40 + i] * n, 3, [-2.0] * n, [1] * n, i % 2, "g", "t", 0)
            for i in range(4)
        ]
        a = compiled.step([group])
        b = eager.step([group])
        graphs.append(counters["stats"]["unique_graphs"])
        assert a["train/computed_tokens"] == b["train/computed_tokens"]
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=2e-3)
        assert a["loss/grad_norm"] == pytest.approx(b["loss/grad_norm"], rel=0.05)
    # the first step compiled the blocks (the forward; its recomputation runs the same graph),
    # the second, of another length, compiled nothing more
    assert graphs[0] > 0 and graphs[1] == graphs[0]
    torch._dynamo.reset()
