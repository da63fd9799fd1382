"""Test layers, chosen automatically.

* ``sim``     — kernels run in Numba's CUDA simulator with the PTX twins (no GPU needed);
* ``compile`` — offline ``compile_ptx`` + ``ptxas -v`` checks, in a subprocess without the
  simulator (no GPU needed);
* ``gpu``     — real hardware; skipped with a reason where there is no GPU.

``extended`` marks further cases (more shapes, more kernel variants) of tests whose core cases
run by default; they are deselected unless ``--extended`` is given.

With no GPU, ``NUMBA_ENABLE_CUDASIM=1`` is set here, before anything imports Numba. A run in
which no test executed (everything skipped, or nothing collected) fails.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tilepy import _env

SIMULATOR = _env.choose_target()

import pytest


def pytest_report_header(config):
    return f"tilepy target: {'CUDA simulator (no GPU)' if SIMULATOR else 'GPU'}"


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended cases (marked `extended`): further shapes and "
                          "kernel variants of tests whose core cases run by default")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found; ran in the simulator)")
    skip_sim = pytest.mark.skip(reason="simulator-only test; this run uses the GPU")
    for item in items:
        if SIMULATOR and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not SIMULATOR and "sim" in item.keywords and "gpu" not in item.keywords:
            # Simulator tests need NUMBA_ENABLE_CUDASIM in this process; on a GPU machine
            # run them with NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim.
            item.add_marker(skip_sim)
    if not config.getoption("--extended"):
        # deselected (reported as such), not skipped: the default run is the core tier
        extended = [item for item in items if "extended" in item.keywords]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if "extended" not in item.keywords]


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus not in (0,):
        return
    executed = len(reporter.stats.get("passed", [])) + len(reporter.stats.get("failed", []))
    if executed == 0:
        reporter.write_line("tilepy: no test executed (all skipped or none collected): failing",
                            red=True)
        session.exitstatus = 1


@pytest.fixture
def isolated_tuning(tmp_path, monkeypatch):
    """A fresh tuning cache directory, tuning on, quiet, and no remembered choices (GEMM or
    attention or softmax) before or after the test."""
    from tilepy.tune import attention_space, softmax_space, spaces

    monkeypatch.setenv("TILEPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    monkeypatch.delenv("TILEPY_AUTOTUNE", raising=False)
    forgets = (spaces.forget_choices, attention_space.forget_choices,
               softmax_space.forget_choices)
    for forget in forgets:
        forget()
    yield tmp_path
    for forget in forgets:
        forget()
