"""Build docs/performance.md from the result files under bench/results/ (never by hand).

    python bench/report.py            # rewrite docs/performance.md
    python bench/report.py --check    # exit 1 if docs/performance.md is out of date

Reads pytest-benchmark JSON (``extra_info``: one table per ``table`` with every
implementation's throughput and tilepy's ratio to each peer, ``bench/results_data.py``), the
config sweeps of ``bench/sweep_gemm.py`` and the JSON of ``python -m tilepy demo --json``;
links the plots of ``bench/plot.py`` that exist under docs/img/ (run plot.py first).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import results_data

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET = ROOT / "docs" / "performance.md"
IMG = ROOT / "docs" / "img"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(v, unit=""):
    if v is None:
        return "-"
    return f"{v:.2f}{unit}" if abs(v) < 10 else f"{v:.0f}{unit}"


HOST_MARK = "†"


def effective_note(marked: bool, gpu_only_files, all_old: bool, legacy: bool = False) -> str:
    """The footnote under a table: which time its throughputs and ratios use, what
    ``HOST_MARK`` means (when a row has it) and which rows have no as-called figures (the
    files ``gpu_only_files``; ``all_old``: no row has them)."""
    bound = f"{results_data.HOST_BOUND:.2f}".rstrip("0").rstrip(".")
    before = "recorded before `bench/measure.py` timed calls as called"
    if all_old:
        return (f"No row of this table has as-called figures ({before}): throughputs and "
                "ratios are of GPU-only time (events around calls behind a GPU spin, so they "
                "hold GPU work only), never marked host-bound. Rows recorded since use each "
                "implementation's slower time, GPU only or as called.")
    if legacy:
        text = ("Where a row has as-called figures, its throughputs and ratio use each "
                "implementation's slower time: the one recorded, or as called (back-to-back "
                "calls with nothing in front, host cost included).")
    else:
        text = ("Throughputs and ratios use each implementation's slower time "
                "(`bench/measure.py`): GPU only (events around calls behind a GPU spin, so "
                "they hold GPU work only) or as called (back-to-back calls with nothing in "
                "front, host cost included).")
    if marked:
        text += (f" {HOST_MARK} host-bound as called: this implementation's as-called time is "
                 f"more than {bound}× its {'recorded' if legacy else 'GPU-only'} time (the CPU "
                 "cost of a call exceeds its GPU work), so the figure shown is the as-called "
                 "one.")
    if gpu_only_files:
        then = "as recorded then" if legacy else "GPU-only time only"
        text += (f" Older rows lack as-called figures ({before}; files "
                 f"{', '.join(gpu_only_files)}): {then}, never marked.")
    return text


def suite_tables(items) -> list:
    """Markdown for every table the suites named: a row per case, a column per
    implementation's effective throughput (its slower time, GPU only or as called; marked
    ``HOST_MARK`` where host-bound as called), then tilepy's ratio to each peer (peer_ms /
    ms of the effective times), then a footnote that says so."""
    parts = []
    for t in results_data.tables(items).values():
        head = ["file", "case"] + [f"{i} ({t.unit})" for i in t.impls]
        head += [f"ratio to {p}" for p in t.peers]
        if t.host:
            head += [f"host µs/call {i}" for i in t.impls]
        rows, marked = [], False
        for e in t.rows:
            impls = results_data.effective(e.info)
            bound = results_data.host_bound(e.info)
            ratios = e.info.get("ratios", {})
            host = e.info.get("host_us_all", {})
            row = [e.file, e.info.get("case", e.name)]
            for i in t.impls:
                mark = HOST_MARK if bound.get(i) else ""
                marked = marked or bool(mark)
                row.append(fmt(impls.get(i)) + mark)
            row += [fmt(ratios.get(p), "×") for p in t.peers]
            if t.host:
                row += [fmt(host.get(i)) for i in t.impls]
            rows.append(row)
        parts += [f"### {t.title}", "", table(head, rows), "",
                  effective_note(marked, t.gpu_only_files,
                                 not any(results_data.has_as_called(e.info) for e in t.rows)),
                  ""]
    return parts


def plot_links(gpu: str, items) -> list:
    """Links to the PNGs of bench/plot.py that exist for this GPU's figures."""
    links = []
    for name in results_data.figures(items):
        path = results_data.plot_path(IMG, gpu, name)
        if path.exists():
            links.append(f"![{name}]({path.relative_to(TARGET.parent).as_posix()})")
    return ["### Plots (`bench/plot.py`)", "", *links, ""] if links else []


