"""The Hopper GEMM kernel (wgmma over cp.async-fed, 128-byte-swizzled shared tiles): through
``tilepy.gemm(config=WgmmaConfig(...))`` in the simulator (the wgmma twin reads the shared
bytes the descriptors address), its sm_90a compile (registers, no spills), and on the GPU the
op's default path at full size against cuBLAS."""

import dataclasses
import math

import numpy as np
import pytest

import tilepy
from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ops.gemm_wgmma import WgmmaConfig

ml_dtypes = pytest.importorskip("ml_dtypes")
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def padded(rng, rows, cols, dtype, pad=6):
    """A (rows, cols) view with 16-byte-aligned rows (the kernels read rows in place)."""
    width = -(-(cols + pad) // 8) * 8
    return rng.standard_normal((rows, width)).astype(NP[dtype])[:, :cols]


def check(got, ref, dtype):
    got = np.asarray(got).astype(np.float64)
    assert not np.isnan(got).any(), "NaN or unwritten element"
    assert np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6) <= TOL[dtype]


@pytest.mark.sim
@pytest.mark.parametrize("dtype,b_layout,stages,overlap", [
    ("float16", "row", 2, False), ("bfloat16", "row", 2, False), ("float16", "col", 2, False),
    ("bfloat16", "col", 3, True), ("float16", "row", 3, True), ("float16", "row", 4, True)])
def test_odd_shapes_both_b_layouts(dtype, b_layout, stages, overlap):
    rng = np.random.default_rng()
    m, n, k = 70, 100, 258            # two block rows, two block columns, five k steps
    a = padded(rng, m, k, dtype)
    b = padded(rng, k, n, dtype) if b_layout == "row" else padded(rng, n, k, dtype).T
    out = np.full((m, n), np.nan, NP[dtype])
    tilepy.gemm(a, b, out=out, config=WgmmaConfig(64, 64, stages, dtype, overlap))
    check(out, a.astype(np.float64) @ b.astype(np.float64), dtype)


