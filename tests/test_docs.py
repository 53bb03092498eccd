"""The documentation holds: every relative link in README.md and docs/*.md names a file that
exists, and every `#anchor` names a heading of its target (GitHub's slugs); the README stays a
front door of at most 200 lines, and its forking example runs."""

import importlib.util
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)  # fenced code blocks
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)  # inline code
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, punctuation dropped
    (letters, digits, underscores, hyphens and spaces stay), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"[`*]|<[^>]+>", "", text)  # code marks, emphasis, HTML tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, text in HEADING.findall(FENCE.sub("", page.read_text())):
        s = slug(text)
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def relative_links(page: Path) -> list[str]:
    return [
        t
        for t in LINK.findall(prose(page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)
    ]  # http:, https:, mailto: are not checked


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` whose file is missing or whose anchor is no heading there."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '{anchor}' in {shown(dest)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(page):
    broken = broken_links(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_check_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page: `its` title\n\n## Two words, one comma\n## Two words, one comma\n"
    )
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#a-page-its-title) [ok](docs/a.md#two-words-one-comma-1) [ok](#top)\n"
        "[gone](docs/b.md) [bad](docs/a.md#two-words) [bad](#nowhere) [web](https://x.org/#y)\n"
        "`[code](docs/c.md)`\n\n```\n[code](docs/d.md)\n# not a heading\n```\n# Top\n"
    )
    assert broken_links(page) == [
        "docs/b.md: no such file",
        f"docs/a.md#two-words: no heading 'two-words' in {tmp_path / 'docs' / 'a.md'}",
        f"#nowhere: no heading 'nowhere' in {page}",
    ]


def test_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; results belong in docs/results.md"


def test_readme_forking_example_runs(tmp_path):
    """The README's reward plug-in, saved as the module its command names, imports and scores a
    right and a wrong reply; the command's --reward-kwargs fit its signature."""
    readme = (ROOT / "README.md").read_text()
    module, name = re.search(r"--reward-fn (\w+)\.(\w+)", readme).groups()
    kwargs = json.loads(re.search(r"--reward-kwargs '([^']*)'", readme).group(1))
    path = tmp_path / f"{module}.py"
    path.write_text(re.search(r"```python\n(.*?)```", readme, re.S).group(1))
    spec = importlib.util.spec_from_file_location(module, path)
    spec.loader.exec_module(mod := importlib.util.module_from_spec(spec))
    from workflows import Task

    reward, task = getattr(mod, name), Task("t/0", "What is 2 + 3?", "5")
    inspect.signature(reward).bind(task, "5", None, **kwargs)
    assert reward(task, "2 + 3 = 5", None, **kwargs) == 1.0
    assert reward(task, "2 + 3 = 7", None, **kwargs) == 0.0


def test_every_test_the_correctness_map_names_exists():
    # docs/correctness.md is the map from a bug class to its test: a renamed test breaks it
    import re

    text = (ROOT / "docs" / "correctness.md").read_text()
    named = re.findall(r"(tests/\w+\.py)(?:::(\w+))?", text)
    assert len(named) > 15
    for path, name in named:
        assert (ROOT / path).is_file(), path
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name}"


@pytest.mark.slow
def test_the_fork_page_runs_as_written(tiny_model, tmp_path):
    # docs/fork.md: its file, saved as my_rl.py, and its command's flags train a tiny model
    from safetensors.torch import load_file

    from conftest import run_py

    page = (ROOT / "docs" / "fork.md").read_text()
    (tmp_path / "my_rl.py").write_text(re.search(r"```python\n(.*?)```", page, re.S).group(1))
    flags = re.search(r"```bash\npython run.py (.*?)\n```", page, re.S).group(1).split()
    run_dir = tmp_path / "run"
    args = ["--config", "configs/tiny.toml", "--model", tiny_model, "--run-dir", run_dir]
    args += ["--reward-fn", "tests.rewards.length_parity"]  # rewards that differ in a group
    res = run_py(*args, "--steps", "2", *flags, env={"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss/policy" in r]
    assert len(steps) == 2 and all(r["loss/off_policy"] == 0.0 for r in steps)
    before = load_file(f"{tiny_model}/model.safetensors")
    after = load_file(run_dir / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_label_studio_is_installed_with_the_same_pins_everywhere():
    """CI, the data-pipelines page and the fixture's skip line install Label Studio the same
    way, every package at a bounded version: an unpinned install took a sentry-sdk 3 that
    label-studio 1.23.2 cannot start with."""
    install = re.compile(r"bin/pip\"? install (?:-q )?([^;\n)]+)")
    sources = [
        ROOT / ".ci" / "run",
        ROOT / "docs" / "pipelines.md",
        ROOT / "tests" / "conftest.py",
    ]
    found = {}
    for path in sources:
        lines = install.findall(path.read_text())
        assert len(lines) == 1, f"{shown(path)}: {len(lines)} Label Studio installs"
        found[shown(path)] = sorted(lines[0].replace("'", "").split())
    assert len({tuple(v) for v in found.values()}) == 1, found
    for requirement in next(iter(found.values())):
        assert re.search(r"[=<>]", requirement), f"{requirement} is not pinned: {found}"
    assert "-c .ci/constraints.txt" in (ROOT / ".ci" / "run").read_text()
