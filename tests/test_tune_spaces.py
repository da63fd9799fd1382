"""Built-in GEMM config space, the persisted choice an op call uses, and ahead-of-time tuning
(in the simulator: a tiny problem, a fake timer, the real ``tilepy.gemm`` per candidate)."""

import json

import numpy as np
import pytest

import tilepy
from tilepy.ops.gemm import choose_config
from tilepy.testing.timing import preset_timer
from tilepy.tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout
from tilepy.tune import spaces
from tilepy.tune.cache import TuneCache


@pytest.fixture(autouse=True)
def own_cache(isolated_tuning):
    """Every test here: its own tuning cache directory (tests/conftest.py)."""
    return isolated_tuning


# ---- the space -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_candidate_fits_an_h200(dtype):
    configs, rejected = spaces.gemm_space(dtype, (9, 0), with_rejected=True)
    assert len(configs) == len(spaces.GEMM_TILES) * len(spaces.GEMM_STAGES) and not rejected
    assert all(c.dtype == dtype and c.smem_bytes <= 227 * 1024 for c in configs)
    assert len(set(configs)) == len(configs)
    assert {c.warp_m for c in configs} >= {32, 64} and {c.block.k for c in configs} == {32, 64}


def test_device_limits_prune_before_anything_compiles(monkeypatch):
    configs, rejected = spaces.gemm_space("float16", (8, 6), with_rejected=True)
    assert configs and all(c.smem_bytes <= 99 * 1024 for c in configs)
    assert rejected and all("shared memory" in why for _, why in rejected)
    # a 64x128 warp tile needs more registers than a thread may have
    monkeypatch.setattr(spaces, "GEMM_TILES", (((128, 256, 32), (2, 2)),))
    configs, rejected = spaces.gemm_space("float16", (9, 0), with_rejected=True)
    assert configs == [] and all("registers" in why for _, why in rejected)


