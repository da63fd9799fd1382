"""The benchmark tooling without a GPU: what the suites record (bench/measure.py), how it is
read back into tables (bench/results_data.py, bench/report.py) and plots (bench/plot.py), and
the timing loop's logic against a fake CUDA (L2 flush, host cost kept out of the events, the
back-to-back as-called runs). Result files of both forms: with as-called figures and from
before them. The page shows each case's latest result, the latest run first."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import measure
import plot
import report
import results_data

GPU = "FAKE_GPU"


def recorded(**kw):
    """extra_info exactly as record_throughput writes it through the ``record`` fixture."""
    info = {}
    measure.record_throughput(lambda **f: info.update(f), **kw)
    return info


def t(ms, host_us=10.0, flushed=False, called=None):
    """A Timing; ``called``: its as-called ms (default: the GPU-only ms, not host-bound)."""
    called = ms if called is None else called
    return measure.Timing(ms, host_us, flushed, True, called, 20)


def gemm_entry(n, tilepy_ms, peers, tilepy_called=None, **kw):
    return recorded(work=2 * n**3, unit="TFLOPS", main="cuBLAS (torch)",
                    timings={"tilepy": t(tilepy_ms, called=tilepy_called), **peers},
                    dtype="float16", table="GEMM: square", case=f"{n}³ float16",
                    figure="gemm_square_float16", x=n, xlabel="M = N = K",
                    notes={"cuBLAS (CuPy)": "ImportError: no cupy"}, **kw)


OLD_FILE = "2025-12-31_before_as_called.json"


def old_entry(n, tilepy_ms, peer_ms):
    """extra_info as the suites wrote it before the as-called timing (literal, not through
    record_throughput): GPU-only figures only."""
    tf, peer_tf = 2 * n**3 / tilepy_ms / 1e9, 2 * n**3 / peer_ms / 1e9
    return {"gpu": "FAKE GPU", "dtype": "float16", "table": "GEMM: square",
            "case": f"{n}³ float16", "figure": "gemm_square_float16", "x": n,
            "xlabel": "M = N = K", "unit": "TFLOPS", "tflops": tf, "ms": tilepy_ms,
            "host_us": 20.0, "impls": {"tilepy": tf, "cuBLAS (torch)": peer_tf},
            "ratios": {"cuBLAS (torch)": peer_ms / tilepy_ms},
            "host_us_all": {"tilepy": 20.0, "cuBLAS (torch)": 8.0}, "flushed_l2": False,
            "host_hidden": True,
            "timing": "CUDA events, median of 10 runs after 2 warm-up calls",
            "peer": "cuBLAS (torch)", "peer_tflops": peer_tf, "ratio": peer_ms / tilepy_ms}


def write_file(gpu_dir, name, benches):
    data = {"machine_info": {}, "commit_info": {}, "datetime": "2026-01-01", "version": "4",
            "benchmarks": [{"name": n, "extra_info": info, "stats": {}} for n, info in benches]}
    (gpu_dir / name).write_text(json.dumps(data))


def write_results(root: pathlib.Path, old=True) -> pathlib.Path:
    gpu_dir = root / GPU
    gpu_dir.mkdir(parents=True)
    benches = [
        ("test_gemm_op_square[4096-float16]",
         gemm_entry(4096, 0.4, {"cuBLAS (torch)": t(0.2), "cuBLAS (CuPy)": None,
                                "Triton": t(0.25)})),
        ("test_gemm_op_square[8192-float16]",
         gemm_entry(8192, 3.0, {"cuBLAS (torch)": t(1.5), "cuBLAS (CuPy)": None,
                                "Triton": t(2.0)})),
        # the case: faster than cuBLAS on the GPU, 10× slower as called (host-bound)
        ("test_gemm_op_small",
         gemm_entry(512, 0.094, {"cuBLAS (torch)": t(0.1, called=0.1), "cuBLAS (CuPy)": None,
                                 "Triton": t(0.09, called=0.2)}, tilepy_called=1.0)),
        ("test_softmax_row_sweep[256-float32]",
         recorded(work=2 * 4096 * 256 * 4, unit="GB/s", main="torch",
                  timings={"tilepy": t(0.005, 500.0, True), "torch": t(0.01, 7.0, True),
                           "copy (ceiling)": t(0.004, 5.0, True)},
                  table="Softmax sweep", case="256 float32", figure="softmax_sweep_float32",
                  x=256, xlabel="row length")),
        ("test_softmax_row_sweep[512-float32]",
         recorded(work=2 * 4096 * 512 * 4, unit="GB/s", main="torch",
                  timings={"tilepy": t(0.008, 500.0, True), "torch": t(0.012, 7.0, True),
                           "Triton": t(0.009, 20.0, True), "copy (ceiling)": t(0.007, 5.0, True)},
                  table="Softmax sweep", case="512 float32", figure="softmax_sweep_float32",
                  x=512, xlabel="row length")),
        ("test_old_style", {"tflops": 100.0, "peer": "x", "peer_tflops": 200.0, "ratio": 0.5}),
    ]
    write_file(gpu_dir, "2026-01-01_bench.json", benches)
    if old:  # an older run of the same table and figure, from before the as-called timing
        write_file(gpu_dir, OLD_FILE, [
            ("test_gemm_op_square[4096-float16]", old_entry(4096, 0.4, 0.2)),
            ("test_gemm_op_square[8192-float16]", old_entry(8192, 3.0, 1.5)),
            ("test_gemm_op_square[1024-float16]", old_entry(1024, 0.01, 0.005)),  # old only
            ("test_old_attention", {**old_entry(1024, 0.5, 0.6), "table": "Attention (old)",
                                    "figure": "attention_old", "case": "old"}),
            ("test_old_attention2", {**old_entry(2048, 1.5, 2.0), "table": "Attention (old)",
                                     "figure": "attention_old", "case": "old 2"})])
    (gpu_dir / "2026-01-01_broken.json").write_text("{not json")
    return gpu_dir


def test_record_throughput_figures():
    info = gemm_entry(4096, 0.4, {"cuBLAS (torch)": t(0.2), "cuBLAS (CuPy)": None,
                                  "Triton": t(0.8)})
    tf = 2 * 4096**3 / 0.4 / 1e9
    assert info["unit"] == "TFLOPS" and info["tflops"] == pytest.approx(tf)
    assert info["peer"] == "cuBLAS (torch)" and info["ratio"] == pytest.approx(0.5)
    assert info["ratio_gpu"] == pytest.approx(0.5)
    assert info["impls"]["tilepy"] == pytest.approx(tf, rel=1e-3)
    assert info["impls"]["cuBLAS (CuPy)"] is None
    assert info["ratios"] == {"cuBLAS (torch)": 0.5, "cuBLAS (CuPy)": None, "Triton": 2.0}
    assert info["ratios_gpu"] == info["ratios"]  # nothing host-bound: the same ratios
    assert info["peer_errors"] == {"cuBLAS (CuPy)": "ImportError: no cupy"}
    assert info["host_hidden"] is True and info["flushed_l2"] is False
    assert info["ms"] == 0.4 and info["ms_as_called"] == 0.4
    assert info["ms_all"] == {"tilepy": 0.4, "cuBLAS (torch)": 0.2, "cuBLAS (CuPy)": None,
                              "Triton": 0.8}
    assert info["ms_as_called_all"] == info["ms_all"]
    assert info["impls_as_called"] == info["impls"]
    assert info["calls_as_called"] == {"tilepy": 20, "cuBLAS (torch)": 20, "Triton": 20}
    assert info["host_bound_as_called"] == []
    assert "as called" in info["timing_as_called"]
    json.dumps(info)  # pytest-benchmark stores it as JSON


def test_record_throughput_effective_ratios():
    """The issue's case: 1.06× cuBLAS on the GPU alone, 10× slower as called. ``ratio`` /
    ``ratios`` take each implementation's slower time; the GPU-only ones are kept."""
    info = gemm_entry(512, 0.094, {"cuBLAS (torch)": t(0.1, called=0.1), "cuBLAS (CuPy)": None,
                                   "Triton": t(0.09, called=0.2)}, tilepy_called=1.0)
    assert info["ratio_gpu"] == pytest.approx(0.1 / 0.094)  # the misleading 1.06×
    assert info["ratio"] == pytest.approx(0.1)  # 0.1 / max(0.094, 1.0)
    assert info["ratios"] == {"cuBLAS (torch)": 0.1, "cuBLAS (CuPy)": None, "Triton": 0.2}
    assert info["ratios_gpu"]["Triton"] == pytest.approx(0.09 / 0.094, abs=1e-4)
    assert info["ms"] == 0.094 and info["ms_as_called"] == 1.0
    tf = 2 * 512**3 / 1e9
    assert info["tflops"] == pytest.approx(tf / 0.094)
    assert info["tflops_as_called"] == pytest.approx(tf / 1.0)
    assert info["peer_tflops_as_called"] == pytest.approx(tf / 0.1)
    assert info["impls_as_called"]["Triton"] == pytest.approx(tf / 0.2, rel=1e-3)
    assert info["host_bound_as_called"] == ["tilepy", "Triton"]