def build() -> str:
    parts = ["# Performance", "",
             ("Generated by `python bench/report.py` from the files in `bench/results/`; do not "
              "edit. Ratios compare with the peer measured in the same run (run-to-run spread "
              "on the H200 is about 10%). The log of what was tried and why is "
              "`bench/NOTES.md`."), ""]
    for gpu_dir in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        parts += [f"## {gpu_dir.name.replace('_', ' ')}", ""]
        items = results_data.entries(gpu_dir)
        parts += suite_tables(items) + plot_links(gpu_dir.name, items)
        bench_rows, sweep_rows, demo_rows, host_rows = [], [], [], []
        att_rows, first_rows, probe_rows, clock_rows = [], [], [], []
        legacy_marked, legacy_called, legacy_old = False, False, []
        for b in results_data.legacy(items):
            e = b.info
            unit = " TFLOPS" if "tflops" in e else " GB/s"
            thr, bound = results_data.legacy_effective(e)
            peer_thr, peer_bound = results_data.legacy_effective(e, "peer_")
            legacy_marked = legacy_marked or bound or (peer_bound and bool(e.get("peer")))
            if results_data.has_as_called(e):
                legacy_called = True
            elif b.file not in legacy_old:
                legacy_old.append(b.file)
            bench_rows.append((b.file, b.name, fmt(thr, unit) + (HOST_MARK if bound else ""),
                               e.get("peer", "-"),
                               fmt(peer_thr, unit) + (HOST_MARK if peer_bound else "")
                               if e.get("peer") else "-", fmt(e.get("ratio"), "×")))
        for f in sorted(gpu_dir.glob("*.json")):
            data = results_data.load(f)
            if not isinstance(data, dict) or "benchmarks" in data:
                continue
            if "rows" in data and "peer_tflops" in data:
                for r in data["rows"]:
                    if "tflops" in r:
                        extra = ""
                        if "group_m" in r:
                            extra = f" (group_m {r['group_m']}, double buffer {r['double_buffer']})"
                        sweep_rows.append((f.name, f"{data['n']}³ {data['dtype']}",
                                           r["config"] + extra, fmt(r["tflops"]),
                                           fmt(data["peer_tflops"]), fmt(r["ratio"], "×")))
            elif "rows" in data and all("us_per_call" in r for r in data["rows"]):
                host_rows += [(f.name, r["name"], "peer" if r.get("peer") else "tilepy",
                               fmt(r["us_per_call"])) for r in data["rows"]]
            elif "rows" in data and "checks" in data:       # bench/sweep_gemm_wgmma.py
                sweep_rows += [(f.name, f"{r['n']}³ float16", r["config"], fmt(r["tflops"]),
                                fmt(r["peer_tflops"]), fmt(r["ratio"], "×"))
                               for r in data["rows"]]
            elif "rows" in data and all("block_m" in r for r in data["rows"]):
                att_rows += [(f.name, f"B{r['b']} H{r['h']} S{r['s']} D{r['d']}"
                              + (" causal" if r["causal"] else ""),
                              f"{r['block_m']}×{r['block_n']}, {r['warp_rows']} rows/warp"
                              + (", overlap" if r.get("overlap") else "")
                              + (", persistent" if r.get("persistent") else "")
                              + (", TMA" if r.get("tma") else "")
                              + (", ping-pong" if r.get("pingpong") else "")
                              + (", producer warpgroup" if r.get("producer") else ""),
                              fmt(r["tflops"]), fmt(r["ratio"], "×")) for r in data["rows"]]
            elif "rows" in data and all("shape" in r and "config" in r for r in data["rows"]):
                # bench/sweep_gemm_shapes.py: configs through the op, peer re-timed per row
                sweep_rows += [(f.name, "×".join(map(str, r["shape"])) + f" {r['dtype']}",
                                r["config"], fmt(r["tflops"]), fmt(r["peer_tflops"]),
                                fmt(r["ratio"], "×")) for r in data["rows"]]
            elif "rows" in data and all("variant" in r for r in data["rows"]):
                # bench/probe_epilogue.py: the fused epilogue's pieces (failed rows: "error")
                # (bench/probe_gemm_softmax.py: microseconds, per N)
                probe_rows += [(f.name, (f"N={r['n']} " if "n" in r else "") + r["variant"],
                                fmt(r["ms"] * 1e3) if "ms" in r else fmt(r.get("us")),
                                fmt(r.get("tflops")),
                                fmt(r["peer_ms"] * 1e3) if "peer_ms" in r else "-",
                                fmt(r.get("ratio"), "×") if "ratio" in r else
                                r.get("error", "-")) for r in data["rows"]]
            elif "rows" in data and all("cold" in r and "warm" in r for r in data["rows"]):
                first_rows += [(f.name, r["label"], which, fmt(r[which].get("import_s")),
                                fmt(r[which].get("first_call_s")))
                               for r in data["rows"] for which in ("cold", "warm")]
            elif "rows" in data and all("sm_clock_mhz_median" in r for r in data["rows"]):
                # bench/probe_clocks.py: back to back for seconds, nvidia-smi sampling
                clock_rows += [(f.name, r["case"], fmt(r["tflops"]),
                                fmt(r["sm_clock_mhz_median"]), fmt(r["sm_clock_mhz_min"]),
                                fmt(r["power_w_median"]),
                                " ".join(r["throttle_reasons"]) or "-") for r in data["rows"]]
            elif "rows" in data and "gpu" in data:
                for r in data["rows"]:
                    demo_rows.append((f.name, r["what"], r.get("size", ""),
                                      r.get("throughput") or "-", r.get("peer") or "-",
                                      fmt(r.get("ratio"), "×")))
        if bench_rows:
            parts += ["### Earlier benchmarks (pytest-benchmark, before per-peer tables)", "",
                      table(("file", "benchmark", "tilepy", "peer", "peer", "ratio"), bench_rows),
                      ""]
            if legacy_called:  # rows of this kind recorded since: say which time they use
                parts += [effective_note(legacy_marked, legacy_old, False, True), ""]
        if sweep_rows:
            parts += ["### GEMM kernel configurations (`bench/sweep_gemm.py`, "
                      "`bench/sweep_gemm_wgmma.py`, `bench/sweep_gemm_shapes.py`)", "",
                      table(("file", "problem", "config", "TFLOPS", "cuBLAS TFLOPS", "ratio"),
                            sweep_rows), ""]
        if probe_rows:
            parts += ["### Fused GEMM epilogue, piece by piece (`bench/probe_epilogue.py`, "
                      "4096³ float16, TMA kernel)", "",
                      table(("file", "variant", "µs", "TFLOPS", "unfused torch µs",
                             "ratio to unfused torch"), probe_rows), ""]
        if clock_rows:
            parts += ["### Sustained clocks and power (`bench/probe_clocks.py`: each case back "
                      "to back for seconds; throttle 0x4 is the software power cap)", "",
                      table(("file", "case", "TFLOPS", "SM MHz (median)", "SM MHz (min)",
                             "power W (median)", "throttle reasons"), clock_rows), ""]
        if att_rows:
            parts += ["### Attention kernel configurations (`bench/sweep_attention.py`)", "",
                      table(("file", "problem", "config", "TFLOPS", "ratio to SDPA FA2"),
                            att_rows), ""]
        ncu_rows = [row for f in sorted(gpu_dir.glob("*_ncu_*raw.csv")) for row in ncu_table(f)]
        if ncu_rows:
            parts += ["### Nsight Compute (`bench/profile_attention.sh`: one launch each; pipe "
                      "figures are % of peak over active cycles)", "",
                      table(("file", "kernel", "grid × block", "µs", "instructions (M)",
                             "tensor pipe %", "XU (MUFU) %", "ALU %", "FMA %", "uniform %",
                             "cycles per issue"), ncu_rows), ""]
        if first_rows:
            parts += ["### First call in a fresh process (`bench/first_call.py`)", "",
                      table(("file", "call", "kernel cache", "import s", "first call s"),
                            first_rows), ""]
        if host_rows:
            parts += ["### Host cost of one call (`bench/overhead.py`)", "",
                      table(("file", "call", "who", "µs per call"), host_rows), ""]
        if demo_rows:
            parts += ["### `python -m tilepy demo`", "",
                      table(("file", "what", "size", "tilepy", "peer", "ratio"), demo_rows), ""]
    return "\n".join(parts)


