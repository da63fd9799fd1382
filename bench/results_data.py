"""Read the benchmark results under bench/results/<gpu>/ back, for report.py and plot.py.

A result file is pytest-benchmark JSON (``--benchmark-json``). The suites record in each
benchmark's ``extra_info`` (``bench/measure.py``): ``unit``, ``impls`` {implementation:
GPU-only throughput}, ``impls_as_called`` {implementation: throughput as called},
``ratios`` {peer: peer_ms / ms of each one's slower time}, ``host_us_all``, and where the
result belongs: ``table`` + ``case`` (a row of a table) and optionally ``figure`` + ``x`` +
``xlabel`` (a point of a plot). Older results without ``table`` are listed as they were
(``legacy``).

Tables and plots show each implementation's *effective* throughput (:func:`effective`): the
lower of its GPU-only and as-called throughput, i.e. its slower time; ``ratios`` are already
recorded that way. Files from before the as-called timing have no ``impls_as_called``: their
effective throughput is the GPU-only one (:func:`has_as_called` tells them apart).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

HOST_BOUND = 1.10  # bench/measure.py's HOST_BOUND: as called > 1.1 × GPU only


@dataclass(frozen=True)
class Entry:
    """One benchmark of one result file."""

    file: str
    name: str
    info: dict


@dataclass
class Table:
    title: str
    unit: str
    impls: list = field(default_factory=list)  # in order of first appearance
    peers: list = field(default_factory=list)  # implementations that have a ratio
    host: bool = False  # rows carry host µs per call worth showing
    rows: list = field(default_factory=list)  # Entry
    gpu_only_files: list = field(default_factory=list)  # files of rows without as-called figures


@dataclass
class Figure:
    name: str
    unit: str
    xlabel: str
    file: str  # the result file the points come from (the newest that has this figure)
    xs: list = field(default_factory=list)
    series: dict = field(default_factory=dict)  # implementation → [effective throughput or None]
    host_bound: dict = field(default_factory=dict)  # implementation → [host-bound as called?]
    as_called: bool = False  # the points carry as-called figures (else GPU-only time only)


def load(path: pathlib.Path):
    """The JSON of ``path``, or None if it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def entries(gpu_dir: pathlib.Path) -> list:
    """Every pytest-benchmark entry of the JSON files in ``gpu_dir``, oldest file first."""
    out = []
    for path in sorted(gpu_dir.glob("*.json")):
        data = load(path)
        if isinstance(data, dict) and "benchmarks" in data:
            out += [Entry(path.name, b["name"], b.get("extra_info", {}))
                    for b in data["benchmarks"]]
    return out


def has_as_called(info: dict) -> bool:
    """The entry recorded as-called figures (files from before that timing did not)."""
    return "impls_as_called" in info or "ms_as_called" in info


def effective(info: dict) -> dict:
    """{implementation: effective throughput or None}: the lower of the GPU-only (``impls``)
    and the as-called (``impls_as_called``) throughput, i.e. the slower time; the GPU-only
    one where no as-called figure was recorded."""
    called = info.get("impls_as_called", {})
    out = {}
    for impl, gpu in info.get("impls", {}).items():
        ac = called.get(impl)
        out[impl] = gpu if ac is None or gpu is None else min(gpu, ac)
    return out


def host_bound(info: dict) -> dict:
    """{implementation: True where its as-called time exceeds ``HOST_BOUND`` × its GPU-only
    time} (from the throughputs: time ratio = inverse throughput ratio); only
    implementations with both figures."""
    called = info.get("impls_as_called", {})
    return {impl: gpu > HOST_BOUND * called[impl]
            for impl, gpu in info.get("impls", {}).items()
            if gpu is not None and called.get(impl) is not None}


def legacy_effective(info: dict, prefix: str = ""):
    """(effective throughput, host-bound?) of a result without ``table`` (the ``tflops`` /
    ``gbps`` figure, or with ``prefix="peer_"`` its peer's): the lower of it and its
    ``..._as_called`` twin where that was recorded."""
    key = "tflops" if "tflops" in info else "gbps"
    gpu, ac = info.get(prefix + key), info.get(f"{prefix}{key}_as_called")
    if gpu is None or ac is None:
        return gpu, False
    return min(gpu, ac), gpu > HOST_BOUND * ac


def legacy(items) -> list:
    """Entries recorded before tables and figures (no ``table`` key)."""
    return [e for e in items if "table" not in e.info]


def _add_unique(seq, items):
    for x in items:
        if x not in seq:
            seq.append(x)


def tables(items) -> dict:
    """{title: Table} of the entries that name a table, in order of first appearance."""
    out = {}
    for e in items:
        title = e.info.get("table")
        if title is None:
            continue
        t = out.setdefault(title, Table(title, e.info.get("unit", "")))
        _add_unique(t.impls, e.info.get("impls", {}))
        _add_unique(t.peers, e.info.get("ratios", {}))
        t.host = t.host or bool(e.info.get("flushed_l2"))
        t.rows.append(e)
        if not has_as_called(e.info):
            _add_unique(t.gpu_only_files, [e.file])
    return out


def figures(items) -> dict:
    """{name: Figure}; each figure's points come from the newest file that has it (points of
    different runs are not mixed: ratios only hold within one run)."""
    newest = {}
    for e in items:
        if "figure" in e.info and "x" in e.info:
            newest[e.info["figure"]] = e.file  # files come oldest first
    out = {}
    for e in items:
        name = e.info.get("figure")
        if name is None or newest.get(name) != e.file or "x" not in e.info:
            continue
        f = out.setdefault(name, Figure(name, e.info.get("unit", ""), e.info.get("xlabel", ""),
                                        e.file))
        f.xs.append(e.info["x"])
        f.as_called = f.as_called or has_as_called(e.info)
        eff, bound = effective(e.info), host_bound(e.info)
        for impl in e.info.get("impls", {}):
            f.series.setdefault(impl, [])
            f.host_bound.setdefault(impl, [])
        for impl, values in f.series.items():
            values.extend([None] * (len(f.xs) - 1 - len(values)))
            values.append(eff.get(impl))
            flags = f.host_bound[impl]
            flags.extend([False] * (len(f.xs) - 1 - len(flags)))
            flags.append(bound.get(impl, False))
    for f in out.values():
        if all(isinstance(x, (int, float)) for x in f.xs):  # numeric sizes: ascending
            order = sorted(range(len(f.xs)), key=lambda i: f.xs[i])
            f.xs = [f.xs[i] for i in order]
            f.series = {k: [v[i] for i in order] for k, v in f.series.items()}
            f.host_bound = {k: [v[i] for i in order] for k, v in f.host_bound.items()}
    return out


def plot_path(img_dir: pathlib.Path, gpu: str, figure: str) -> pathlib.Path:
    """Where plot.py writes a figure's PNG (and where report.py looks for it)."""
    return img_dir / gpu / f"{figure}.png"