def test_the_problem_size_prunes_oversized_tiles():
    small = spaces.gemm_space("float16", (9, 0), 64, 64, 64)
    assert small and all(c.block.m <= 128 and c.block.n <= 128 for c in small)
    assert all(c.pipeline.stages - 1 <= -(-64 // c.block.k) for c in small)
    assert len(small) < len(spaces.gemm_space("float16", (9, 0), 4096, 4096, 4096))


# ---- the choice an op call uses -------------------------------------------------------------

HEURISTIC = GemmConfig(BlockTile(128, 128, 32), WarpLayout(2, 2), Pipeline(4))
TUNED = GemmConfig(BlockTile(128, 256, 64), WarpLayout(2, 4), Pipeline(3))


def _store(m, n, k, batch, dtype, fields):
    gpu = spaces.current_gpu_name()
    TuneCache("gemm").put(spaces.gemm_key(m, n, k, batch, dtype, gpu),
                                 {"index": 1, "config": "x", "ms": 1.0, "fields": fields})


def test_no_tuned_choice_means_the_heuristic():
    assert spaces.pick_gemm_config(4096, 4096, 4096, 1, "float16", HEURISTIC) is HEURISTIC


def test_a_persisted_choice_is_used_for_its_shape_bucket_only():
    _store(4096, 4096, 4096, 1, "float16", spaces.config_fields(TUNED))
    assert spaces.pick_gemm_config(4000, 4096, 4096, 1, "float16", HEURISTIC) == TUNED
    assert spaces.pick_gemm_config(1024, 4096, 4096, 1, "float16", HEURISTIC) is HEURISTIC
    assert spaces.pick_gemm_config(4096, 4096, 4096, 1, "bfloat16", HEURISTIC) is HEURISTIC


def test_autotune_off_ignores_the_cache(monkeypatch):
    _store(4096, 4096, 4096, 1, "float16", spaces.config_fields(TUNED))
    monkeypatch.setenv("TILEPY_AUTOTUNE", "0")
    assert spaces.pick_gemm_config(4096, 4096, 4096, 1, "float16", HEURISTIC) is HEURISTIC


@pytest.mark.parametrize("fields", [{"block": [128, 128]}, {"block": [100, 128, 32],
                                    "warps": [2, 2], "stages": 3}, "not a dict"])
def test_a_malformed_or_invalid_entry_falls_back_to_the_heuristic(fields):
    _store(4096, 4096, 4096, 1, "float16", fields)
    assert spaces.pick_gemm_config(4096, 4096, 4096, 1, "float16", HEURISTIC) is HEURISTIC


def test_the_file_is_read_once_per_process(tmp_path):
    assert spaces.pick_gemm_config(256, 256, 256, 1, "float16", HEURISTIC) is HEURISTIC
    _store(256, 256, 256, 1, "float16", spaces.config_fields(TUNED))  # another process, say
    assert spaces.pick_gemm_config(256, 256, 256, 1, "float16", HEURISTIC) is HEURISTIC
    spaces.forget_choices()
    assert spaces.pick_gemm_config(256, 256, 256, 1, "float16", HEURISTIC) == TUNED


def test_an_unreadable_tuning_file_means_the_heuristic(tmp_path):
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "gemm.json").write_text("{broken")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert spaces.pick_gemm_config(64, 64, 64, 1, "float16", HEURISTIC) is HEURISTIC


# ---- ahead-of-time tuning (simulator) -------------------------------------------------------



@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="tiny simulator problem; on a GPU use the CLI")
def test_tune_gemm_times_checks_persists_and_the_op_then_uses_it(tmp_path):
    heuristic = choose_config(32, 32, 32, 1, "float16")
    other = GemmConfig(BlockTile(32, 32, 32), WarpLayout(2, 1), Pipeline(2))
    assert other != heuristic
    res = spaces.tune_gemm(32, 32, 32, "float16", configs=[other, heuristic],
                           timer=preset_timer([2.0, 1.0]))
    assert res.config == other and res.saved
    assert [r["config"] for r in res.rows] == [heuristic.describe(), other.describe()]
    assert all("first_call_s" in r and "tflops" in r for r in res.rows)
    assert "*" in res.table and other.describe() in res.table
    data = json.loads((tmp_path / "tune" / "gemm.json").read_text())
    (key,) = data
    assert key == res.key and key.startswith("gemm|32x32x32x16|float16|simulator|")
    assert data[key]["fields"] == spaces.config_fields(other)
    assert spaces.pick_gemm_config(32, 32, 32, 1, "float16", heuristic) == other


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="tiny simulator problem; on a GPU use the CLI")
def test_tune_gemm_bfloat16_batched_default_space_keeps_the_heuristic_when_it_wins():
    res = spaces.tune_gemm(16, 16, 16, "bfloat16", batch=2,
                           configs=[GemmConfig(BlockTile(32, 32, 16), WarpLayout(1, 1),
                                               Pipeline(2), "bfloat16")],
                           timer=preset_timer([1.0, 3.0]))
    assert res.config == choose_config(16, 16, 16, 2, "bfloat16")
    assert res.key.startswith("gemm|16x16x16x16|bfloat16|simulator|")


def test_the_hopper_space_comes_first_on_sm90_only():
    from tilepy.ops.gemm_wgmma import WgmmaConfig
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    big = spaces.gemm_space("bfloat16", (9, 0), 4096, 4096, 4096, hopper=True)
    kinds = [type(c) for c in big[:len(spaces.HOPPER_CANDIDATES)]]
    assert WsConfig in kinds and WgmmaConfig in kinds and all(c.dtype == "bfloat16" for c in big)
    assert isinstance(big[-1], GemmConfig)
    assert not any(isinstance(c, (WsConfig, WgmmaConfig))
                   for c in spaces.gemm_space("float16", (8, 0), 4096, 4096, 4096, hopper=True))
    assert not any(isinstance(c, (WsConfig, WgmmaConfig))
                   for c in spaces.gemm_space("float16", (9, 0), 4096, 4096, 4096))
    # no 256-wide tile for a 64-column output
    assert all(c.block_n <= 128 for c in spaces.hopper_space("float16", 4096, 64))
    # a decode-sized problem: the op's small-problem candidates (tiles x split-K) first, the
    # op's own choice among them
    from tilepy.ops import gemm as g

    small = spaces.hopper_space("bfloat16", 16, 4096, 4096)
    first = [c for _, c in g.one_wave_candidates(16, 4096, 4096, 1, "bfloat16")]
    # the swapped-operand configs (16-row tiles of outᵀ) ahead of them, the op's choice first
    swapped = g.swapped_candidates(16, 4096, 4096, 1, "bfloat16")
    assert small[:len(swapped)] == swapped
    assert swapped[0] == g.swapped_config(16, 4096, 4096, 1, "bfloat16")
    assert swapped[0].block_n == 16 and swapped[0].splits == 4
    assert [(c.block_m, c.splits) for c in swapped] == [(128, 4), (128, 2), (128, 8), (64, 2)]
    assert all(c.swap_ab for c in swapped) and len(set(swapped)) == len(swapped)
    small = small[len(swapped):]
    assert any(c.splits > 1 for c in first) and small[:len(first)] == first
    assert g.one_wave_config(16, 4096, 4096, 1, "bfloat16") in first
    assert len(small) == len(set(small))
    assert not any(getattr(c, "splits", 1) > 1 or getattr(c, "swap_ab", False)
                   for c in spaces.hopper_space("bfloat16", 4096, 4096, 4096))


