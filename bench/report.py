"""Build docs/performance.md from the result files under bench/results/ (never by hand).

    python bench/report.py            # rewrite docs/performance.md
    python bench/report.py --check    # exit 1 if docs/performance.md is out of date

Reads pytest-benchmark JSON (``extra_info``: one table per ``table`` with every
implementation's throughput and tilepy's ratio to each peer, ``bench/results_data.py``), the
JSON of the sweeps and probes (``bench/sweep_*.py``, ``bench/probe_*.py``, ``bench/overhead.py``,
``bench/first_call.py``), ``ncu`` CSV exports and ``python -m tilepy demo --json``.

The page shows the latest result of each case (:func:`run_key` orders the files by when they
were measured; :func:`latest`, :func:`latest_rows`), the rows of the latest run first, with
the plots of ``bench/plot.py`` that exist under docs/img/ (run plot.py first) under their
table. Earlier results stay in bench/results/ and bench/NOTES.md, which the page links.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import results_data

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET = ROOT / "docs" / "performance.md"
IMG = ROOT / "docs" / "img"


_RUN = re.compile(r"(\d{4}-\d{2}-\d{2})_(?:s(\d+)([a-z]*)(\d*)_)?")


def run_key(name: str) -> tuple:
    """Sort key of a result file's name, oldest first: its date, then its session and part
    (``2026-12-01_s11g_...``: session 11, part g; ``s11f0`` after ``s11f``; a name without
    one sorts before the day's sessions), then the name. Plain name order would put
    ``s10c`` before ``s3``."""
    m = _RUN.match(name)
    if m is None:
        return ("", 0, "", -1, name)
    part = int(m.group(4)) if m.group(4) else -1
    return (m.group(1), int(m.group(2) or 0), m.group(3), part, name)


def case_key(e) -> tuple:
    """What a suite entry measures: its table and case (an entry without a table: its
    benchmark's name)."""
    return (e.info.get("table"), e.info.get("case", e.name))


def latest(items) -> list:
    """The entries of each case's latest file (:func:`case_key`, :func:`run_key`), the latest
    run first; a file's entries keep their order."""
    newest = {}
    for e in items:
        k = case_key(e)
        if k not in newest or run_key(e.file) > run_key(newest[k]):
            newest[k] = e.file
    kept = [e for e in items if newest[case_key(e)] == e.file]
    return sorted(kept, key=lambda e: run_key(e.file), reverse=True)  # stable: file order kept


def latest_rows(rows) -> list:
    """``(file, case, row)`` triples → the rows of each case's latest file, the latest run
    first (a file's rows in their order)."""
    newest = {}
    for file, case, _ in rows:
        if case not in newest or run_key(file) > run_key(newest[case]):
            newest[case] = file
    kept = [(file, row) for file, case, row in rows if newest[case] == file]
    kept.sort(key=lambda fr: run_key(fr[0]), reverse=True)
    return [row for _, row in kept]


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


def suite_tables(items, gpu: str | None = None) -> list:
    """Markdown for every table the suites named, in the order the tables were first
    measured: a row per case, from the case's latest file (:func:`latest`; the latest run
    first), a column per implementation's effective throughput (its slower time, GPU only or
    as called; marked ``HOST_MARK`` where host-bound as called), then tilepy's ratio to each
    peer (peer_ms / ms of the effective times), then a footnote that says so; with ``gpu``,
    then the plots of the table's figures that exist (:func:`plot_links`)."""
    items = sorted(items, key=lambda e: run_key(e.file))
    order = list(results_data.tables(items))
    shown = results_data.tables(latest(items))
    parts = []
    for title in order:
        t = shown[title]
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
        parts += [f"### {title}", "", table(head, rows), "",
                  effective_note(marked, t.gpu_only_files,
                                 not any(results_data.has_as_called(e.info) for e in t.rows)),
                  ""]
        if gpu is not None:
            parts += plot_links(gpu, items, title)
    return parts


def plot_links(gpu: str, items, title: str) -> list:
    """Links to the PNGs of bench/plot.py that exist for the figures of table ``title``
    (a figure belongs to the table of its first point in the file its points come from)."""
    links = []
    for name, fig in results_data.figures(items).items():
        owner = next(e.info.get("table") for e in items
                     if e.file == fig.file and e.info.get("figure") == name)
        path = results_data.plot_path(IMG, gpu, name)
        if owner == title and path.exists():
            links.append(f"![{name}]({path.relative_to(TARGET.parent).as_posix()})")
    if not links:
        return []
    return ["Plots (`bench/plot.py`; each from the newest file with that figure, named in "
            "its corner):", "", *links, ""]


def _link(path: pathlib.Path) -> str:
    """``path`` relative to the page, as a Markdown link target."""
    return pathlib.Path(os.path.relpath(path, TARGET.parent)).as_posix()


def tool_sections(gpu_dir: pathlib.Path) -> list:
    """Markdown for the results that are not suite tables: the older pytest-benchmark entries
    without a table, and the JSON of the sweeps, probes, host-cost, first-call and demo runs
    and the ``ncu`` exports, one table each, from each case's latest file
    (:func:`latest_rows`). A sweep's or probe's case is a problem: all the configs or variants
    its latest run compared on it (their ratios hold within one run); an ``ncu`` export's,
    the whole file; any other row is a case of its own."""
    rows = {k: [] for k in ("bench", "sweep", "probe", "gs_probe", "gs_pieces", "clock", "att", "gemm_small", "bwd_probe",
                            "ncu", "trace_gemm", "trace_decode", "fp8_probe",
                            "first", "host", "demo", "ab")}
    items = sorted(results_data.entries(gpu_dir), key=lambda e: run_key(e.file))
    shown = latest(results_data.legacy(items))
    legacy_marked, legacy_called, legacy_old = False, False, []
    for b in shown:
        e = b.info
        unit = " TFLOPS" if "tflops" in e else " GB/s"
        thr, bound = results_data.legacy_effective(e)
        peer_thr, peer_bound = results_data.legacy_effective(e, "peer_")
        legacy_marked = legacy_marked or bound or (peer_bound and bool(e.get("peer")))
        if results_data.has_as_called(e):
            legacy_called = True
        elif b.file not in legacy_old:
            legacy_old.append(b.file)
        rows["bench"].append((b.file, b.name, (
            b.file, b.name, fmt(thr, unit) + (HOST_MARK if bound else ""), e.get("peer", "-"),
            fmt(peer_thr, unit) + (HOST_MARK if peer_bound else "") if e.get("peer") else "-",
            fmt(e.get("ratio"), "×"))))
    for f in sorted(gpu_dir.glob("*.json"), key=lambda f: run_key(f.name)):
        data = results_data.load(f)
        if not isinstance(data, dict) or "benchmarks" in data or "rows" not in data:
            continue
        add = []  # (section, case, row)
        if all("spans_us" in r and "cublas_graph_us" in r for r in data["rows"]):
            # bench/trace_gemm.py: the traced GEMM kernel's phases, per block (means)
            for r in data["rows"]:
                problem = "×".join(map(str, r["shape"]))
                ph = r["median_run"]["phases"]
                mean = lambda k: fmt(ph[k]["mean_us"]) if k in ph else "-"  # noqa: E731
                add.append(("trace_gemm", problem, (
                    problem, fmt(r["op_graph_us"]), fmt(r["cublas_graph_us"]),
                    fmt(r["median_run"]["span_us"]), mean("first wait"),
                    mean("first main loop"), mean("split-K step"), mean("first epilogue"),
                    mean("entry to end"))))
        elif all("copy_graph_us" in r and "median_run" in r for r in data["rows"]):
            # bench/trace_decode.py: the traced decoding kernel's phases, per warp (means)
            for r in data["rows"]:
                problem = f"B{r['batch']} S{r['seq']}" + (f" page {r['page']}" if r["page"]
                                                          else "")
                ph = r["median_run"]["phases"]
                add.append(("trace_decode", problem, (
                    problem, f"{r['mb']:.0f}", str(r["splits"]), fmt(r["op_graph_us"]),
                    fmt(r["copy_graph_us"]), fmt(r["median_run"]["span_us"]),
                    fmt(ph["Q load"]["mean_us"]), fmt(ph["key loop"]["mean_us"]),
                    fmt(ph["store"]["mean_us"]))))
        elif all({"shape", "name", "tflops"} <= set(r) and "config" not in r
                 for r in data["rows"]):
            # bench/probe_gemm_fp8.py: FP8 GEMM configs against torch._scaled_mm
            for r in data["rows"]:
                problem = (r["shape"].replace("x", "×") if isinstance(r["shape"], str)
                           else "×".join(map(str, r["shape"])))
                add.append(("fp8_probe", (problem, r["name"]), (
                    problem, r["name"], fmt(r["tflops"]), fmt(r.get("gpu_us")),
                    fmt(r.get("as_called_us")), fmt(r.get("of_peer"), "×"))))
        elif "peer_tflops" in data:                            # bench/sweep_gemm.py
            for r in data["rows"]:
                if "tflops" in r:
                    extra = ""
                    if "group_m" in r:
                        extra = f" (group_m {r['group_m']}, double buffer {r['double_buffer']})"
                    problem = f"{data['n']}³ {data['dtype']}"
                    add.append(("sweep", ("sweep_gemm", problem),
                                (problem, r["config"] + extra, fmt(r["tflops"]),
                                 fmt(data["peer_tflops"]), fmt(r["ratio"], "×"))))
        elif all("us_per_call" in r for r in data["rows"]):   # bench/overhead.py
            add = [("host", (r["name"], bool(r.get("peer"))),
                    (r["name"], "peer" if r.get("peer") else "tilepy", fmt(r["us_per_call"])))
                   for r in data["rows"]]
        elif "checks" in data:                                # bench/sweep_gemm_wgmma.py
            add = [("sweep", ("sweep_gemm_wgmma", f"{r['n']}³ float16"),
                    (f"{r['n']}³ float16", r["config"], fmt(r["tflops"]),
                     fmt(r["peer_tflops"]), fmt(r["ratio"], "×"))) for r in data["rows"]]
        elif all("peers_ms" in r for r in data["rows"]):      # bench/probe_attention_backward.py
            for r in data["rows"]:
                problem = (f"B{r['b']} H{r['h']} S{r['s']} D{r['d']}"
                           + (" causal" if r["causal"] else ""))
                config = r.get("config") or f"{r['block_m']}×{r['block_n']} mma.sync" + (
                    ", deterministic" if r.get("deterministic") else ", dQ atomics")
                add.append(("bwd_probe", (problem, config), (
                    problem, config, fmt(r.get("tflops")) if "tflops" in r else
                    r.get("error", "-"), fmt(r.get("ratio_cudnn"), "×"),
                    fmt(r.get("ratio_fa2"), "×"))))
        elif all("block_m" in r for r in data["rows"]):       # bench/sweep_attention.py
            for r in data["rows"]:
                problem = (f"B{r['b']} H{r['h']} S{r['s']} D{r['d']}"
                           + (" causal" if r["causal"] else ""))
                config = (f"{r['block_m']}×{r['block_n']}, {r['warp_rows']} rows/warp"
                          + (", overlap" if r.get("overlap") else "")
                          + (", persistent" if r.get("persistent") else "")
                          + (", TMA" if r.get("tma") else "")
                          + (", ping-pong" if r.get("pingpong") else "")
                          + (", producer warpgroup" if r.get("producer") else ""))
                add.append(("att", problem,
                            (problem, config, fmt(r["tflops"]), fmt(r["ratio"], "×"))))
        elif all("kernels_us" in r and "impl" in r for r in data["rows"]):
            # bench/probe_gemm_small.py: GPU kernels per call under torch.profiler
            for r in data["rows"]:
                problem = "×".join(map(str, r["shape"]))
                how = "CUDA graph" if r["graph"] else "eager"
                kernels = "; ".join(f"{k.split('::')[-1][:28]} {v:.1f}"
                                    for k, v in r["kernels_us"].items())
                add.append(("gemm_small", (problem, r["impl"], how), (
                    problem, r["impl"], how, fmt(r["sum_us"]),
                    fmt(r["replay_us"]) if r.get("replay_us") else "-", kernels)))
        elif all("shape" in r and "config" in r for r in data["rows"]):
            # bench/sweep_gemm_shapes.py: configs through the op, peer re-timed per row
            for r in data["rows"]:
                problem = "×".join(map(str, r["shape"])) + f" {r['dtype']}"
                add.append(("sweep", ("sweep_gemm_shapes", problem),
                            (problem, r["config"], fmt(r["tflops"]), fmt(r["peer_tflops"]),
                             fmt(r["ratio"], "×"))))
        elif "m" in data and all("gpu_ms" in r and "name" in r for r in data["rows"]):
            # bench/probe_gemm_softmax.py: the fused kernel against its pieces, per N
            for r in data["rows"]:
                problem = f"{data['m']}×{r['n']}×{data['k']}"
                add.append(("gs_pieces", (problem, r["name"]), (
                    problem, r["name"], fmt(r["gpu_ms"] * 1e3),
                    fmt(r["as_called_ms"] * 1e3) if r.get("as_called_ms") else "-",
                    fmt(r["tflops"]))))
        elif all("variant" in r for r in data["rows"]) and "m" in data:
            # the gemm_softmax probe (session 6; its probe= mode has left tilepy): µs per
            # variant, per N
            for r in data["rows"]:
                problem = f"{data['m']}×{r['n']}×{data['k']}"
                add.append(("gs_probe", problem,
                            (problem, r["variant"], fmt(r.get("us")), fmt(r.get("tflops")))))
        elif all("variant" in r for r in data["rows"]):
            # bench/probe_epilogue.py: the fused epilogue's pieces (failed rows: "error")
            for r in data["rows"]:
                variant = (f"N={r['n']} " if "n" in r else "") + r["variant"]
                add.append(("probe", r.get("n"), (
                    variant, fmt(r["ms"] * 1e3) if "ms" in r else fmt(r.get("us")),
                    fmt(r.get("tflops")), fmt(r["peer_ms"] * 1e3) if "peer_ms" in r else "-",
                    fmt(r.get("ratio"), "×") if "ratio" in r else r.get("error", "-"))))
        elif all("cold" in r and "warm" in r for r in data["rows"]):  # bench/first_call.py
            add = [("first", (r["label"], which),
                    (r["label"], which, fmt(r[which].get("import_s")),
                     fmt(r[which].get("first_call_s"))))
                   for r in data["rows"] for which in ("cold", "warm")]
        elif all("sm_clock_mhz_median" in r for r in data["rows"]):
            # bench/probe_clocks.py: back to back for seconds, nvidia-smi sampling
            add = [("clock", r["case"],
                    (r["case"], fmt(r["tflops"]), fmt(r["sm_clock_mhz_median"]),
                     fmt(r["sm_clock_mhz_min"]), fmt(r["power_w_median"]),
                     " ".join(r["throttle_reasons"]) or "-")) for r in data["rows"]]
        elif "a" in data and "b" in data and all("suite" in r for r in data["rows"]):
            # bench/ab_commits.py: one tree against another, medians of rounds in turn
            for r in data["rows"]:
                a, b = r.get("A") or {}, r.get("B") or {}
                add.append(("ab", (r["suite"], r["case"]), (
                    r["suite"], r["case"], fmt(a.get("tflops")), fmt(b.get("tflops")),
                    fmt(r.get("b_over_a"), "×"), fmt(a.get("ratio_to_peer"), "×"),
                    fmt(b.get("ratio_to_peer"), "×"), str(data.get("rounds", "-")))))
        elif "gpu" in data:                                   # python -m tilepy demo --json
            add = [("demo", (r["what"], r.get("size", "")),
                    (r["what"], r.get("size", ""), r.get("throughput") or "-",
                     r.get("peer") or "-", fmt(r.get("ratio"), "×"))) for r in data["rows"]]
        for section, case, row in add:
            rows[section].append((f.name, case, (f.name, *row)))
    for f in sorted(gpu_dir.glob("*_ncu_*raw.csv"), key=lambda f: run_key(f.name)):
        # one profile per file: a case is the file's subject and the row's place in it
        subject = _RUN.sub("", f.name, count=1)
        rows["ncu"] += [(f.name, (subject, i), row) for i, row in enumerate(ncu_table(f))]
    rows = {k: latest_rows(v) for k, v in rows.items()}

    parts = []
    if rows["bench"]:
        parts += ["### Earlier benchmarks (pytest-benchmark, before per-peer tables)", "",
                  table(("file", "benchmark", "tilepy", "peer", "peer", "ratio"), rows["bench"]),
                  ""]
        if legacy_called:  # rows of this kind recorded since: say which time they use
            parts += [effective_note(legacy_marked, legacy_old, False, True), ""]
    sections = [
        ("sweep", "GEMM kernel configurations (`bench/sweep_gemm.py`, "
                  "`bench/sweep_gemm_wgmma.py`, `bench/sweep_gemm_shapes.py`)",
         ("file", "problem", "config", "TFLOPS", "cuBLAS TFLOPS", "ratio")),
        ("probe", "Fused GEMM epilogue, piece by piece (`bench/probe_epilogue.py`, 4096³ "
                  "float16, TMA kernel)",
         ("file", "variant", "µs", "TFLOPS", "unfused torch µs", "ratio to unfused torch")),
        ("gs_probe", "Fused GEMM + softmax, piece by piece (session 6's probe, removed with "
                     "its measurement-only kernel mode; float16)",
         ("file", "M×N×K", "variant", "µs", "TFLOPS equivalent (2·M·N·K / µs)")),
        ("gs_pieces", "Fused GEMM + softmax against its pieces (`bench/probe_gemm_softmax.py`: "
                      "GPU-only and as-called µs, float16; TFLOPS 2·M·N·K over the slower)",
         ("file", "M×N×K", "what", "µs GPU", "µs as called", "TFLOPS")),
        ("gemm_small", "Small GEMMs, kernel by kernel (`bench/probe_gemm_small.py`: "
                       "torch.profiler's GPU µs per call, bfloat16; a graph replays 20 calls)",
         ("file", "M×N×K", "implementation", "run", "kernels µs", "replay µs per call",
          "kernels (µs)")),
        ("clock", "Sustained clocks and power (`bench/probe_clocks.py`: each case back to "
                  "back for seconds; throttle 0x4 is the software power cap)",
         ("file", "case", "TFLOPS", "SM MHz (median)", "SM MHz (min)", "power W (median)",
          "throttle reasons")),
        ("att", "Attention kernel configurations (`bench/sweep_attention.py`)",
         ("file", "problem", "config", "TFLOPS", "ratio to SDPA FA2")),
        ("bwd_probe", "Attention backward kernel configurations "
                      "(`bench/probe_attention_backward.py`: GPU time, no L2 flush; FLOPs "
                      "2.5 × the forward's)",
         ("file", "problem", "config", "TFLOPS", "ratio to SDPA cuDNN", "ratio to SDPA FA2")),
        ("ncu", "Nsight Compute (`bench/profile_attention.sh`: one launch each; pipe figures "
                "are % of peak over active cycles)",
         ("file", "kernel", "grid × block", "µs", "instructions (M)", "tensor pipe %",
          "XU (MUFU) %", "ALU %", "FMA %", "uniform %", "cycles per issue")),
        ("first", "First call in a fresh process (`bench/first_call.py`)",
         ("file", "call", "kernel cache", "import s", "first call s")),
        ("host", "Host cost of one call (`bench/overhead.py`)",
         ("file", "call", "who", "µs per call")),
        ("ab", "A/B of two trees (`bench/ab_commits.py`: A the old code, B the new; each round "
               "a fresh process per tree, in turn; medians)",
         ("file", "suite", "case", "A TFLOPS", "B TFLOPS", "B / A", "A / peer", "B / peer",
          "rounds")),
        ("trace_gemm", "Phase marks of the GEMM (`bench/trace_gemm.py`: a traced launch's "
                       "blocks, mean µs of each phase; op and cuBLAS per call in a graph)",
         ("file", "M×N×K", "op µs", "cuBLAS µs", "span µs", "first wait", "first main loop",
          "split-K step", "first epilogue", "entry to end")),
        ("trace_decode", "Phase marks of decoding (`bench/trace_decode.py`: bfloat16 D128, "
                         "a traced launch's warps, mean µs; op and a copy of the cache per "
                         "call in a graph)",
         ("file", "shape", "cache MB", "splits", "op µs", "copy µs", "span µs", "Q load",
          "key loop", "store")),
        ("fp8_probe", "FP8 GEMM configurations (`bench/probe_gemm_fp8.py`: GPU µs, "
                      "e4m3 with row and column scales, bf16 out)",
         ("file", "M×N×K", "implementation", "TFLOPS", "µs GPU", "µs as called",
          "ratio to its torch._scaled_mm")),
        ("demo", "`python -m tilepy demo`",
         ("file", "what", "size", "tilepy", "peer", "ratio")),
    ]
    for key, title, head in sections:
        if rows[key]:
            parts += [f"### {title}", "", table(head, rows[key]), ""]
    return parts


def build() -> str:
    notes = ROOT / "bench" / "NOTES.md"
    parts = ["# Performance", "",
             ("Generated by `python bench/report.py` from the files in `bench/results/`; do not "
              "edit. Each table shows the latest result of each case, the rows of the latest "
              "run first; the file column names the run it comes from. Ratios compare with the "
              "peer measured in the same run (run-to-run spread on the H200 is about 10%), so "
              "compare rows of different runs through their ratios only."), "",
             (f"History: every earlier result stays in [`bench/results/`]({_link(RESULTS)}/), "
              f"and [`bench/NOTES.md`]({_link(notes)}) records, run by run, what was changed, "
              "what was expected and what was measured."), ""]
    for gpu_dir in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        files = [f for f in gpu_dir.iterdir() if f.is_file()]
        parts += [f"## {gpu_dir.name.replace('_', ' ')}", "",
                  (f"All {len(files)} result files of this GPU: "
                   f"[`bench/results/{gpu_dir.name}/`]({_link(gpu_dir)}/)."), ""]
        items = results_data.entries(gpu_dir)
        parts += suite_tables(items, gpu_dir.name) + tool_sections(gpu_dir)
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