def ncu_table(path) -> list:
    """Rows of an ``ncu --page raw --csv`` export (bench/profile_attention.sh)."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3:
        return []
    col = {h: i for i, h in enumerate(rows[0])}

    def get(r, name, scale=1.0):
        i = col.get(name)
        try:
            return fmt(float(r[i].replace(",", "")) * scale) if i is not None else "-"
        except ValueError:
            return r[i]

    # ncu picks the duration's unit per export (row 1 holds the units): scale it to µs
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
             "msecond": 1e3, "s": 1e6, "second": 1e6}
    unit = rows[1][col["gpu__time_duration.sum"]] if "gpu__time_duration.sum" in col else "ms"
    if unit not in to_us:
        raise ValueError(f"{path.name}: unknown unit {unit!r} of gpu__time_duration.sum")
    out = []
    for r in rows[2:]:
        name = r[col["Kernel Name"]]
        who = "tilepy" if name.startswith("tilepy") else name.split("_kernel")[0][:60]
        out.append((path.name, who, f"{r[col['Grid Size']]} × {r[col['Block Size']]}",
                    get(r, "gpu__time_duration.sum", to_us[unit]),
                    get(r, "smsp__inst_executed.sum", 1e-6),
                    get(r, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
                    get(r, "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
                    get(r, "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"),
                    get(r, "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
                    get(r, "sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active"),
                    get(r, "smsp__average_warp_latency_per_inst_issued.ratio")))
    return out


def main(argv) -> int:
    text = build()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print("docs/performance.md is out of date: run python bench/report.py")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT) if TARGET.is_relative_to(ROOT) else TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
