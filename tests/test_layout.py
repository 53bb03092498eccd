"""benchmarks/layout.py counts what the layout's limits are about (docs/internals.md)."""

import importlib.util
import textwrap
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "layout", Path(__file__).parent.parent / "benchmarks" / "layout.py"
)
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)


def test_lines_are_counted_by_kind():
    src = textwrap.dedent('''\
        """Module docstring,
        two lines."""

        # a comment line
        def f(x):
            """One line."""
            return x  # a trailing comment is code


        class C:
            """Class
            docstring."""
            y = "not a docstring"
        ''')
    assert layout.line_kinds(src) == {
        "lines": 13,
        "docstring": 5,
        "comment": 1,
        "blank": 3,
        "code": 4,
    }


def test_limits_name_what_exceeds_them(tmp_path):
    (tmp_path / "extras").mkdir()
    (tmp_path / "run.py").write_text("x = 1\n" * 601)
    (tmp_path / "small.py").write_text("x = 1\n" * 10)
    (tmp_path / "extras" / "a.py").write_text("x = 1\n" * 5)
    (tmp_path / "README.md").write_text("line\n" * 200)
    m = layout.measure(tmp_path)
    assert (m["core"], m["extras"], m["core+extras"], m["README.md"]) == (611, 5, 616, 200)
    assert m["over"] == {"run.py": 601}
    assert layout.main(["--root", str(tmp_path)]) == 1
    (tmp_path / "run.py").write_text("x = 1\n" * 600)
    assert layout.main(["--root", str(tmp_path)]) == 0


def test_the_repository_keeps_within_the_guards_of_its_layout():
    # against regrowth: the core, each module and the README as this checkout holds them
    # (formatted: CI runs ruff format --check)
    assert layout.measure()["over"] == {}


def calls_between(outer, inner, run) -> list[int]:
    """Run `run()` under sys.setprofile; for each call of the function `inner`, how many calls
    lie between it and the nearest enclosing call of `outer` (a direct call: 1). Every frame
    counts, a library's included."""
    import sys

    depths = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code is not inner.__code__:
            return
        hops, f = 0, frame
        while f is not None and f.f_code is not outer.__code__:
            hops, f = hops + 1, f.f_back
        depths.append(hops if f is not None else -1)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return depths


def test_the_policy_loss_is_three_calls_below_the_rl_loop(tiny_model, tmp_path):
    # a reader follows run.rl_loop -> Trainer.step -> Trainer.forward_backward -> the loss
    import torch.distributed as dist

    import run
    from buffer import Experience
    from conftest import close_io, trainer_in_this_process
    from losses import ppo_clip_loss

    groups = [
        [
            Experience([1, 2, 3, 4 + i], 2, [-0.5] * 2, [1, 1], float(i), f"g{s}", "t", 0, {}, "w")
            for i in range(2)
        ]
        for s in range(2)
    ]
    cfg, trainer, io = trainer_in_this_process(tiny_model, tmp_path / "run", groups, steps=2)
    try:
        depths = calls_between(
            run.rl_loop,
            ppo_clip_loss,
            lambda: run.rl_loop(cfg, trainer, io.reader, io.publisher, io.log, 0),
        )
    finally:
        close_io(io)
        dist.destroy_process_group()
    assert depths and all(0 < d <= 3 for d in depths), depths


def test_sampling_is_at_most_four_calls_below_the_explorer_loop(tiny_model, tmp_path):
    # a reader follows run.explorer_loop -> Explorer.rollout (the rollout loop) ->
    # HFEngine.generate_batch -> sample_token for the first token of a reply; the next ones are
    # sampled in the decode step (engines.Decoding), which a CUDA graph holds whole
    import run
    from conftest import tiny_explorer
    from engines import HFEngine, sample_token

    class Written:
        def __init__(self):
            self.groups = []

        def write_batch(self, groups, explorer=None, state=None, pools=()):
            self.groups.append(groups)

        def retired(self):
            return {}

        def hold(self, name):
            pass

        def explorer_state(self, name):
            return None

    class Pace:
        inflight = None

        def before_batch(self, batch):
            return True

        def final(self):
            pass

    explorer, _ = tiny_explorer(HFEngine(tiny_model, seed=1), tmp_path, 4, batch_size=2)
    written = Written()
    depths = calls_between(
        run.explorer_loop,
        sample_token,
        lambda: run.explorer_loop(explorer.cfg, explorer, written, Pace(), lambda r: None, 1),
    )
    assert [len(g) for g in written.groups[0]] == [2, 2]
    assert set(depths) == {3, 4}, depths