def test_a_persisted_hopper_choice_round_trips_and_needs_sm90():
    from tilepy.ops.gemm_wgmma import WgmmaConfig
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    like90 = GemmConfig(BlockTile(128, 128, 32), WarpLayout(2, 2), Pipeline(3), "bfloat16",
                        True, (9, 0))
    like80 = GemmConfig(BlockTile(128, 128, 32), WarpLayout(2, 2), Pipeline(3), "bfloat16",
                        True, (8, 0))
    for cfg in (WsConfig(256, 128, 4, "bfloat16", persistent=True),
                WgmmaConfig(128, 256, 4, "bfloat16", overlap=True)):
        fields = json.loads(json.dumps(spaces.config_fields(cfg)))   # as the file stores it
        assert spaces.config_from_fields(fields, like90) == cfg
        assert spaces.config_from_fields(fields, like80) is None
    assert spaces.config_from_fields({"kind": "wgmma_ws", "block_n": 100}, like90) is None
    assert spaces.config_from_fields({"kind": "nonsense"}, like90) is None


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="tiny simulator problem; on a GPU use the CLI")
def test_a_tuned_hopper_choice_is_what_the_op_runs(tmp_path, monkeypatch):
    """A persisted WsConfig for a problem too small for the Hopper default: the op runs it
    (the choice comes before the heuristics), and the answer is right."""
    from tilepy.ops import gemm as g
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    cfg = WsConfig(dtype="float16")
    _store(70, 100, 264, 1, "float16", spaces.config_fields(cfg))
    ran = []
    real = g.ws.wgmma_ws_gemm_kernel
    monkeypatch.setattr(g.ws, "wgmma_ws_gemm_kernel",
                        lambda c, *a, **k: ran.append(c) or real(c, *a, **k))
    g._PLANS.clear()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((70, 264)).astype(np.float16)
    b = rng.standard_normal((264, 104)).astype(np.float16)[:, :100]
    got = tilepy.gemm(a, b)
    g._PLANS.clear()
    assert ran == [cfg]
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-3


def test_tune_gemm_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        spaces.tune_gemm(64, 64, 64, "float32")
    with pytest.raises(ValueError, match="m must be a positive int"):
        spaces.tune_gemm(0, 64, 64)
    with pytest.raises(TypeError, match="WsConfig for float16"):
        spaces.tune_gemm(64, 64, 64, configs=[GemmConfig(dtype="bfloat16")])


def test_gemm_inputs_in_the_simulator_are_numpy():
    if not tilepy.SIMULATOR:
        pytest.skip("simulator inputs")
    a, b, out, to_host = spaces.gemm_inputs(8, 4, 16, "bfloat16", batch=3)
    assert a.shape == (3, 8, 16) and b.shape == (3, 16, 4) and out.shape == (3, 8, 4)
    assert to_host(a).dtype == np.float32 and str(a.dtype) == "bfloat16"


@pytest.mark.gpu
def test_tune_gemm_on_the_gpu_persists_a_checked_winner():
    heuristic = choose_config(256, 256, 256, 1, "float16")
    configs = spaces.gemm_space("float16", m=256, n=256, k=256)[:2]
    res = spaces.tune_gemm(256, 256, 256, "float16", configs=configs, warmup=1, repeat=3)
    assert res.saved and all("ms" in r for r in res.rows), res.table
    assert res.key.split("|")[3] == spaces.current_gpu_name() != "simulator"
    assert spaces.pick_gemm_config(256, 256, 256, 1, "float16", heuristic) == res.config
