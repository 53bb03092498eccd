"""Data pipelines (extras/pipelines.py): task operators, selectors (BOTS against numbers worked out
by following the reference's update rule), experience operators, prioritised replay in
both buffer backends, the pipelines from a config on the default job, and the human-label
round trip against a real Label Studio server."""

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

import run
from buffer import Experience
from conftest import ROOT, chat_endpoint, run_py, subprocess_env
from extras.experience_ops import clean, diversity_reward, quality_reward
from extras.label_studio import Annotator, LabelStudio
from extras.lagged_rewards import pending_groups, set_rewards_many
from extras.pipelines import (
    ExperienceContext,
    ExperiencePipeline,
    TaskContext,
    make_selector,
    replay,
    run_task_pipeline,
)
from extras.postgres import open_buffer
from extras.selectors import DiffBased, Easy2Hard, RandomTasks, Sequential
from workflows import Shuffle, Task


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def arithmetic(task_id, question, digits, terms):
    return Task(task_id, question, "0", {"metadata": {"num_digits": digits, "num_terms": terms}})


def group(tok, responses, rewards=None, version=0, group_id="g", prompt="What is 5 + 7?"):
    """A group of experiences whose responses decode to `responses`."""
    p = tok.encode(prompt)
    out = []
    for i, text in enumerate(responses):
        r = tok.encode(text, add_special_tokens=False)
        out.append(
            Experience(
                p + r,
                len(p),
                [-1.0] * len(r),
                [1] * len(r),
                None if rewards is None else rewards[i],
                group_id,
                f"task-{group_id}",
                version,
                {"question": prompt},
            )
        )
    return out


# ----------------------------------------------------------------------------- task curation


def test_task_pipeline_dedups_filters_by_length_and_scores_difficulty(tok):
    tasks = [
        arithmetic("a", "What is 1 + 2?", 1, 2),
        arithmetic("b", "what  is 1 + 2?", 1, 2),
        arithmetic("c", "What is 12 + 34 + 56?", 2, 3),
        arithmetic("d", "Add " + "1 + " * 60 + "1.", 1, 61),
    ]
    ctx = TaskContext(tok)
    out = run_task_pipeline(
        [
            {"op": "dedup"},
            {"op": "length_filter", "max_tokens": 30},
            {"op": "metadata_difficulty", "keys": ["num_digits", "num_terms"]},
        ],
        tasks,
        ctx,
    )
    assert [t.task_id for t in out] == ["a", "c"]
    assert [t.difficulty for t in out] == [3.0, 5.0]
    assert (
        ctx.metrics["pipeline/dedup/removed"] == 1
        and ctx.metrics["pipeline/length_filter/removed"] == 1
    )
    assert ctx.metrics["pipeline/metadata_difficulty/mean"] == 4.0


def test_a_plug_in_operator_scores_by_a_user_function(tok):
    tasks = [Task("long", "What is 100 + 200 + 300?", "600"), Task("short", "1 + 1?", "2")]
    out = run_task_pipeline([{"op": "tests.plugins.difficulty_by_length"}], tasks, TaskContext(tok))
    assert [t.task_id for t in out] == ["long", "short"] and [t.difficulty for t in out] == [
        24.0,
        6.0,
    ]
    assert Easy2Hard(out, 0).next(2) == [1, 0]


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            [{"op": "metadata_difficulty", "keys": ["num_carries"]}],
            r"task a has no numeric \['num_carries'\]",
        ),
        ([{"op": "nope"}], "unknown task_pipeline 'nope'"),
        ([{"op": "length_filter", "maxtokens": 3}], r"takes no argument\(s\) \['maxtokens'\]"),
        ([{"op": "length_filter", "max_tokens": 1}], "length_filter removed every task"),
        (["dedup"], "each entry needs op = NAME"),
    ],
)
def test_task_pipeline_errors_name_the_problem(tok, spec, message):
    with pytest.raises(ValueError, match=message):
        run_task_pipeline(spec, [arithmetic("a", "What is 1 + 2?", 1, 2)], TaskContext(tok))


# ----------------------------------------------------------------------------- selectors


def tasks_with(difficulties):
    return [Task(f"t{i}", f"q{i}", "0", difficulty=d) for i, d in enumerate(difficulties)]