def test_timing_is_backward_compatible():
    """Timing(ms, host_us, flushed, hidden) as before: no as-called time, the GPU-only one
    counts; record_throughput then writes the figures it wrote before, GPU-only."""
    old = measure.Timing(0.4, 10.0, False, True)
    assert old.ms_as_called is None and old.calls_as_called == 0
    assert old.effective_ms == 0.4 and not old.host_bound
    assert measure.Timing(0.4, 10.0, False, True, 0.43).host_bound is False  # within 10%
    assert measure.Timing(0.4, 10.0, False, True, 0.45).host_bound is True
    assert measure.Timing(0.4, 10.0, False, True, 0.3).effective_ms == 0.4
    info = recorded(work=2e9, unit="TFLOPS", main="peer",
                    timings={"tilepy": old, "peer": measure.Timing(0.2, 5.0, False, True)})
    assert "impls_as_called" not in info and "ms_as_called" not in info
    assert info["ratio"] == info["ratio_gpu"] == pytest.approx(0.5)
    assert not results_data.has_as_called(info)


def test_host_bound_threshold_is_shared():
    assert results_data.HOST_BOUND == measure.HOST_BOUND  # the reader marks what was recorded


def test_as_called_calls():
    # 2 ms at the slower of GPU time and host cost, at least 20 calls, at most 10 000
    assert measure.as_called_calls(1.0, 10.0) == 20
    assert measure.as_called_calls(0.01, 10.0) == 200
    assert measure.as_called_calls(0.01, 1000.0) == 20  # host-bound: 1 ms per call
    assert measure.as_called_calls(0.0, 0.0) == measure.AS_CALLED_MAX_CALLS
    assert measure.as_called_calls(5.0, 10.0, inner=50) == 50


