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
    (tmp_path / "run.py").write_text("x = 1\n" * 251)
    (tmp_path / "small.py").write_text("x = 1\n" * 10)
    (tmp_path / "extras" / "a.py").write_text("x = 1\n" * 5)
    (tmp_path / "README.md").write_text("line\n" * 200)
    m = layout.measure(tmp_path)
    assert (m["core"], m["extras"], m["core+extras"], m["README.md"]) == (261, 5, 266, 200)
    assert m["over"] == {"run.py": 251}
    assert layout.main(["--root", str(tmp_path)]) == 1
    (tmp_path / "run.py").write_text("x = 1\n" * 250)
    assert layout.main(["--root", str(tmp_path)]) == 0