def test_rule_based_selectors():
    tasks = tasks_with([2.0, 0.0, 1.0, 0.0])
    seq = Sequential(tasks, 0)
    assert seq.next(3) == [0, 1, 2] and seq.next(3) == [3, 0, 1]  # cycled
    assert Shuffle(tasks, 7).order == random.Random(7).sample(
        range(4), 4
    )  # the explorer's order before selectors
    assert Easy2Hard(tasks, 0).next(4) == [1, 3, 2, 0]  # ascending difficulty, ties in list order
    with pytest.raises(ValueError, match="easy2hard needs a difficulty"):
        Easy2Hard([Task("x", "q", "0")], 0)
    rnd = RandomTasks(tasks, 3)
    first = rnd.next(3)
    assert len(set(first)) == 3
    again = RandomTasks(tasks, 3)
    again.restore(json.loads(json.dumps(rnd.state())))
    assert again.next(3) == rnd.next(3)
    with pytest.raises(ValueError, match="unknown selector 'hardest'"):
        make_selector("hardest", {}, tasks, 0)
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['temperature'\]"):
        make_selector("diff_based", {"temperature": 1}, tasks, 0)


def test_diff_based_follows_the_bots_estimator():
    """Two updates of Trinity-RFT's InterpolationBetaPREstimator (diff_estimator.py @
    607f1dbd) worked out by hand: m 16, lamb 0.2, rho 0.2, anchors f0 = 0, f1 = prior pass
    rate [1, 0.5, 0] (difficulties 0, 1, 2).
    Update 1, tasks 0 and 1 come back with pass rates 0.75 and 0.5:
      cap = (mean pr - mean f0) / (mean f1 - mean f0 + 1e-6) = 0.625 / 0.750001
      p~ = [0.75, 0.5, 0 * cap]; s_bar = [12, 8, 0]; f_bar = [4, 8, 0]
      alpha = 0.8 * 1 + 0.2 + 0.8 * s_bar + 0.2 * 16 * p~ = [13.0, 9.0, 1.0]
      beta  = 0.8 * 1 + 0.2 + 0.8 * f_bar + 0.2 * 16 * (1 - p~) = [5.0, 9.0, 4.2]
      target 0.5, tau 0, no sampling: |0.5 - mean| = [0.222, 0, 0.308] -> tasks 1, 0
    Update 2, task 1 alone with pass rate 1:
      cap = 0.9 * cap + 0.1 * (1 / 0.500001) ~ 0.95; p~ = [0.95, 1 (observed), 0]
      alpha = 0.8 * [13, 9, 1] + 0.2 + 0.8 * [0, 16, 0] + 3.2 * p~ = [13.64, 23.4, 1.0]
      beta  = 0.8 * [5, 9, 4.2] + 0.2 + 0 + 3.2 * (1 - p~) = [4.36, 7.4, 6.76]
      |0.5 - mean| = [0.2578, 0.2597, 0.3711] -> task 0"""
    sel = DiffBased(tasks_with([0.0, 1.0, 2.0]), 0, target=0.5, tau=0.0, do_sample=False)
    assert sel.next(2) == [0, 1]  # before any feedback every task predicts 0.5 (stable order)
    sel.update({"t0": 0.75, "t1": 0.5})
    assert sel.cap == pytest.approx(0.625 / 0.750001)
    np.testing.assert_allclose(sel.alphas, [13.0, 9.0, 1.0])
    np.testing.assert_allclose(sel.betas, [5.0, 9.0, 4.2])
    assert sel.next(2) == [1, 0]
    sel.update({"t1": 1.0})
    assert sel.cap == pytest.approx(0.9 * 0.625 / 0.750001 + 0.1 / 0.500001)
    np.testing.assert_allclose(sel.alphas, [13.64, 23.4, 1.0], rtol=2e-4)
    np.testing.assert_allclose(sel.betas, [4.36, 7.4, 6.76], rtol=2e-4)
    assert sel.next(1) == [0]


