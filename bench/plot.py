"""Plot the benchmark results: throughput against problem size, one line per implementation.

    python bench/plot.py                    # every GPU under bench/results/ → docs/img/<gpu>/
    python bench/plot.py --results DIR --out DIR

One PNG per figure the suites recorded (``figure`` / ``x`` in ``extra_info``, see
``bench/results_data.py``): GEMM TFLOPS against size, softmax GB/s against row length,
attention TFLOPS against sequence length. Each point is the implementation's effective
throughput: the slower of its GPU-only and as-called time (``bench/results_data.py``);
a point whose as-called time exceeds 1.1× its GPU-only time (host-bound as called) gets a
black cross; the legend says which time the figure uses (older files: GPU-only only). The
points of a figure all come from one result file, the newest that has it (files ordered by
``report.run_key``: date, then session), named in the plot's corner. A figure with a single
point is not drawn (its table has it).
Needs matplotlib (``pip install -e '.[bench]'``); then run ``python bench/report.py`` so that
docs/performance.md shows the new plots, each under its table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import report
import results_data

ROOT = pathlib.Path(__file__).resolve().parent.parent


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/plot.py needs matplotlib: pip install matplotlib "
                         "(or pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend_title(fig: results_data.Figure) -> str:
    """What the points are: each implementation's slower time, or (older files) GPU only."""
    if fig.as_called:
        return "slower of GPU-only and as-called time"
    return "GPU-only time (no as-called figures in this file)"


def draw(plt, fig: results_data.Figure, gpu: str, path: pathlib.Path) -> None:
    numeric = all(isinstance(x, (int, float)) for x in fig.xs)
    positions = fig.xs if numeric else list(range(len(fig.xs)))
    f, ax = plt.subplots(figsize=(7, 4.2))
    bound_pts = []
    for impl, values in fig.series.items():
        flags = fig.host_bound.get(impl, [False] * len(values))
        pts = [(p, v) for p, v in zip(positions, values) if v is not None]
        if not pts:
            continue
        style = {"linewidth": 2.5, "zorder": 3} if impl.startswith("tilepy") else {}
        if impl.startswith("copy"):
            style = {"linestyle": "--", "color": "grey"}
        ax.plot(*zip(*pts), marker="o", label=impl, **style)
        bound_pts += [(p, v) for p, v, b in zip(positions, values, flags) if b and v is not None]
    if bound_pts:
        bound = f"{results_data.HOST_BOUND:.2f}".rstrip("0").rstrip(".")
        ax.scatter(*zip(*bound_pts), marker="x", color="black", s=60, zorder=4,
                   label=f"host-bound as called (> {bound}× GPU-only time)")
    if numeric:
        ax.set_xscale("log", base=2)
        ax.set_xticks(fig.xs)
        ax.set_xticklabels([str(x) for x in fig.xs])
        ax.minorticks_off()
    else:
        ax.set_xticks(positions)
        ax.set_xticklabels([str(x) for x in fig.xs], rotation=15)
    ax.set_xlabel(fig.xlabel)
    ax.set_ylabel(f"{fig.unit} (slower time)" if fig.as_called else fig.unit)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{fig.name.replace('_', ' ')} — {gpu.replace('_', ' ')}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, title=legend_title(fig), title_fontsize=7)
    f.text(0.99, 0.01, fig.file, ha="right", va="bottom", fontsize=6, color="grey")
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=110)
    plt.close(f)


def plot_all(results: pathlib.Path, out: pathlib.Path) -> list:
    """Draw every figure of every GPU directory under ``results``; return the PNG paths."""
    plt = require_matplotlib()
    written = []
    for gpu_dir in sorted(p for p in results.iterdir() if p.is_dir()):
        items = sorted(results_data.entries(gpu_dir), key=lambda e: report.run_key(e.file))
        for fig in results_data.figures(items).values():
            if len(fig.xs) < 2:
                continue
            path = results_data.plot_path(out, gpu_dir.name, fig.name)
            draw(plt, fig, gpu_dir.name, path)
            written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=pathlib.Path, default=ROOT / "bench" / "results")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "img")
    args = p.parse_args(argv)
    written = plot_all(args.results, args.out)
    for path in written:
        print("wrote", path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    if not written:
        print(f"no figures with two or more points in {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
