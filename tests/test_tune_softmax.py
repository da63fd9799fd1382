"""The softmax ops' config space (plans), their validation, the persisted choice and
ahead-of-time tuning (simulator: small rows, a fake timer, the real ``tilepy.softmax`` per
candidate)."""

import json

import numpy as np
import pytest

import tilepy
from tilepy.ops import softmax as sm
from tilepy.ops.softmax import Plan
from tilepy.testing.timing import preset_timer
from tilepy.tune import softmax_space as ss
from tilepy.tune.cache import TuneCache


@pytest.fixture(autouse=True)
def own_cache(isolated_tuning):
    """Every test here: its own tuning cache directory (tests/conftest.py)."""
    return isolated_tuning


def _paths(plans):
    return {p.path for p in plans}


def test_space_per_row_length_on_a_gpu():
    short = ss.softmax_space(1000, "float32", simulator=False)
    assert short[0] == sm.plan(1000, simulator=False, itemsize=4)      # built-in first
    assert _paths(short) == {"warp", "block"}
    assert {p.warps for p in short if p.path == "warp"} == set(ss.WARP_PATH_WARPS)
    medium, rejected = ss.softmax_space(5000, "float32", simulator=False, with_rejected=True)
    assert _paths(medium) == {"block", "online"}
    # 128 threads would keep 64 float32 values (256 bytes) per thread: pruned, with the reason
    assert any("256 bytes per thread" in why for _, why in rejected)
    assert not any(p.path == "block" and p.per_thread * 4 > sm.MAX_BYTES_PER_THREAD
                   for p in medium)
    # every block candidate loads at least one 16-byte vector per thread
    assert all(p.per_thread * 2 >= 16 for p in ss.softmax_space(2000, "float16",
                                                                 simulator=False)
               if p.path == "block")
    assert _paths(ss.softmax_space(100_000, "bfloat16", simulator=False)) == {"online"}
    assert len(set(medium)) == len(medium)


def test_the_simulator_space_keeps_blocks_small():
    for n in (7, 700, 3000, 50_000):
        plans = ss.softmax_space(n, "float16", simulator=True)
        assert plans and plans[0] == sm.plan(n, simulator=True, itemsize=2)
        assert max(p.threads for p in plans) <= 128


@pytest.mark.parametrize("plan,n,message", [
    (Plan("warp", 4, 8), 300, "covers rows of 256 values, 44 short of n = 300"),
    (Plan("block", 4, 4), 1000, "covers rows of 512 values"),
    (Plan("block", 8, 64), 10000, "256 bytes per thread in registers, 128 over"),
    (Plan("online", 64, 4), 10, "warps must be an int in 1 … 32"),
    (Plan("online", 4, 64), 10, "at most 32 values per thread per step"),
    (Plan("diagonal", 4, 4), 10, "path must be one of"),
    (Plan("warp", 4, 0), 10, "per_thread must be a positive int"),
])
def test_check_plan_says_which_constraint_fails(plan, n, message):
    with pytest.raises(ValueError, match=message):
        sm.check_plan(plan, n, 4, simulator=False)


def test_a_bad_config_is_refused_before_launch():
    x = np.zeros((3, 300), np.float32)
    with pytest.raises(ValueError, match="short of n = 300"):
        tilepy.softmax(x, config=Plan("warp", 4, 8))
    with pytest.raises(TypeError, match="Plan"):
        tilepy.log_softmax(x, config=(4, 8))


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="every candidate in the simulator")
@pytest.mark.parametrize("n,dtype", [(300, "float32"), (1500, "float16")])
def test_every_candidate_computes_the_softmax(n, dtype):
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, n)) * 4).astype(dtype)
    e = np.exp(x.astype(np.float64) - x.astype(np.float64).max(axis=1, keepdims=True))
    ref = e / e.sum(axis=1, keepdims=True)
    for p in ss.softmax_space(n, dtype):
        out = np.full_like(x, np.nan)
        tilepy.softmax(x, out=out, config=p)
        err = np.abs(out.astype(np.float64) - ref).max() / ref.max()
        assert err <= ss.TOL[dtype], (p, err)