def test_diff_based_sampling_resumes_exactly():
    sel = DiffBased(
        tasks_with([0.0, 1.0, 2.0, 3.0, 4.0]), 5, tau=0.5
    )  # softmax sampling of Beta draws
    sel.update({"t1": 0.5, "t3": 0.0})
    saved = json.loads(json.dumps(sel.state()))
    picks = [sel.next(2) for _ in range(4)]
    again = DiffBased(tasks_with([0.0, 1.0, 2.0, 3.0, 4.0]), 5, tau=0.5)
    again.restore(saved)
    assert [again.next(2) for _ in range(4)] == picks
    assert all(len(set(p)) == 2 for p in picks)  # without replacement


# ----------------------------------------------------------------------------- experience operators


def test_diversity_reward_rewards_the_least_typical_rollout(tok, tiny_model):
    groups = [
        group(tok, ["7", "7", "the answer is 42 because"], [1.0, 0.0, 0.0], group_id="g1"),
        group(tok, ["5", "5"], [0.0, 0.0], group_id="g2"),
    ]
    ctx = ExperienceContext(step=10, tokenizer=tok, model=tiny_model)
    diversity_reward(
        groups, ctx, weight=0.5, final_weight=0.3, decay_steps=20
    )  # weight 0.4 at step 10
    g1, g2 = groups
    # identical responses embed alike up to float32 rounding, which differs between CPUs (1e-7 on some)
    assert [e.info["shaping"]["diversity"] for e in g1] == pytest.approx([0.0, 0.0, 0.4], abs=1e-6)
    assert [e.reward for e in g1] == pytest.approx([1.0, 0.0, 0.4], abs=1e-6)
    assert [e.info["reward_raw"] for e in g1] == [1.0, 0.0, 0.0]
    assert [e.reward for e in g2] == [0.0, 0.0]  # identical responses: nothing to prefer
    assert ctx.metrics["pipeline/diversity_reward/weight"] == pytest.approx(0.4)
    assert ctx.metrics["pipeline/diversity_reward/bonus_mean"] == pytest.approx(0.4 / 5)


def test_clean_drops_long_repetitive_and_duplicate_rollouts(tok):
    g = group(
        tok, ["12", "12", "one two three four five six seven", "go go go go go go"], [1.0] * 4
    )
    ctx = ExperienceContext(tokenizer=tok)
    out = clean([g], ctx, max_tokens=6, ngram=2, max_repeat_frac=0.5, dedup=True)
    assert out == [[g[0]]]
    assert ctx.metrics == {
        "pipeline/clean/dropped_length": 1,
        "pipeline/clean/dropped_repetition": 1,
        "pipeline/clean/dropped_duplicate": 1,
    }


def test_quality_reward_scales_the_rating_to_plus_minus_half(tok, tiny_model):
    g = group(tok, ["12", "13"], [1.0, 0.0])
    ctx = ExperienceContext(tokenizer=tok)
    with chat_endpoint(
        lambda text: "4" if "Answer: 12" in text else "1"
    ) as url:  # an OpenAI-compatible rater
        quality_reward([g], ctx, url=url, model="rater", weight=2.0)
    assert [e.info["shaping"]["quality"] for e in g] == [2.0 * (4 - 3) / 4, 2.0 * (1 - 3) / 4]
    assert [e.reward for e in g] == [1.5, -1.0]
    assert ctx.metrics["pipeline/quality_reward/rating_mean"] == 2.5
    local = group(tok, ["12"], [0.0])  # a local judge model: its expected rating, within [1, 5]
    quality_reward([local], ExperienceContext(tokenizer=tok), model=tiny_model)
    assert -0.5 <= local[0].info["shaping"]["quality"] <= 0.5


def test_experience_pipeline_composes_and_refuses_an_empty_batch(tok, tiny_model):
    pipe = ExperiencePipeline(
        [{"op": "clean", "max_tokens": 2}, {"op": "diversity_reward", "weight": 1.0}],
        tokenizer=tok,
        model=tiny_model,
    )
    groups = [
        group(tok, ["1", "the answer is 42 because"], [1.0, 0.0], group_id="a"),
        group(tok, ["one two three four", "five six seven eight"], [0.0, 1.0], group_id="b"),
    ]
    out, m = pipe(groups, 0)
    assert [g[0].group_id for g in out] == ["a"] and len(out[0]) == 1  # b: every rollout too long
    assert m["pipeline/clean/groups_dropped"] == 1 and m["pipeline/reward_raw_mean"] == 1.0
    with pytest.raises(RuntimeError, match="clean dropped every group of step 3"):
        pipe([group(tok, ["one two three four"], [1.0])], 3)
    with pytest.raises(ValueError, match="unknown experience_pipeline 'novelty'"):
        ExperiencePipeline([{"op": "novelty"}])


