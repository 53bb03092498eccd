"""How large is nanorft to read? Lines of each module of the core (the top-level modules)
and of extras/, split into code, docstrings, comments and blank lines, against the
guards of the layout against regrowth (docs/internals.md), counted as `ruff format` leaves
the code: core (the composition root included) at most 7,545 lines, no module over 600, README at most 200.

    python benchmarks/layout.py            # the table; exit code 1 when a limit is exceeded
    python benchmarks/layout.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"core": 7545, "module": 600, "README.md": 200}


def line_kinds(source: str) -> dict[str, int]:
    """Lines of Python `source` by kind: docstring (module, class and function docstrings),
    comment (lines holding only a comment), blank, code (the rest); the four add up to the
    number of lines. Raises SyntaxError for source that does not parse."""
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc.update(range(first.lineno, first.end_lineno + 1))
    comment = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip()
    }
    blank = {i for i, x in enumerate(lines, 1) if not x.strip()}
    counts = {"docstring": len(doc), "comment": len(comment - doc), "blank": len(blank - doc)}
    counts["code"] = len(lines) - sum(counts.values())
    return {"lines": len(lines), **counts}


def measure(root: Path = ROOT) -> dict:
    """Per file of the core (root/*.py) and of root/extras: its line_kinds; the totals;
    README.md's lines; and `over`: each limit of LIMITS that is exceeded, with its value."""
    core = {p.name: line_kinds(p.read_text()) for p in sorted(root.glob("*.py"))}
    extras = {
        f"extras/{p.relative_to(root / 'extras')}": line_kinds(p.read_text())
        for p in sorted((root / "extras").rglob("*.py"))
    }
    readme = root / "README.md"
    totals = {
        "core": sum(c["lines"] for c in core.values()),
        "extras": sum(c["lines"] for c in extras.values()),
    }
    values = {
        "core": totals["core"],
        "core+extras": totals["core"] + totals["extras"],
        "run.py": core.get("run.py", {"lines": 0})["lines"],
        "README.md": len(readme.read_text().splitlines()) if readme.is_file() else 0,
    }
    over = {k: v for k, v in values.items() if k in LIMITS and v > LIMITS[k]}
    over.update({name: c["lines"] for name, c in core.items() if c["lines"] > LIMITS["module"]})
    return {
        "files": {"core": core, "extras": extras},
        **totals,
        **{k: v for k, v in values.items() if k not in totals},
        "over": over,
    }


def table(m: dict) -> str:
    """`measure`'s result as a plain-text table, the limits and what exceeds them last."""
    rows = [f"{'file':<34} {'lines':>6} {'code':>6} {'doc':>6} {'comment':>8} {'blank':>6}"]
    for part in ("core", "extras"):
        for name, c in m["files"][part].items():
            over = part == "core" and c["lines"] > LIMITS["module"]
            flag = f"  > {LIMITS['module']}" if over else ""
            rows.append(
                f"{name:<34} {c['lines']:>6} {c['code']:>6} {c['docstring']:>6} {c['comment']:>8} "
                f"{c['blank']:>6}{flag}"
            )
        rows.append(f"{part + ' total':<34} {m[part]:>6}")
    rows.append(f"{'core + extras':<34} {m['core+extras']:>6}")
    rows.append(f"{'README.md':<34} {m['README.md']:>6}")
    rows.append("limits: " + ", ".join(f"{k} <= {v}" for k, v in LIMITS.items()))
    rows.append("exceeded: " + (", ".join(f"{k} {v}" for k, v in m["over"].items()) or "none"))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    p.add_argument("--root", default=str(ROOT), help="the checkout to measure (default: this one)")
    args = p.parse_args(argv)
    m = measure(Path(args.root))
    print(json.dumps(m, indent=2) if args.json else table(m))
    return 1 if m["over"] else 0


if __name__ == "__main__":
    sys.exit(main())
