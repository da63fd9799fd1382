"""Every ```python block in README.md and docs/*.md runs (in the simulator in CI), so the docs
cannot drift from the code. Blocks of one file run in order in one namespace."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.sim
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_examples_run(path):
    code = blocks(path)
    namespace = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(code):
        exec(compile(block, f"{path.name}[block {i}]", "exec"), namespace)


def test_there_are_examples():
    assert sum(len(blocks(p)) for p in FILES) >= 3


def test_performance_page_is_generated_from_the_results():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