def test_choices_round_trip_and_reject_what_no_longer_fits():
    p = Plan("block", 8, 16)
    fields = json.loads(json.dumps(ss.plan_fields(p)))
    assert ss.plan_from_fields(fields, 4000, "float32") == p
    assert ss.plan_from_fields(fields, 5000, "float32") is None        # rows too long for it
    assert ss.plan_from_fields({"path": "block"}, 4000, "float32") is None
    assert ss.plan_from_fields("nonsense", 4000, "float32") is None


def _store(p, rows, n, dtype):
    gpu = ss.current_gpu_name()
    TuneCache(ss.OP).put(ss.softmax_key(rows, n, dtype, gpu),
                            {"index": 1, "config": p.describe(), "ms": 1.0,
                             "fields": ss.plan_fields(p)})


def test_a_persisted_choice_is_per_bucket_and_dtype(monkeypatch):
    p = Plan("online", 2, 4)
    _store(p, 100, 3000, "float16")
    assert ss.tuned_softmax_plan(128, 4000, "float16") == p               # same buckets
    assert ss.tuned_softmax_plan(128, 4000, "float32") is None
    assert ss.tuned_softmax_plan(512, 4000, "float16") is None
    assert ss.tuned_softmax_plan(128, 5000, "float16") is None
    monkeypatch.setenv("TILEPY_AUTOTUNE", "0")
    ss.forget_choices()
    assert ss.tuned_softmax_plan(128, 4000, "float16") is None


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="small simulator problem; on a GPU use the CLI")
def test_tune_times_checks_persists_and_the_op_then_uses_it(tmp_path, monkeypatch):
    n = 700
    default = sm.plan(n, itemsize=4)
    other = Plan("block", 2, 16)
    assert other != default
    res = ss.tune_softmax(5, n, "float32", configs=[other], timer=preset_timer([2.0, 1.0]))
    assert res.config == other and res.saved
    assert [r["config"] for r in res.rows] == [default.describe(), other.describe()]
    assert all("first_call_s" in r and r["gbps"] > 0 for r in res.rows)
    assert "GB/s" in res.table and "*" in res.table
    (key,) = json.loads((tmp_path / "tune" / "softmax.json").read_text())
    assert key == res.key
    assert ss.tuned_softmax_plan(5, n, "float32") == other
    # softmax and log_softmax now run the tuned plan: prove it by the kernels they build
    built = []
    real = sm.kernel_for
    monkeypatch.setattr(sm, "kernel_for", lambda p, *a, **k: built.append(p) or real(p, *a, **k))
    x = np.random.default_rng(2).standard_normal((5, n)).astype(np.float32)
    for op in (tilepy.softmax, tilepy.log_softmax):
        out = np.full_like(x, np.nan)
        op(x, out=out)
        assert not np.isnan(out).any()
    assert built == [other, other]


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="small simulator problem")
def test_a_wrong_candidate_is_skipped_not_chosen(monkeypatch):
    other = Plan("block", 2, 16)
    real = tilepy.softmax

    def broken(x, *, out=None, config=None):
        got = real(x, out=out, config=config)
        if config == other:
            out[...] = 0
        return got

    monkeypatch.setattr(tilepy, "softmax", broken)
    res = ss.tune_softmax(3, 700, "float32", configs=[other], timer=preset_timer([2.0, 1.0]))
    assert res.config == sm.plan(700, itemsize=4)
    assert any(r.get("skipped") == "wrong answer" for r in res.rows)


def test_tune_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        ss.tune_softmax(4, 64, "float64")
    with pytest.raises(ValueError, match="n must be a positive int"):
        ss.tune_softmax(4, 0)
    with pytest.raises(ValueError, match="short of n"):
        ss.tune_softmax(4, 300, configs=[Plan("warp", 4, 1)])


@pytest.mark.gpu
def test_tune_softmax_on_the_gpu_persists_a_checked_winner():
    res = ss.tune_softmax(4096, 4096, "float16", warmup=1, repeat=3)
    assert res.saved and all("ms" in r for r in res.rows), res.table
