"""One direction: the core (the top-level modules but the composition root, run.py and
components.py) never names extras/; extras/ imports the core; no import cycle among them, lazy
imports included; a default run imports no module of extras/ in any of its processes."""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from conftest import ROOT, run_py, tiny_args

ROOT_MODULES = ("run", "components")  # the composition root: it alone names extras/


def module_name(path: Path) -> str:
    """The dotted name of a module of the repository (`extras/lora.py` -> `extras.lora`)."""
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def modules() -> dict[str, Path]:
    """Every module of the core, the composition root and extras/, by dotted name."""
    paths = [*ROOT.glob("*.py"), *(ROOT / "extras").rglob("*.py")]
    return {module_name(p): p for p in sorted(paths)}


def core_modules() -> dict[str, Path]:
    """The core: the top-level modules but the composition root."""
    return {
        name: path
        for name, path in modules().items()
        if "." not in name and name not in ROOT_MODULES and name != "extras"
    }


def names_of_extras(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place in Python `source` that names extras/: an import of it (inside
    a function too), a string holding `extras.` or `extras/` (docstrings included), a comment
    that mentions extras."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "extras":
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if (node.module or "").split(".")[0] == "extras":
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.search(r"\bextras[./]", node.value):
                found.append((node.lineno, f"string {node.value[:60]!r}"))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and re.search(r"\bextras\b", tok.string):
            found.append((tok.start[0], f"comment {tok.string[:60]!r}"))
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its source (a function's
    lazy import included); `from extras import lora` imports extras.lora."""
    out = set()
    package = name.rpartition(".")[0] if path.name != "__init__.py" else name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module of `graph` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_names_of_extras_are_found_in_imports_strings_and_comments():
    source = (
        '"""Uses extras/lora.py."""\n'
        "def f():\n"
        "    from extras.lora import LoraTrainer  # a lazy import\n"
        "    import extras.vllm_engine\n"
        "    from extras import distill\n"
        '    return "extras.policy_losses.cispo_loss"  # see extras\n'
        "x = 'the core alone'  # nothing here\n"
    )
    lines = sorted(line for line, _ in names_of_extras(source))
    assert lines == [1, 3, 4, 5, 6, 6], names_of_extras(source)


def test_no_core_module_names_extras():
    core = core_modules()
    assert {"trainer", "explorer", "losses", "buffer", "workflows", "loop"} <= set(core)
    named = {
        f"{path.name}:{line}: {what}"
        for path in core.values()
        for line, what in names_of_extras(path.read_text())
    }
    assert not named, "\n".join(sorted(named))


def test_cycles_are_found_through_lazy_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from extras import lora\n    import trainer\n")
    known = {"extras.lora", "trainer", "extras"}
    assert imports_of("m", source, known) == {"extras", "extras.lora", "trainer"}


def test_no_import_cycle_among_the_core_the_root_and_extras():
    found = modules()
    known = set(found)
    graph = {name: imports_of(name, path, known) for name, path in found.items()}
    assert graph["extras.lora"] >= {"trainer"}  # extras/ imports the core
    assert "extras.lora" in graph["components"]  # the root names extras/
    assert cycles(graph) == []


def test_extras_never_imports_the_composition_root():
    found = modules()
    known = set(found)
    back = {
        name: imports_of(name, path, known) & set(ROOT_MODULES)
        for name, path in found.items()
        if name.startswith("extras")
    }
    assert not {k: v for k, v in back.items() if v}


def test_what_a_default_run_picks_on_one_gpu_is_the_cores():
    # on one GPU, --sync-method auto picks the weight sync by handle and the engine decodes with
    # CUDA graphs (--cuda-graphs is on by default): both live in the core, no GPU needed to ask
    code = (
        "import sys, components, config, launch\n"
        "cfg = config.Config(engine='hf')\n"
        "cfg.sync_method = components.sync_method(cfg, launch.place(1, 1, 'both'))\n"
        "assert components.transport(cfg).__module__ == 'ipc_sync', cfg.sync_method\n"
        "assert components.decode_graphs.__globals__['cuda_graphs'].__name__ == 'cuda_graphs'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'extras'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_default_run_imports_nothing_from_extras(tiny_model, tmp_path):
    # every process of the tiny preset in mode both (trainer and spawned explorer) reports its
    # imports on stderr (PYTHONPROFILEIMPORTTIME is inherited by the explorer process)
    out = run_py(
        *tiny_args(tiny_model, tmp_path / "run", "--steps", "2"),
        env={"PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| ( *)(\S+)$", out.stderr, re.M)
    names = [name for _, name in imported]
    # both processes import the engine module: the explorer's imports are in the report
    assert names.count("engines") >= 2, sorted(set(names))[:50]
    assert [n for n in names if n == "extras" or n.startswith("extras.")] == []
