"""Autotuner and tuning cache: choice, persistence, failures, corruption, read-only, concurrency."""

import json
import multiprocessing
import os
import stat

import pytest

from tilepy.tune import TuneCache, autotune, make_key, shape_bucket


def fake_timer(times):
    """A timer that reports the preset milliseconds of each config (by its value)."""
    def timer(fn, warmup, repeat):
        return times[fn()]
    return timer


def make(tmp_path, times, **kw):
    calls = []

    def launch(cfg, x):
        calls.append(cfg)
        if cfg == "broken":
            raise RuntimeError("does not compile")
        return cfg

    tuned = autotune(launch, list(times), key=lambda x: ((x,), "float16"), op="toy",
                     timer=fake_timer(times), gpu_name=lambda: "TestGPU",
                     cache_directory=str(tmp_path), **kw)
    return tuned, calls


def test_picks_the_fastest_and_remembers_it_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    tuned, calls = make(tmp_path, {"a": 3.0, "b": 1.0, "c": 2.0})
    assert tuned(100) == "b"
    n = len(calls)
    assert tuned(100) == "b" and len(calls) == n + 1  # cached in memory: one launch, no timing
    fresh, calls2 = make(tmp_path, {"a": 3.0, "b": 1.0, "c": 2.0})  # a new process, say
    assert fresh(120) == "b" and calls2 == ["b"]  # same bucket (128): read from disk
    data = json.loads((tmp_path / "tune" / "toy.json").read_text())
    (key,) = data
    assert key.startswith("toy|128|float16|TestGPU|") and data[key]["config"] == "'b'"


def test_failing_and_wrong_candidates_are_skipped_and_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEPY_VERBOSE", "1")
    times = {"broken": 0.1, "wrong": 0.2, "ok": 5.0}
    tuned, _ = make(tmp_path, times, reference=lambda cfg, x: cfg != "wrong")
    assert tuned(7) == "ok"
    report = {r["config"]: r for r in tuned.last_report}
    assert "does not compile" in report["'broken'"]["skipped"]
    assert report["'wrong'"]["skipped"] == "wrong answer"
    err = capsys.readouterr().err
    assert "skipped" in err and "'ok'" in err


def test_every_candidate_failing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    tuned, _ = make(tmp_path, {"broken": 1.0})
    with pytest.raises(RuntimeError, match="every candidate config failed"):
        tuned(1)


def test_prune_and_autotune_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    tuned, _ = make(tmp_path, {"a": 3.0, "b": 1.0}, prune=lambda cfg, x: cfg != "b")
    assert tuned(5) == "a"
    monkeypatch.setenv("TILEPY_AUTOTUNE", "0")
    tuned2, calls = make(tmp_path / "other", {"a": 3.0, "b": 1.0})
    assert tuned2(5) == "a" and calls == ["a"]  # the heuristic (first) config, no timing
    assert not (tmp_path / "other" / "tune").exists()


def test_corrupt_file_is_set_aside_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "toy.json").write_text("{not json")
    tuned, _ = make(tmp_path, {"a": 1.0})
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert tuned(3) == "a"
    assert json.loads((tmp_path / "tune" / "toy.json").read_text())
    assert any(p.name.startswith("toy.json.corrupt-") for p in (tmp_path / "tune").iterdir())


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True,
                    reason="root can write anywhere: chmod cannot make a directory read-only")
def test_read_only_directory_warns_once_and_still_works(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    tuned, _ = make(ro, {"a": 1.0, "b": 2.0})
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert tuned(3) == "a"
    assert tuned(300) == "a"  # no second warning, no crash


def test_unwritable_cache_path_warns_once_and_still_works(tmp_path, monkeypatch):
    # works as root too: the cache "directory" is a regular file
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    blocker = tmp_path / "file"
    blocker.write_text("")
    tuned, _ = make(blocker, {"a": 1.0, "b": 2.0})
    with pytest.warns(RuntimeWarning, match="tuning cache") as record:
        assert tuned(3) == "a"
    assert len(record) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned(3000) == "a"


def _writer(directory, worker, n):
    cache = TuneCache("shared", directory)
    for i in range(n):
        assert cache.put(f"w{worker}-{i}", {"worker": worker, "i": i})


def test_concurrent_writers_lose_nothing(tmp_path):
    procs = [multiprocessing.Process(target=_writer, args=(str(tmp_path), w, 15))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = TuneCache("shared", str(tmp_path)).entries()
    assert len(data) == 60 and data["w3-14"] == {"worker": 3, "i": 14}


def test_keys_bucket_shapes_and_name_the_context():
    assert shape_bucket(1) == 16 and shape_bucket(17) == 32 and shape_bucket(4096) == 4096
    assert make_key("gemm", (4000, 100), "bfloat16", "NVIDIA H200", "0.1.0") == \
        "gemm|4096x128|bfloat16|NVIDIA H200|0.1.0"


def test_default_timer_in_the_simulator_is_the_wall_clock(tmp_path, monkeypatch):
    import time

    from numba import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("on a GPU the default timer is CUDA events")
    monkeypatch.setenv("TILEPY_VERBOSE", "0")
    tuned = autotune(lambda cfg, x: time.sleep(cfg), [0.02, 0.0], key=lambda x: ((x,), "f"),
                     op="sleep", gpu_name=lambda: "sim", cache_directory=str(tmp_path),
                     warmup=0, repeat=3)
    assert tuned.choose(1) == 0.0
    assert tuned.last_report[0]["ms"] >= 15
