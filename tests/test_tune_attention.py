"""The attention op's config space, persisted choice and ahead-of-time tuning (simulator: a
tiny problem, a fake timer, the real ``tilepy.flash_attention`` per candidate)."""

import json

import numpy as np
import pytest

import tilepy
from tilepy.ops.attention_mma_sync import AttentionConfig
from tilepy.ops.attention_wgmma import WgmmaAttentionConfig
from tilepy.testing.timing import preset_timer
from tilepy.tune import attention_space as ats
from tilepy.tune.cache import TuneCache


@pytest.fixture(autouse=True)
def own_cache(isolated_tuning):
    """Every test here: its own tuning cache directory (tests/conftest.py)."""
    return isolated_tuning


def test_space_per_head_dim_and_device():
    h100 = ats.attention_space(128, "bfloat16", (9, 0))
    assert isinstance(h100[0], WgmmaAttentionConfig)          # the wgmma kernel first on sm_90
    assert {type(c) for c in h100} == {WgmmaAttentionConfig, AttentionConfig}
    assert all(c.dtype == "bfloat16" and c.head_dim == 128 for c in h100)
    assert not any(getattr(c, "warp_rows", 16) == 32 for c in h100)   # spills at d > 64
    from tilepy.ops.attention import HOPPER_CHOICE

    d64 = ats.attention_space(64, "bfloat16", (9, 0))
    for causal in (False, True):   # the built-in configs are candidates too
        assert WgmmaAttentionConfig(128, dtype="bfloat16", **HOPPER_CHOICE[(128, causal)]) in h100
        assert WgmmaAttentionConfig(64, dtype="bfloat16", **HOPPER_CHOICE[(64, causal)]) in d64
    a100 = ats.attention_space(64, "float16", (8, 0))
    assert all(isinstance(c, AttentionConfig) for c in a100)
    assert any(c.warp_rows == 32 for c in a100)
    # head_dim 96: the TMA wgmma kernels only (the cp.async ones are 64 / 128) — the built-in
    # choice among them — and mma.sync; nothing invalid
    d96, rejected = ats.attention_space(96, "float16", (9, 0), with_rejected=True)
    wg96 = [c for c in d96 if isinstance(c, WgmmaAttentionConfig)]
    assert wg96 and all(c.tma for c in wg96) and any(isinstance(c, AttentionConfig) for c in d96)
    assert WgmmaAttentionConfig(96, dtype="float16", **HOPPER_CHOICE[(128, False)]) in d96
    assert any("wgmma" in what for what, _ in rejected)


def test_choices_round_trip_and_reject_what_no_longer_fits():
    for cfg in (WgmmaAttentionConfig(128, 128, 64, "float16"),
                WgmmaAttentionConfig(128, 128, 128, "float16", overlap=True, tma=True,
                                     pingpong=True, producer=True),
                AttentionConfig(64, 128, 64, 32, "float16", (9, 0))):
        fields = json.loads(json.dumps(ats.config_fields(cfg)))
        assert ats.config_from_fields(fields, "float16", cfg.head_dim) == cfg
        assert ats.config_from_fields(fields, "float16", 32) is None          # other head_dim
    assert ats.config_from_fields({"kind": "wgmma", "head_dim": 128, "block_m": 96},
                                  "float16", 128) is None
    assert ats.config_from_fields("nonsense", "float16", 64) is None
    with pytest.raises(TypeError):
        ats.config_fields(object())


def _store(cfg, b, h, sq, sk, d, dtype, causal):
    gpu = ats.current_gpu_name()
    TuneCache(ats.OP).put(ats.attention_key(b, h, sq, sk, d, dtype, causal, gpu),
                              {"index": 1, "config": "x", "ms": 1.0,
                               "fields": ats.config_fields(cfg)})


