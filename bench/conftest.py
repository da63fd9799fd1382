"""pytest-benchmark suites: GPU only; each result carries throughput and the same-run peer ratio."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tilepy import _env  # noqa: E402  (before numba)

SIMULATOR = _env.choose_target()

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if SIMULATOR:
        skip = pytest.mark.skip(reason="benchmarks need a CUDA GPU (none found)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="session")
def gpu_name():
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else name


@pytest.fixture
def record(benchmark):
    """record(**figures): attach throughput / peer / ratio figures to the benchmark's extra_info."""

    def put(**info):
        for k, v in info.items():
            benchmark.extra_info[k] = round(v, 4) if isinstance(v, float) else v

    return put