@pytest.mark.sim
def test_fused_epilogue_and_batch():
    rng = np.random.default_rng()
    z, m, n, k = 2, 40, 72, 64
    a = rng.standard_normal((z, m, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)          # broadcast over the batch
    bias = rng.standard_normal(n).astype(np.float32)
    c = rng.standard_normal((z, m, n)).astype(np.float32)
    got = tilepy.gemm(a, b, bias=bias, activation="gelu", beta=0.5, c=c, alpha=2.0,
                      out_dtype="float32", config=WgmmaConfig(64, 64, 2))
    pre = 2.0 * (a.astype(np.float64) @ b.astype(np.float64)) + 0.5 * c + bias
    ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    check(got, ref, "float16")


def test_config_validation():
    with pytest.raises(ValueError, match="overlap needs 3 or more stages"):
        WgmmaConfig(128, 128, 2, overlap=True)
    with pytest.raises(ValueError, match="block_n must be"):
        WgmmaConfig(128, 96)
    with pytest.raises(ValueError, match="exceeds the 232448 B of sm_90 by"):
        WgmmaConfig(256, 256, 4)
    assert WgmmaConfig().threads == 256 and WgmmaConfig(256, 128).warpgroups == 4
    with pytest.raises(ValueError, match="config is for bfloat16"):
        tilepy.gemm(np.ones((8, 8), np.float16), np.ones((8, 8), np.float16),
                    config=WgmmaConfig(dtype="bfloat16"))


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tilepy.ops.gemm_wgmma:compile_reports")
    assert set(reps) == {"gemm_wgmma_brow", "gemm_wgmma_bcol", "gemm_wgmma_brow_overlap"}
    for rep in reps.values():
        assert rep["arch"].startswith("sm_90a")
        c = rep["counts"]
        assert c["wgmma.mma_async"] >= 4 and c["cp.async"] >= 12 and c["ld.local"] == 0
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
        assert rep["registers"] <= 200, rep["registers"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_default_path_against_cublas(dtype):
    """On an H200 tilepy.gemm takes the wgmma kernel for big problems: odd sizes, both B
    layouts, a fused epilogue, repeated calls through the launch plan."""
    torch = pytest.importorskip("torch")
    from tilepy.ops import gemm as g

    if g.hopper_config(4096, 4096, 1, dtype) is None:
        pytest.skip("not a compute capability 9.0 GPU")
    from tilepy.ops.gemm_wgmma_ws import WsConfig

    # big problems take the warp-specialised TMA kernel, medium ones the cp.async wgmma kernel
    assert isinstance(g.hopper_config(4096, 4096, 1, dtype), WsConfig)
    assert isinstance(g.hopper_config(1536, 1536, 1, dtype), g.hw.WgmmaConfig)
    tdt = getattr(torch, dtype)
    for m, n, k, b_col in [(3000, 2056, 1000, False), (2500, 4000, 776, True),
                           (4096, 4096, 4096, False), (4096, 4096, 4096, False),
                           (4096, 4096, 4096, True), (1024, 1024, 1000, False)]:
        a = torch.randn(m, k, device="cuda", dtype=tdt)
        b = torch.randn(n, k, device="cuda", dtype=tdt).t() if b_col else \
            torch.randn(k, n, device="cuda", dtype=tdt)
        bias = torch.randn(n, device="cuda")
        got = tilepy.gemm(a, b, bias=bias, activation="relu")
        ref = torch.relu(a.double() @ b.double() + bias.double())
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < TOL[dtype], (m, n, k, b_col, err)


@pytest.mark.gpu
def test_gpu_batch_strides_not_16_byte_multiples():
    """A batched B whose matrices do not start 16-byte aligned (batch stride k·n + 1 elements):
    neither cp.async nor TMA can load it as it is, so the op copies it — and is still right."""
    torch = pytest.importorskip("torch")
    from tilepy.ops import gemm as g

    if g.hopper_config(4096, 4096, 1, "float16") is None:
        pytest.skip("not a compute capability 9.0 GPU")
    m, n, k, z = 1024, 2048, 512, 3
    a = torch.randn(z, m, k, device="cuda", dtype=torch.float16)
    flat = torch.randn(z * (k * n + 1), device="cuda", dtype=torch.float16)
    b = torch.as_strided(flat, (z, k, n), (k * n + 1, n, 1))
    got = tilepy.gemm(a, b)
    ref = a.double() @ b.double()
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < TOL["float16"]


@pytest.mark.parametrize("m,n,k,want", [
    (16, 4096, 4096, (64, 128, 4)),       # 32 column tiles, K in 4: 128 items
    (128, 4096, 4096, (64, 128, 2)),
    (128, 4096, 14336, (64, 128, 2)),     # 2 x 32 tiles, K in 2
    (256, 4096, 14336, (128, 128, 2)),    # fewer operand bytes per item than 64 x 128 whole
    (16, 14336, 4096, (64, 128, 1)),      # 112 tiles without a split
    (1, 4096, 14336, (64, 128, 4)),       # bandwidth wants many items
    (512, 4096, 4096, (128, 128, 1)),
    (1, 28672, 8192, (64, 256, 1)),
    (2048, 2048, 2048, (128, 256, 1)),    # 128 tiles: the persistent TMA-store default
    (4096, 4096, 4096, None)])            # a full wave of 128 x 256 tiles: not this rule's
def test_one_wave_config(m, n, k, want):
    """The small-problem rule of tilepy.gemm on sm_90 (gemm.one_wave_config, choices the s25
    measurements favoured): the modelled fastest of the tile x split-K candidates whose items
    fit one wave, 128-row tiles only past M = 64, splits of two k steps or more."""
    from tilepy.ops import gemm as g

    cfg = g.one_wave_config(m, n, k, 1, "bfloat16")
    if want is None:
        assert cfg is None
        return
    assert (cfg.block_m, cfg.block_n, cfg.splits) == want
    assert cfg.consumers == (1 if cfg.block_m == 64 else 2)
    assert cfg.tma_store == (want == (128, 256, 1))


def test_one_wave_candidates_reduce_in_clusters(monkeypatch):
    """``gemm.SPLIT_CLUSTER``: the one-wave candidates with splits take the cluster reduction
    where the other splits' accumulators fit their stages (every split tile of
    ONE_WAVE_TILES but 128 x 256 at 4 splits), the same tiles and splits otherwise."""
    from tilepy.ops import gemm as g

    plain = g.one_wave_candidates(128, 4096, 4096, 1, "bfloat16")
    monkeypatch.setattr(g, "SPLIT_CLUSTER", True)
    clustered = g.one_wave_candidates(128, 4096, 4096, 1, "bfloat16")
    assert [t for t, _ in plain] == [t for t, _ in clustered]
    assert any(c.splits > 1 for _, c in plain)
    for (_, p), (_, c) in zip(plain, clustered):
        assert dataclasses.replace(c, split_cluster=False) == p
        fits = p.splits > 1 and (p.splits - 1) * p.block_m * p.block_n * 4 <= \
            p.stages * p.stage_bytes
        assert c.split_cluster == fits, c
    assert g.cluster_split(g.ws.WsConfig(128, 256, 4, splits=4)).split_cluster is False


@pytest.mark.parametrize("m,n,want", [
    (1024, 14336, (128, 128)),    # 448 tiles of 128 x 256: 3.4 waves; 6.8 of 128 x 128
    (512, 28672, (128, 128)),
    (2048, 14336, (128, 256)),    # 896 tiles: 6.8 waves, 13.6 of 128 x 128
    (4096, 4096, (128, 256)),
    (2048, 4096, (128, 256))])    # two whole waves
def test_waves_config(m, n, want):
    """The many-tile rule of tilepy.gemm on sm_90 (gemm.waves_config): the persistent
    TMA-store tile of fewest modelled k-step time over its waves."""
    from tilepy.ops import gemm as g

    cfg = g.waves_config(m, n, 1, "bfloat16")
    assert (cfg.block_m, cfg.block_n) == want
    assert cfg.persistent and cfg.tma_store