def test_tables_and_figures(tmp_path):
    items = results_data.entries(write_results(tmp_path / "results"))
    assert [e.name for e in results_data.legacy(items)] == ["test_old_style"]
    tabs = results_data.tables(items)
    assert list(tabs) == ["GEMM: square", "Attention (old)", "Softmax sweep"]  # old file first
    gemm = tabs["GEMM: square"]
    assert gemm.impls == ["tilepy", "cuBLAS (torch)", "cuBLAS (CuPy)", "Triton"]
    assert gemm.peers == ["cuBLAS (torch)", "cuBLAS (CuPy)", "Triton"] and not gemm.host
    assert gemm.gpu_only_files == [OLD_FILE] and len(gemm.rows) == 6
    assert tabs["Softmax sweep"].host  # flushed runs show host µs per call
    assert tabs["Softmax sweep"].impls == ["tilepy", "torch", "copy (ceiling)", "Triton"]
    assert tabs["Softmax sweep"].gpu_only_files == []

    small = next(e.info for e in items if e.name == "test_gemm_op_small")
    eff = results_data.effective(small)
    tf = 2 * 512**3 / 1e9
    assert eff["tilepy"] == pytest.approx(tf / 1.0, rel=1e-3)  # as called, the slower
    assert eff["cuBLAS (torch)"] == pytest.approx(tf / 0.1, rel=1e-3)
    assert eff["Triton"] == pytest.approx(tf / 0.2, rel=1e-3) and eff["cuBLAS (CuPy)"] is None
    assert results_data.host_bound(small) == {"tilepy": True, "cuBLAS (torch)": False,
                                              "Triton": True}
    old = next(e.info for e in items if e.file == OLD_FILE)
    assert results_data.effective(old) == old["impls"] and results_data.host_bound(old) == {}

    figs = results_data.figures(items)
    sweep = figs["softmax_sweep_float32"]
    assert sweep.xs == [256, 512] and sweep.unit == "GB/s" and sweep.as_called
    assert sweep.series["Triton"][0] is None and sweep.series["Triton"][1] > 0
    square = figs["gemm_square_float16"]  # from the newest file only (not the old one)
    assert square.file == "2026-01-01_bench.json" and square.xs == [512, 4096, 8192]
    assert square.series["cuBLAS (torch)"] == pytest.approx(
        [tf / 0.1, 2 * 4096**3 / 0.2 / 1e9, 2 * 8192**3 / 1.5 / 1e9], rel=1e-3)
    assert square.series["tilepy"][0] == pytest.approx(tf / 1.0, rel=1e-3)  # effective
    assert square.host_bound["tilepy"] == [True, False, False]
    assert square.host_bound["Triton"] == [True, False, False]
    assert not figs["attention_old"].as_called  # an old file's figure: GPU-only
    assert figs["attention_old"].host_bound["tilepy"] == [False, False]

    md = "\n".join(report.suite_tables(items))
    assert "### GEMM: square" in md and "### Softmax sweep" in md
    assert "| file | case | tilepy (TFLOPS) | cuBLAS (torch) (TFLOPS) |" in md
    assert "ratio to cuBLAS (torch) | ratio to cuBLAS (CuPy) | ratio to Triton |" in md
    (row,) = [line for line in md.splitlines() if "| 4096³ float16 |" in line]
    assert "2026-01-01_bench" in row  # the latest result of the case; the older one left out
    assert "| 0.50× | - | 0.62× |" in row  # 0.2 / 0.4; CuPy missing; 0.25 / 0.4
    cases = [line.split(" | ")[1] for line in md.splitlines()
             if line.startswith("| 20") and "float16" in line]
    assert cases == ["4096³ float16", "8192³ float16", "512³ float16", "1024³ float16"]
    assert report.HOST_MARK not in row
    row = next(line for line in md.splitlines() if "| 512³ float16 |" in line)
    assert f"| {report.fmt(tf)}{report.HOST_MARK} | {report.fmt(tf / 0.1)} | - |" in row
    assert "| 0.10× | - | 0.20× |" in row  # effective ratios, not the GPU-only 1.06×
    assert "host µs/call tilepy" in md and "| 500 |" in md

    notes = [line for line in md.splitlines()
             if line.startswith(("Throughputs and ratios", "No row of this table"))]
    assert len(notes) == 3  # one under each table
    gemm_note, old_note, sweep_note = notes
    assert gemm_note.startswith("Throughputs and ratios use each implementation's slower")
    assert f"{report.HOST_MARK} host-bound as called" in gemm_note and "1.1×" in gemm_note
    assert "Older rows lack as-called figures" in gemm_note and OLD_FILE in gemm_note
    assert report.HOST_MARK not in sweep_note and "Older rows" not in sweep_note
    assert old_note.startswith("No row of this table has as-called figures")
    assert report.HOST_MARK not in old_note