def test_a_persisted_choice_is_per_bucket_and_causal_flag(monkeypatch):
    cfg = AttentionConfig(64, 64, 64, 16, "float16")
    _store(cfg, 2, 8, 1000, 1000, 64, "float16", True)
    assert ats.tuned_attention_config(2, 8, 1024, 1024, 64, "float16", True) == cfg
    assert ats.tuned_attention_config(2, 8, 1024, 1024, 64, "float16", False) is None
    assert ats.tuned_attention_config(2, 8, 4096, 1024, 64, "float16", True) is None
    assert ats.tuned_attention_config(2, 8, 1024, 1024, 64, "bfloat16", True) is None
    monkeypatch.setenv("TILEPY_AUTOTUNE", "0")
    ats.forget_choices()
    assert ats.tuned_attention_config(2, 8, 1024, 1024, 64, "float16", True) is None




@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="tiny simulator problem; on a GPU use the CLI")
@pytest.mark.parametrize("causal", [False, True])
def test_tune_times_checks_persists_and_the_op_then_uses_it(tmp_path, monkeypatch, causal):
    from tilepy.ops import attention as att

    default = att.choose_config(32, "float16")
    other = AttentionConfig(32, 16, 16, 16, "float16")
    assert other != default
    res = ats.tune_attention(1, 2, 20, 33, 32, "float16", causal, heads_kv=1,
                             configs=[other], timer=preset_timer([2.0, 1.0]))
    assert res.config == other and res.saved
    assert [r["config"] for r in res.rows] == [default.describe(), other.describe()]
    assert all("first_call_s" in r and "tflops" in r for r in res.rows)
    assert "*" in res.table and "attention" in res.table
    data = json.loads((tmp_path / "tune" / "attention.json").read_text())
    (key,) = data
    assert key == res.key and ("-causal|" in key) == causal
    assert ats.tuned_attention_config(1, 2, 20, 33, 32, "float16", causal) == other
    # the op now runs the tuned config: prove it by the kernel it builds
    built = []
    real = att.fa.attention_kernel
    monkeypatch.setattr(att.fa, "attention_kernel",
                        lambda cfg, *a, **k: built.append(cfg) or real(cfg, *a, **k))
    att._PLANS.clear()
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 20, 32)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 33, 32)).astype(np.float16) for _ in range(2))
    out = np.full_like(q, np.nan)
    tilepy.flash_attention(q, k, v, causal=causal, out=out)
    att._PLANS.clear()
    assert built and built[0] == other
    assert not np.isnan(out.astype(np.float32)).any()


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="tiny simulator problem")
def test_a_wrong_candidate_is_skipped_not_chosen(monkeypatch):
    from tilepy.ops import attention as att

    other = AttentionConfig(32, 16, 16, 16, "float16")
    real = att.flash_attention

    def broken(q, k, v, *, config=None, out=None, **kw):
        got = real(q, k, v, config=config, out=out, **kw)
        if config == other:
            out[...] = 0          # a wrong answer from this candidate
        return got

    monkeypatch.setattr(tilepy, "flash_attention", broken)
    res = ats.tune_attention(1, 1, 17, 17, 32, "float16", configs=[other],
                             timer=preset_timer([2.0, 1.0]))
    assert res.config == att.choose_config(32, "float16")


def test_tune_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        ats.tune_attention(1, 1, 16, 16, 64, "float32")
    with pytest.raises(ValueError, match="seq_q must be a positive int"):
        ats.tune_attention(1, 1, 0, 16, 64)
    with pytest.raises(TypeError, match="head_dim 64 and float16"):
        ats.tune_attention(1, 1, 16, 16, 64, configs=[AttentionConfig(32)])


@pytest.mark.gpu
def test_tune_attention_on_the_gpu_persists_a_checked_winner():
    configs = ats.attention_space(64, "float16")[:3]
    res = ats.tune_attention(2, 4, 512, 512, 64, "float16", True, configs=configs, warmup=1,
                             repeat=3)
    assert res.saved and all("ms" in r for r in res.rows), res.table
    assert res.key.split("|")[3] == ats.current_gpu_name() != "simulator"
    assert ats.tuned_attention_config(2, 4, 512, 512, 64, "float16", True) == res.config
