"""The benchmark tooling without a GPU: what the suites record (bench/measure.py), how it is
read back into tables (bench/results_data.py, bench/report.py) and plots (bench/plot.py), and
the timing loop's logic against a fake CUDA (L2 flush, host cost kept out of the events)."""

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


def t(ms, host_us=10.0, flushed=False):
    return measure.Timing(ms, host_us, flushed, True)


def gemm_entry(n, tilepy_ms, peers):
    return recorded(work=2 * n**3, unit="TFLOPS", main="cuBLAS (torch)",
                    timings={"tilepy": t(tilepy_ms), **peers}, dtype="float16",
                    table="GEMM: square", case=f"{n}³ float16", figure="gemm_square_float16",
                    x=n, xlabel="M = N = K", notes={"cuBLAS (CuPy)": "ImportError: no cupy"})


def write_results(root: pathlib.Path) -> pathlib.Path:
    gpu_dir = root / GPU
    gpu_dir.mkdir(parents=True)
    benches = [
        ("test_gemm_op_square[4096-float16]",
         gemm_entry(4096, 0.4, {"cuBLAS (torch)": t(0.2), "cuBLAS (CuPy)": None,
                                "Triton": t(0.25)})),
        ("test_gemm_op_square[8192-float16]",
         gemm_entry(8192, 3.0, {"cuBLAS (torch)": t(1.5), "cuBLAS (CuPy)": None,
                                "Triton": t(2.0)})),
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
    data = {"machine_info": {}, "commit_info": {}, "datetime": "2026-01-01", "version": "4",
            "benchmarks": [{"name": n, "extra_info": info, "stats": {}} for n, info in benches]}
    (gpu_dir / "2026-01-01_bench.json").write_text(json.dumps(data))
    (gpu_dir / "2026-01-01_broken.json").write_text("{not json")
    return gpu_dir


def test_record_throughput_figures():
    info = gemm_entry(4096, 0.4, {"cuBLAS (torch)": t(0.2), "cuBLAS (CuPy)": None,
                                  "Triton": t(0.8)})
    tf = 2 * 4096**3 / 0.4 / 1e9
    assert info["unit"] == "TFLOPS" and info["tflops"] == pytest.approx(tf)
    assert info["peer"] == "cuBLAS (torch)" and info["ratio"] == pytest.approx(0.5)
    assert info["impls"]["tilepy"] == pytest.approx(tf, rel=1e-3)
    assert info["impls"]["cuBLAS (CuPy)"] is None
    assert info["ratios"] == {"cuBLAS (torch)": 0.5, "cuBLAS (CuPy)": None, "Triton": 2.0}
    assert info["peer_errors"] == {"cuBLAS (CuPy)": "ImportError: no cupy"}
    assert info["host_hidden"] is True and info["flushed_l2"] is False
    json.dumps(info)  # pytest-benchmark stores it as JSON


def test_tables_and_figures(tmp_path):
    items = results_data.entries(write_results(tmp_path / "results"))
    assert [e.name for e in results_data.legacy(items)] == ["test_old_style"]
    tabs = results_data.tables(items)
    assert list(tabs) == ["GEMM: square", "Softmax sweep"]
    gemm = tabs["GEMM: square"]
    assert gemm.impls == ["tilepy", "cuBLAS (torch)", "cuBLAS (CuPy)", "Triton"]
    assert gemm.peers == ["cuBLAS (torch)", "cuBLAS (CuPy)", "Triton"] and not gemm.host
    assert tabs["Softmax sweep"].host  # flushed runs show host µs per call
    assert tabs["Softmax sweep"].impls == ["tilepy", "torch", "copy (ceiling)", "Triton"]

    figs = results_data.figures(items)
    sweep = figs["softmax_sweep_float32"]
    assert sweep.xs == [256, 512] and sweep.unit == "GB/s"
    assert sweep.series["Triton"][0] is None and sweep.series["Triton"][1] > 0
    assert figs["gemm_square_float16"].series["cuBLAS (torch)"] == pytest.approx(
        [2 * 4096**3 / 0.2 / 1e9, 2 * 8192**3 / 1.5 / 1e9], rel=1e-3)

    md = "\n".join(report.suite_tables(items))
    assert "### GEMM: square" in md and "### Softmax sweep" in md
    assert "| file | case | tilepy (TFLOPS) | cuBLAS (torch) (TFLOPS) |" in md
    assert "ratio to cuBLAS (torch) | ratio to cuBLAS (CuPy) | ratio to Triton |" in md
    row = next(line for line in md.splitlines() if "| 4096³ float16 |" in line)
    assert "| 0.50× | - | 0.62× |" in row  # 0.2 / 0.4; CuPy missing; 0.25 / 0.4
    assert "host µs/call tilepy" in md and "| 500 |" in md


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
    assert "### Plots" not in text  # no PNGs yet
    png = results_data.plot_path(docs / "img", GPU, "gemm_square_float16")
    png.parent.mkdir(parents=True)
    png.write_bytes(b"")
    assert report.main(["--check"]) == 1  # a new plot makes the page stale
    report.main([])
    assert "![gemm_square_float16](img/FAKE_GPU/gemm_square_float16.png)" in \
        (docs / "performance.md").read_text()


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
    assert names == ["gemm_square_float16.png", "softmax_sweep_float32.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    fake = FakeCuda(log, [3.0, 1.0, 2.0, 9.0], caught_up_once)
    monkeypatch.setattr(numba, "cuda", fake)
    monkeypatch.setattr(measure, "_flush_buffer", {})
    measure._cycles_per_us.cache_clear()
    calls = []
    try:
        timing = measure.gpu_time(FakeTorch(log), lambda: calls.append(1), flush=True,
                                  repeat=3, warmup=2)
    finally:
        measure._cycles_per_us.cache_clear()
    # warm-up 2 + host measurement + one call per timed run (+ the retried run)
    assert len(calls) == 2 + measure.HOST_CALLS + 3 + caught_up_once
    assert log.count("flush") == 3 + caught_up_once  # before every timed run
    spins = [x[1] for x in log if isinstance(x, tuple)]
    assert spins[0] == 20_000 * 1000  # the host measurement's spin
    if caught_up_once:  # the first timed run is repeated with a 4× longer spin
        assert spins[2] == pytest.approx(4 * spins[1], abs=4)
    assert timing.ms == 2.0  # the median of the three timed runs' 3, 1, 2 ms
    assert timing.flushed and timing.hidden and timing.host_us >= 0