def test_old_files_only_change_by_the_footnote(tmp_path):
    """A directory of old files only: the tables as before, plus the footnote."""
    gpu_dir = tmp_path / GPU
    gpu_dir.mkdir()
    write_file(gpu_dir, OLD_FILE, [("a", old_entry(4096, 0.4, 0.2)),
                                   ("b", old_entry(8192, 3.0, 1.5))])
    md = report.suite_tables(results_data.entries(gpu_dir))
    assert md[:3] == ["### GEMM: square", "",
                      report.table(["file", "case", "tilepy (TFLOPS)",
                                    "cuBLAS (torch) (TFLOPS)", "ratio to cuBLAS (torch)"],
                                   [[OLD_FILE, "4096³ float16", "344", "687", "0.50×"],
                                    [OLD_FILE, "8192³ float16", "367", "733", "0.50×"]])]
    assert md[3] == "" and md[4].startswith("No row of this table has as-called figures")
    assert "GPU-only time" in md[4] and md[5:] == [""]


def test_run_key_orders_files_by_when_they_were_measured():
    names = ["2026-11-30_s10c_bench.json", "2026-11-29_sweep_run1.json",
             "2026-12-01_s11f0_bench.json", "2026-11-30_s3_bench.json",
             "2026-11-29_s2_bench.json", "2026-12-01_s11f_bench.json", "notes.txt"]
    assert sorted(names, key=report.run_key) == [
        "notes.txt", "2026-11-29_sweep_run1.json", "2026-11-29_s2_bench.json",
        "2026-11-30_s3_bench.json", "2026-11-30_s10c_bench.json", "2026-12-01_s11f_bench.json",
        "2026-12-01_s11f0_bench.json"]