# ----------------------------------------------------------------------------- replay


def test_replay_serves_by_priority_up_to_the_use_limit_and_resume_undoes_it(tok, buffer_url):
    buf = open_buffer(buffer_url)
    for v in range(3):
        buf.write(group(tok, ["1", "2"], [0.0, 1.0], version=v, group_id=f"v{v}"))
    assert [g[0].group_id for g in buf.read(3, step=0)] == ["v0", "v1", "v2"]
    assert replay(buf, step=0, groups=2) == ([], 0)  # consumed at this very step: not yet
    got, eligible = replay(buf, step=1, groups=1, decay=2.0, use_count_limit=3)
    assert eligible == 3 and [g[0].group_id for g in got] == ["v2"]  # priorities 2-2, 1-2, 0-2
    assert (got[0][0].info["use_count"], got[0][0].info["priority"]) == (1, 0.0)

    def uses():
        return dict(
            buf.db.execute(
                "SELECT group_id, MAX(use_count) FROM experiences GROUP BY group_id"
            ).fetchall()
        )

    before = uses()
    got, _ = replay(buf, step=2, groups=2, decay=2.0, use_count_limit=3)
    assert [g[0].group_id for g in got] == ["v1", "v2"]  # -1, then -2 (v2, newest) before -2 (v0)
    got, eligible = replay(buf, step=3, groups=3, decay=2.0, use_count_limit=3)
    assert eligible == 2 and [g[0].group_id for g in got] == [
        "v0",
        "v1",
    ]  # -2 before 1 - 2 * 2; v2 has used its 3
    assert replay(buf, step=4, groups=3, decay=2.0, use_count_limit=3)[0][0][0].group_id == "v0"
    assert buf.release_after(2) == 0  # nothing was first consumed at steps >= 2
    assert uses() == before  # the replays of steps 2.. are undone
    buf.release_after(0)
    assert uses() == {"v0": 0, "v1": 0, "v2": 0} and [
        g[0].group_id for g in buf.read(3, step=0)
    ] == ["v0", "v1", "v2"]
    buf.close()


def test_set_rewards_many_is_all_or_nothing(tok, buffer_url):
    buf = open_buffer(buffer_url)
    buf.write(group(tok, ["1", "2"], group_id="a"))
    buf.write(group(tok, ["3", "4"], group_id="b"))
    with pytest.raises(ValueError, match="group 'b' has 2 experiences, got 3 rewards"):
        set_rewards_many(buf, {"a": [1.0, 0.0], "b": [1.0, 0.0, 1.0]})
    assert pending_groups(buf) == ["a", "b"]  # a was not written either
    assert set_rewards_many(buf, {"a": [1.0, 0.0], "b": 0.5}) == 4
    assert [[e.reward for e in g] for g in buf.read(2)] == [[1.0, 0.0], [0.5, 0.5]]
    buf.close()


# ----------------------------------------------------------------------------- from a config


