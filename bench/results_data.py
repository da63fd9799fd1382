"""Read the benchmark results under bench/results/<gpu>/ back, for report.py and plot.py.

A result file is pytest-benchmark JSON (``--benchmark-json``). The suites record in each
benchmark's ``extra_info`` (``bench/measure.py``): ``unit``, ``impls`` {implementation:
throughput}, ``ratios`` {peer: peer_ms / ms}, ``host_us_all``, and where the result belongs:
``table`` + ``case`` (a row of a table) and optionally ``figure`` + ``x`` + ``xlabel`` (a
point of a plot). Older results without ``table`` are listed as they were (``legacy``).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field


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


@dataclass
class Figure:
    name: str
    unit: str
    xlabel: str
    file: str  # the result file the points come from (the newest that has this figure)
    xs: list = field(default_factory=list)
    series: dict = field(default_factory=dict)  # implementation → [throughput or None per x]


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
        for impl in e.info.get("impls", {}):
            f.series.setdefault(impl, [])
        for impl, values in f.series.items():
            values.extend([None] * (len(f.xs) - 1 - len(values)))
            values.append(e.info.get("impls", {}).get(impl))
    for f in out.values():
        if all(isinstance(x, (int, float)) for x in f.xs):  # numeric sizes: ascending
            order = sorted(range(len(f.xs)), key=lambda i: f.xs[i])
            f.xs = [f.xs[i] for i in order]
            f.series = {k: [v[i] for i in order] for k, v in f.series.items()}
    return out


def plot_path(img_dir: pathlib.Path, gpu: str, figure: str) -> pathlib.Path:
    """Where plot.py writes a figure's PNG (and where report.py looks for it)."""
    return img_dir / gpu / f"{figure}.png"