def test_latest_keeps_each_cases_newest_file_latest_run_first():
    e = results_data.Entry
    items = [e("2026-11-30_s10a_x.json", "a", {"table": "T", "case": "1"}),
             e("2026-11-30_s3_x.json", "a", {"table": "T", "case": "1"}),
             e("2026-11-30_s3_x.json", "b", {"table": "T", "case": "2"}),
             e("2026-11-30_s3_x.json", "c", {"table": "U", "case": "1"}),
             e("2026-11-30_s3_x.json", "d", {}),
             e("2026-11-30_s10a_x.json", "d", {})]
    assert [(x.file[11:15], x.name) for x in report.latest(items)] == [
        ("s10a", "a"), ("s10a", "d"), ("s3_x", "b"), ("s3_x", "c")]
    rows = [("2026-11-30_s3_x.json", "p", 1), ("2026-11-30_s3_x.json", "p", 2),
            ("2026-11-30_s3_x.json", "q", 3), ("2026-11-30_s10a_x.json", "p", 4)]
    assert report.latest_rows(rows) == [4, 3]  # p's older run left out whole


def test_tool_sections_show_each_problems_latest_run(tmp_path):
    """A sweep's rows of one problem all come from the latest run that measured it (the
    configs' ratios hold within a run); a problem only an older run measured keeps its rows."""
    gpu_dir = tmp_path / GPU
    gpu_dir.mkdir()

    def sweep(name, rows):
        (gpu_dir / name).write_text(json.dumps({"gpu": GPU, "rows": [
            {"shape": shape, "dtype": "float16", "config": config, "tflops": tf,
             "peer_tflops": 700.0, "ratio": tf / 700.0} for shape, config, tf in rows]}))

    sweep("2026-11-30_s3_sweep_gemm_shapes.json", [([4096] * 3, "old A", 500.0),
                                                   ([4096] * 3, "old B", 510.0),
                                                   ([8192] * 3, "old A", 600.0)])
    sweep("2026-11-30_s10b_sweep_gemm_shapes.json", [([4096] * 3, "new A", 650.0)])
    (gpu_dir / "2026-11-30_s3_overhead.json").write_text(json.dumps({"gpu": GPU, "rows": [
        {"name": "tilepy.gemm", "us_per_call": 20.0}, {"name": "torch.mm", "us_per_call": 9.0,
                                                       "peer": True}]}))
    (gpu_dir / "2026-11-30_s10b_overhead.json").write_text(json.dumps({"gpu": GPU, "rows": [
        {"name": "tilepy.gemm", "us_per_call": 12.0}]}))
    lines = "\n".join(report.tool_sections(gpu_dir)).splitlines()
    sweep_rows = [line for line in lines if line.startswith("| 2026") and "_sweep_" in line]
    assert [row.split(" | ")[2] for row in sweep_rows] == ["new A", "old A"]
    assert "s10b" in sweep_rows[0] and "4096×4096×4096" in sweep_rows[0]
    assert "s3" in sweep_rows[1] and "8192×8192×8192" in sweep_rows[1]
    host = [line for line in lines if "_overhead" in line]
    assert host == ["| 2026-11-30_s10b_overhead.json | tilepy.gemm | tilepy | 12 |",
                    "| 2026-11-30_s3_overhead.json | torch.mm | peer | 9.00 |"]