@pytest.mark.parametrize(
    "args,message",
    [
        (["--task-pipeline", '[{"op": "sort"}]'], "unknown task_pipeline 'sort'"),
        (
            ["--experience-pipeline", '[{"op": "diversity_reward", "wieght": 1}]'],
            r"takes no argument\(s\) \['wieght'\]",
        ),
        (["--selector", "easy2hard"], "selector easy2hard needs a difficulty"),
        (["--replay", '{"group": 2}'], r"replay: unknown key\(s\) \['group'\]"),
        (["--replay", '{"groups": 2, "use_count_limit": 1}'], "need groups >= 1"),
        (["--selector", "diff_based", "--pool-easy", "0.9"], "leave pool_easy / pool_hard unset"),
        (["--annotation", '{"url": "http://127.0.0.1:9"}'], "LABEL_STUDIO_API_KEY"),
        (["--task-pipeline", '{"op": "dedup"}'], "expected a list"),
    ],
)
def test_pipeline_settings_are_checked_before_anything_starts(args, message, capsys, monkeypatch):
    monkeypatch.delenv("LABEL_STUDIO_API_KEY", raising=False)
    assert run.main(["--run-dir", "/nonexistent/never-created", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("run.py: error:")
    assert __import__("re").search(message, err[0]), err[0]


def test_unreachable_label_studio_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "secret-token")
    assert run.main(["--annotation", '{"url": "http://127.0.0.1:9"}', "--reward-fn", "human"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Label Studio at http://127.0.0.1:9 cannot be reached" in err[0]
    assert "secret-token" not in err[0]


def test_a_failing_annotator_ends_the_trainers_wait_with_its_reason(tmp_path, monkeypatch):
    # the annotator thread died silently on any error but ConnectionError, and the trainer waited buffer_timeout_s
    # (30 min) for rewards that never came; now its error ends the wait for a batch at the next poll
    import threading

    from extras import label_studio
    from loop import StepLog

    class Broken:  # a Label Studio client whose replies the annotator's polls cannot use
        def __init__(self, url, token, timeout_s=30.0):
            self.url, self.calls = url, 0

        def project(self, title, label_config):
            return 1

        def tasks(self, project):
            self.calls += 1
            if (
                self.calls > 1
            ):  # (the first call is the annotator's start: the tasks sent before a restart)
                raise ValueError("unexpected reply from Label Studio")
            return []

    monkeypatch.setattr(label_studio, "LabelStudio", Broken)
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "token")
    cfg = run.parse_config(
        [
            "--run-dir",
            str(tmp_path),
            "--reward-fn",
            "human",
            "--annotation",
            '{"url": "http://127.0.0.1:9"}',
        ]
    )
    stop, before = threading.Event(), set(threading.enumerate())
    extra_metrics = label_studio.start_annotator(cfg, None, stop)
    for t in set(threading.enumerate()) - before:  # (it may have died already)
        if t.name == "annotator":
            t.join(60)
    loop = StepLog(cfg, 0, 1, 0)
    loop.connect(loop.records.explorers, extra_metrics)
    polls = []

    def waiting():
        polls.append(1)
        return loop.waiting()

    buf = open_buffer(tmp_path / "buffer.sqlite")
    try:
        with pytest.raises(
            RuntimeError, match="annotator failed: ValueError: unexpected reply from Label Studio"
        ):
            buf.read(cfg.batch_size, timeout_s=5, alive=waiting, poll_s=0.01)
        assert len(polls) == 1  # at the first poll, not after buffer_timeout_s
        with pytest.raises(RuntimeError, match="annotator failed"):  # and at the end of a step
            extra_metrics()
    finally:
        stop.set()
        loop.bar.close()
        buf.close()


@pytest.mark.slow
def test_pipelines_preset_runs_on_the_default_job(tiny_model, tmp_path):
    """configs/pipelines.toml on the default job (tiny model, small budget): tasks scored by
    their policy pass rate and served easy -> hard, cleaned and diversity-shaped
    experiences, replayed groups; every part reports its metrics."""
    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/pipelines.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--group-size",
        "4",
        "--max-tokens",
        "8",
        "--train-size",
        "12",
        "--eval-size",
        "0",
        "--dtype",
        "float32",
        "--engine",
        "hf",
        "--reward-fn",
        "tests.rewards.length_parity",
        "--task-pipeline",
        '[{"op": "dedup"}, {"op": "pass_rate_difficulty", "k": 2}]',
        "--log",
        "none",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    buf = open_buffer(run_dir / "buffer.sqlite")
    curated = json.loads(
        buf.run_state("tasks/explorer0")
    )  # [[task_id, difficulty]] kept for a resume
    assert {d for _, d in curated} <= {0.0, 0.5, 1.0} and len(curated) == 12
    order = [tid for tid, _ in sorted(curated, key=lambda x: x[1])]  # easy -> hard (stable)
    served = [
        r[0]
        for r in buf.db.execute(
            "SELECT task_id FROM experiences GROUP BY group_id ORDER BY MIN(id)"
        )
    ]
    assert served == order[: len(served)]
    steps = [
        json.loads(x)
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss/policy"' in x
    ]
    assert steps[0]["pipeline/pass_rate_difficulty/kept"] == 12
    assert all(
        "pipeline/diversity_reward/bonus_mean" in m and "pipeline/clean/dropped_duplicate" in m
        for m in steps
    )
    assert [m["replay/groups"] for m in steps] == [
        0,
        2,
        2,
    ]  # the preset's 2, once batch 0 was trained on
    shaped = [json.loads(r[0]) for r in buf.db.execute("SELECT info FROM experiences")]
    assert all(
        "reward_raw" not in i for i in shaped
    )  # shaping is applied on read: the buffer keeps raw rewards


# ----------------------------------------------------------------------------- human in the loop


def label_all(ls: LabelStudio, project: int, choose) -> int:
    """Act as the human: annotate every task of the project that has no annotation yet, with
    the label `choose(task data)`, through Label Studio's API. Returns how many."""
    n = 0
    for t in ls.tasks(project):
        if not t["annotations"]:
            name, to = ("preferred", "a") if "a" in t["data"] else ("reward", "response")
            ls.call(
                "POST",
                f"/api/tasks/{t['id']}/annotations/",
                {
                    "result": [
                        {
                            "from_name": name,
                            "to_name": to,
                            "type": "choices",
                            "value": {"choices": [choose(t["data"])]},
                        }
                    ]
                },
            )
            n += 1
    return n


def test_annotation_round_trip_with_label_studio(label_studio, tok, tmp_path):
    url, token = label_studio
    buf = open_buffer(tmp_path / "buffer.sqlite")
    buf.write(group(tok, ["12", "13", "14"], group_id="g1"))
    buf.write(group(tok, ["7", "8", "9"], group_id="g2"))
    ann = Annotator(
        buf,
        tok,
        url,
        token,
        str(tmp_path),
        project="round trip",
        timeout_s=3600,
        timeout_reward=-1.0,
    )
    m = ann.poll()
    assert m["annotation/sent"] == 2 and m["annotation/waiting"] == 2
    ls = LabelStudio(url, token)
    tasks = ls.tasks(ann.project)
    assert sorted((t["data"]["group_id"], t["data"]["response"]) for t in tasks)[:3] == [
        ("g1", "12"),
        ("g1", "13"),
        ("g1", "14"),
    ]
    # the human labels all of g1 and one rollout of g2
    for t in tasks:
        if t["data"]["group_id"] == "g1" or t["data"]["index"] == 0:
            ls.call(
                "POST",
                f"/api/tasks/{t['id']}/annotations/",
                {
                    "result": [
                        {
                            "from_name": "reward",
                            "to_name": "response",
                            "type": "choices",
                            "value": {
                                "choices": [
                                    "good" if t["data"]["response"] in ("12", "14", "7") else "bad"
                                ]
                            },
                        }
                    ]
                },
            )
    m = ann.poll()
    assert (m["annotation/labelled"], m["annotation/waiting"]) == (1, 1)
    assert pending_groups(buf) == ["g2"]  # g2 waits for its other labels
    assert [e.reward for e in buf.read(1)[0]] == [1.0, 0.0, 1.0]
    assert ann.poll()["annotation/sent"] == 2  # nothing sent twice
    ann.timeout_s = 0.0  # g2's time is up: its unlabelled rollouts get the timeout reward
    m = ann.poll()
    assert (m["annotation/timed_out"], m["annotation/waiting"]) == (1, 0)
    assert [e.reward for e in buf.read(1)[0]] == [1.0, -1.0, -1.0]
    # pairwise: the first two rollouts side by side; the preference becomes rewards and a DPO pair
    buf.write(group(tok, ["12", "21"], group_id="p1"))
    pair = Annotator(buf, tok, url, token, str(tmp_path), mode="pairwise", project="pairs")
    assert pair.poll()["annotation/sent"] == 1
    assert label_all(ls, pair.project, lambda d: "B" if d["b"] == "21" else "A") == 1
    pair.poll()
    assert [e.reward for e in buf.read(1)[0]] == [0.0, 1.0]
    assert json.loads((tmp_path / "preferences.jsonl").read_text()) == {
        "prompt": "What is 5 + 7?",
        "chosen": "21",
        "rejected": "12",
    }
    restarted = Annotator(buf, tok, url, token, str(tmp_path), project="round trip")
    assert set(restarted.sent) == {"g1", "g2"}  # a restarted annotator does not send them again
    buf.close()


def test_human_labels_train_the_default_job(label_studio, tiny_model, tmp_path, monkeypatch):
    """configs/human.toml on the default job: every rollout waits for a human label in Label
    Studio; this test is the human (it labels through the API while the run goes on); the
    labels come back as the rewards the trainer trains on."""
    url, token = label_studio
    run_dir = tmp_path / "human"
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", token)
    proc = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "--config",
            "configs/human.toml",
            "--model",
            tiny_model,
            "--run-dir",
            str(run_dir),
            "--annotation",
            json.dumps({"url": url, "timeout_s": 600}),
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--group-size",
            "3",
            "--max-tokens",
            "6",
            "--train-size",
            "20",
            "--dtype",
            "float32",
            "--engine",
            "hf",
            "--log",
            "none",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ls, project, labelled = LabelStudio(url, token), None, 0
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        projects = [
            p
            for p in ls.call("GET", "/api/projects?page_size=1000")["results"]
            if p["title"] == "nanorft human"
        ]
        if projects:
            project = projects[0]["id"]
            labelled += label_all(
                ls, project, lambda d: "good" if len(d["response"]) % 2 == 0 else "bad"
            )
        time.sleep(0.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert labelled >= 2 * 2 * 3  # two batches of two groups of three rollouts
    buf = open_buffer(run_dir / "buffer.sqlite")
    rows = buf.db.execute("SELECT reward, info FROM experiences WHERE consumed > 0").fetchall()
    assert len(rows) == 2 * 2 * 3
    assert all(r == float(len(json.loads(i)["response"].strip()) % 2 == 0) for r, i in rows)
    steps = [
        json.loads(x)
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss/policy"' in x
    ]
    assert steps[-1]["annotation/labelled"] >= 2 and steps[-1]["annotation/timed_out"] == 0


def test_the_experience_pipeline_runs_without_lent_cores(tiny_model, tmp_path):
    # the experience pipeline (the step's shaping) ran only inside `if io.cores is not None`:
    # with several trainer ranks or a GPU explorer (no lent cores) it was skipped without a word
    import torch.distributed as dist

    from conftest import close_io, trainer_in_this_process

    group = [
        Experience([1, 2, 3, 4 + i], 2, [-0.5] * 2, [1, 1], float(i % 2), "g0", "t0", 0, {}, "w")
        for i in range(2)
    ]
    cfg, trainer, io = trainer_in_this_process(tiny_model, tmp_path / "run", [group], steps=1)
    shaped = []
    io.reader.shape = lambda groups, step: (
        shaped.append(step) or groups,
        {"pipeline/ran": 1.0},
    )
    assert io.reader.explorers.cores is None
    try:
        run.rl_loop(cfg, trainer, io.reader, io.publisher, io.log, 0)
    finally:
        close_io(io)
        dist.destroy_process_group()
    assert shaped == [0]
    first = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(first)["pipeline/ran"] == 1.0


def test_the_help_of_each_registry_flag_names_every_registered_name(capsys):
    # the names are written into the settings' docstrings, so that --help imports no extra: a
    # name added to a registry and not to its help text fails here
    import components
    import losses
    from extras.pipelines import EXPERIENCE_OPS, SELECTORS, TASK_OPS

    with pytest.raises(SystemExit):
        run.parse_config(["--help"])
    flat = " ".join(capsys.readouterr().out.replace("│", " ").split())

    def help_of(flag: str) -> str:
        start = flat.index(f"--{flag} ")
        return flat[start : flat.index("(default:", start)]

    for flag, registry in (
        ("task-pipeline", TASK_OPS),
        ("selector", SELECTORS),
        ("experience-pipeline", EXPERIENCE_OPS),
        ("advantage", components.advantages()),
        ("policy-loss", components.policy_losses()),
        ("loss-agg", losses.AGGREGATIONS),
        ("kl-estimator", losses.KL_ESTIMATORS),
        ("filters", components.filters()),
    ):
        missing = [name for name in registry if name not in help_of(flag)]
        assert not missing, f"--{flag} help lacks {missing}"
