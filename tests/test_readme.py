"""The README's Quickstart and .ci/run must not drift apart."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def quickstart_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_quickstart_has_exactly_two_commands():
    cmds = quickstart_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert cmds[0].endswith("python -m tilepy demo")
    assert re.search(r"python -m pytest( -n \d+)?$", cmds[1])


def test_ci_runs_the_readme_test_command_unchanged():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart_commands()[1] in ci