def test_ab_table_shows_both_trees_and_their_ratio(tmp_path):
    """bench/ab_commits.py's JSON: a row per case with A's and B's TFLOPS, B / A, each side's
    ratio to its peer and the rounds."""
    gpu_dir = tmp_path / GPU
    gpu_dir.mkdir()
    side = {"tflops": 700.0, "ms": 0.2, "peer_ms": 0.21, "ratio_to_peer": 1.05, "err": 1e-3,
            "ms_rounds": [0.2]}
    (gpu_dir / "2026-12-01_s13a_ab_gemm.json").write_text(json.dumps({
        "gpu": GPU, "a": ".ab/old", "b": ".", "rounds": 3, "rows": [
            {"suite": "gemm", "case": "4096x4096x4096", "A": side,
             "B": dict(side, tflops=693.0), "b_over_a": 0.99}]}))
    lines = "\n".join(report.tool_sections(gpu_dir)).splitlines()
    assert any(line.startswith("### A/B of two trees") for line in lines)
    assert ("| 2026-12-01_s13a_ab_gemm.json | gemm | 4096x4096x4096 | 700 | 693 | 0.99× | 1.05× "
            "| 1.05× | 3 |") in lines


def test_legacy_rows_with_as_called_figures(tmp_path, monkeypatch):
    """bench/test_bench_ptx.py records without tables: tflops / peer_tflops and their
    ``_as_called`` twins; the earlier-benchmarks table shows the slower, marked."""
    gpu_dir = tmp_path / GPU
    gpu_dir.mkdir()
    write_file(gpu_dir, "2026-01-02_ptx.json", [
        ("test_mma_sync_register_loop_tilepy",
         {"tflops": 500.0, "ms": 1.0, "ms_as_called": 2.0, "tflops_as_called": 250.0,
          "peer": "CUDA C++", "peer_tflops": 450.0, "peer_tflops_as_called": 440.0,
          "ratio": 250.0 / 450.0, "ratio_gpu": 500.0 / 450.0})])
    write_file(gpu_dir, OLD_FILE, [("test_old_style", {"tflops": 100.0, "peer": "x",
                                                       "peer_tflops": 200.0, "ratio": 0.5})])
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    lines = report.build().splitlines()
    row = next(line for line in lines if "test_mma_sync" in line)
    assert f"| 250 TFLOPS{report.HOST_MARK} | CUDA C++ | 440 TFLOPS | 0.56× |" in row
    assert "| 100 TFLOPS | x | 200 TFLOPS | 0.50× |" in next(
        line for line in lines if "test_old_style" in line)
    note = next(line for line in lines if line.startswith("Where a row has"))
    assert "host-bound as called" in note and OLD_FILE in note


def test_report_build_and_check(tmp_path, monkeypatch):
    results = tmp_path / "results"
    write_results(results)
    docs = tmp_path / "docs"
    docs.mkdir()
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "TARGET", docs / "performance.md")
    monkeypatch.setattr(report, "IMG", docs / "img")
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0 and report.main(["--check"]) == 0
    text = (docs / "performance.md").read_text()
    assert "## FAKE GPU" in text and "### GEMM: square" in text
    assert "test_old_style" in text  # results without tables are still listed
    assert "Where a row has" not in text  # no legacy row has as-called figures: no note
    assert f"{report.HOST_MARK} host-bound as called" in text
    assert "Older rows lack as-called figures" in text
    assert "Plots (`bench/plot.py`" not in text  # no PNGs yet
    assert "[`bench/NOTES.md`](" in text and "[`bench/results/FAKE_GPU/`](" in text
    old_rows = [line.split(" | ")[1] for line in text.splitlines()
                if line.startswith(f"| {OLD_FILE} |")]
    assert old_rows == ["1024³ float16", "old", "old 2"]  # cases no later run measured
    png = results_data.plot_path(docs / "img", GPU, "gemm_square_float16")
    png.parent.mkdir(parents=True)
    png.write_bytes(b"")
    assert report.main(["--check"]) == 1  # a new plot makes the page stale
    report.main([])
    text = (docs / "performance.md").read_text()
    link = "![gemm_square_float16](img/FAKE_GPU/gemm_square_float16.png)"
    assert link in text  # under its table, before the next one
    assert text.index("### GEMM: square") < text.index(link) < text.index("### Attention (old)")


@pytest.mark.parametrize("unit,value", [("ms", "0.316160"), ("us", "316.160000"),
                                        ("ns", "316160")])
def test_ncu_table_reads_the_duration_unit(tmp_path, unit, value):
    """ncu's raw CSV export picks the duration's unit per file (row 1): the table is in µs."""
    head = ["Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum",
            "smsp__inst_executed.sum"]
    f = tmp_path / "x_ncu_attention_raw.csv"
    f.write_text("\n".join([",".join(f'"{h}"' for h in head),
                             f'"","","","{unit}","inst"',
                             f'"tilepy::k","(1, 1, 1)","(128, 1, 1)","{value}","2,000,000"']))
    (row,) = report.ncu_table(f)
    assert row[1] == "tilepy" and row[3] == report.fmt(316.16) and row[4] == report.fmt(2.0)
    f.write_text(f.read_text().replace(f'"{unit}"', '"minute"'))
    with pytest.raises(ValueError, match="unknown unit"):
        report.ncu_table(f)


def test_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (the bench extra)")
    results = tmp_path / "results"
    write_results(results)
    written = plot.plot_all(results, tmp_path / "img")
    names = sorted(p.name for p in written)
    assert names == ["attention_old.png", "gemm_square_float16.png",
                     "softmax_sweep_float32.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_legend_says_which_time():
    fig = results_data.Figure("f", "TFLOPS", "x", "file", as_called=True)
    assert "slower of GPU-only and as-called" in plot.legend_title(fig)
    assert "GPU-only" in plot.legend_title(results_data.Figure("f", "TFLOPS", "x", "file"))


def test_plot_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    with pytest.raises(SystemExit, match="needs matplotlib"):
        plot.require_matplotlib()


class FakeEvent:
    def __init__(self, log, clock):
        self.log, self.clock, self.at = log, clock, None

    def record(self, stream=0):
        self.at = self.clock["gpu"]
        self.log.append("record")

    def query(self):
        return self.clock.pop("caught_up", False)

    def synchronize(self):
        pass


class FakeCuda:
    """Events whose elapsed times come from a list; ``query`` says the spin was over."""

    def __init__(self, log, elapsed, caught_up_once):
        self.log, self.elapsed = log, list(elapsed)
        self.clock = {"gpu": 0.0}
        if caught_up_once:
            self.clock["caught_up"] = True

    def event(self):
        return FakeEvent(self.log, self.clock)

    def event_elapsed_time(self, start, stop):
        return self.elapsed.pop(0)

    def get_current_device(self):
        class Dev:
            CLOCK_RATE = 1_000_000  # kHz: 1000 cycles per µs

        return Dev()


class FakeTorch:
    def __init__(self, log):
        self.log = log
        outer = self

        class Buf:
            def zero_(self):
                outer.log.append("flush")

        class Cuda:
            @staticmethod
            def synchronize():
                outer.log.append("sync")

            @staticmethod
            def _sleep(cycles):
                outer.log.append(("spin", cycles))

            @staticmethod
            def current_device():
                return 0

        self.cuda = Cuda
        self.uint8 = "uint8"
        self.empty = lambda *a, **k: Buf()


@pytest.mark.parametrize("caught_up_once", [False, True])
def test_gpu_time_logic(monkeypatch, caught_up_once):
    import numba

    log = []
    as_called_runs = [4.0, 6.0, 5.0, 40.0, 5.0]  # total ms of each as-called run (20 calls)
    fake = FakeCuda(log, [3.0, 1.0, 2.0] + as_called_runs,
                    caught_up_once)
    monkeypatch.setattr(numba, "cuda", fake)
    monkeypatch.setattr(measure, "_flush_buffer", {})
    measure._cycles_per_us.cache_clear()
    calls = []
    try:
        timing = measure.gpu_time(FakeTorch(log), lambda: calls.append(1), flush=True,
                                  repeat=3, warmup=2)
    finally:
        measure._cycles_per_us.cache_clear()
    n_called = measure.as_called_calls(2.0, timing.host_us)
    assert n_called == measure.AS_CALLED_MIN_CALLS == timing.calls_as_called
    # warm-up 2 + host measurement + one call per timed run (+ the retried run) + as called
    assert len(calls) == (2 + measure.HOST_CALLS + 3 + caught_up_once
                          + measure.AS_CALLED_REPEAT * n_called)
    # before every timed run, and before every as-called run
    assert log.count("flush") == 3 + caught_up_once + measure.AS_CALLED_REPEAT
    spins = [x[1] for x in log if isinstance(x, tuple)]
    assert spins[0] == 20_000 * 1000  # the host measurement's spin
    assert len(spins) == 1 + 3 + caught_up_once  # no spin ahead of an as-called run
    if caught_up_once:  # the first timed run is repeated with a 4× longer spin
        assert spins[2] == pytest.approx(4 * spins[1], abs=4)
    assert timing.ms == 2.0  # the median of the three timed runs' 3, 1, 2 ms
    assert timing.flushed and timing.hidden and timing.host_us >= 0
    assert timing.ms_as_called == pytest.approx(5.0 / n_called)  # median run / calls
    assert timing.effective_ms == 2.0 and not timing.host_bound
    # each as-called run: flush, then synchronise (GPU idle, nothing ahead), then the events
    tail = log[-4 * measure.AS_CALLED_REPEAT:]
    assert tail == ["flush", "sync", "record", "record"] * measure.AS_CALLED_REPEAT


def test_gpu_time_as_called_off(monkeypatch):
    """``as_called=False``: the GPU-only timing alone, as before (a Timing without it)."""
    import numba

    log = []
    monkeypatch.setattr(numba, "cuda", FakeCuda(log, [3.0, 1.0, 2.0], False))
    measure._cycles_per_us.cache_clear()
    calls = []
    try:
        timing = measure.gpu_time(FakeTorch(log), lambda: calls.append(1), repeat=3,
                                  warmup=2, as_called=False)
    finally:
        measure._cycles_per_us.cache_clear()
    assert len(calls) == 2 + measure.HOST_CALLS + 3
    assert timing.ms == 2.0 and timing.ms_as_called is None and timing.effective_ms == 2.0


def test_gpu_time_host_bound(monkeypatch):
    """A call whose host cost exceeds its GPU time: the as-called time is the slower one."""
    import numba

    log = []
    monkeypatch.setattr(numba, "cuda", FakeCuda(log, [0.1] * 3 + [20.0] * 5, False))
    monkeypatch.setattr(measure, "host_us_per_call", lambda torch, fn: 1000.0)
    measure._cycles_per_us.cache_clear()
    try:
        timing = measure.gpu_time(FakeTorch(log), lambda: None, repeat=3, warmup=2)
    finally:
        measure._cycles_per_us.cache_clear()
    assert timing.calls_as_called == 20  # 2 ms at 1 ms of host time per call, min 20
    assert timing.ms == 0.1 and timing.ms_as_called == pytest.approx(1.0)
    assert timing.effective_ms == pytest.approx(1.0) and timing.host_bound
