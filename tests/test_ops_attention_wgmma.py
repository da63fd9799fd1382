"""The Hopper (wgmma) FlashAttention kernel through ``tilepy.flash_attention(config=
WgmmaAttentionConfig(...))``: simulator runs against float64 (the wgmma twins read the
swizzled shared tiles the descriptors address), the sm_90a compile, and on the GPU full size
against SDPA."""

import numpy as np
import pytest
from test_ops_attention import NP, check, check_lse, rand, reference

import tilepy
from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ops.attention_wgmma import OVERLAP_REPORTS, WgmmaAttentionConfig


def run(rng, b, hq, hk, sq, sk, d, causal, layout, dtype, cfg):
    shq = (b, hq, sq, d) if layout == "bhsd" else (b, sq, hq, d)
    shk = (b, hk, sk, d) if layout == "bhsd" else (b, sk, hk, d)
    q, k, v = rand(rng, shq, dtype), rand(rng, shk, dtype), rand(rng, shk, dtype)
    out = np.full(shq, np.nan, NP[dtype])
    o, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True, layout=layout,
                                    out=out, config=cfg)
    assert o is out
    ro, rl = reference(q, k, v, causal, None, layout)
    check(o, ro, v, dtype)
    check_lse(lse, rl)


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,bm,bn", [
    (1, 2, 1, 65, 70, True, "bhsd", "float16", 64, 64),      # GQA, seq_q != seq_k, causal
    (1, 1, 1, 40, 130, False, "bshd", "bfloat16", 64, 64),   # three key blocks, bshd
    (1, 1, 1, 70, 9, True, "bhsd", "float16", 64, 64),       # rows that see no key
    (1, 1, 1, 33, 150, False, "bhsd", "float16", 64, 128),   # 128-key blocks
])
def test_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, bm, bn):
    run(np.random.default_rng(), b, hq, hk, sq, sk, 64, causal, layout, dtype,
        WgmmaAttentionConfig(64, bm, bn, dtype))


@pytest.mark.sim
@pytest.mark.parametrize("b,hq,hk,sq,sk,causal,layout,dtype,d,bn", [
    (1, 1, 1, 1, 1, False, "bhsd", "float16", 64, 64),         # seq 1: one block, no loop
    (1, 1, 1, 1, 7, True, "bshd", "bfloat16", 128, 64),        # one query row, causal
    (1, 2, 1, 7, 7, True, "bshd", "bfloat16", 64, 64),         # GQA, seq 7
    (1, 1, 1, 65, 200, True, "bhsd", "float16", 64, 64),       # four key blocks, causal
    (1, 2, 1, 65, 200, False, "bhsd", "float16", 128, 64),     # GQA, d128, four key blocks
    (1, 1, 1, 200, 65, True, "bhsd", "bfloat16", 128, 64),     # seq_q > seq_k, no-key rows
    (1, 1, 1, 70, 9, True, "bhsd", "float16", 64, 128),        # rows that see no key
    (1, 1, 1, 33, 200, False, "bshd", "bfloat16", 64, 128),    # 128-key blocks, ragged end
])
def test_overlap_against_float64(b, hq, hk, sq, sk, causal, layout, dtype, d, bn):
    """The pipelined kernel (softmax of key block j+1 beside the P·V wgmmas of block j)."""
    run(np.random.default_rng(), b, hq, hk, sq, sk, d, causal, layout, dtype,
        WgmmaAttentionConfig(d, 64, bn, dtype, overlap=True))


def test_overlap_config():
    cfg = WgmmaAttentionConfig(128, 128, 64, overlap=True)
    assert "overlap=True" in repr(cfg) and "overlapped" in cfg.describe()
    assert cfg.smem_bytes == WgmmaAttentionConfig(128, 128, 64).smem_bytes + 16
    assert WgmmaAttentionConfig(64).overlap is False
    assert "overlapped" not in WgmmaAttentionConfig(64).describe()
    with pytest.raises(ValueError, match="overlap needs .* spills"):
        WgmmaAttentionConfig(128, 128, 128, overlap=True)
    with pytest.raises(ValueError, match="overlap must be a bool"):
        WgmmaAttentionConfig(64, 128, 64, overlap=1)
    for d, bn in ((64, 64), (64, 128), (128, 64)):
        WgmmaAttentionConfig(d, 128, bn, "bfloat16", overlap=True)


def test_config_validation():
    with pytest.raises(ValueError, match="head_dim must be one of"):
        WgmmaAttentionConfig(96)
    with pytest.raises(ValueError, match="block_n must be 64 or 128"):
        WgmmaAttentionConfig(64, 128, 32)
    assert WgmmaAttentionConfig(128).threads == 256
    q = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(ValueError, match="config is for head_dim 128"):
        tilepy.flash_attention(q, q, q, config=WgmmaAttentionConfig(128))


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reps = run_in_subprocess("tilepy.ops.attention_wgmma:compile_reports")
    assert len(reps) == 3 + len(OVERLAP_REPORTS)
    for name, rep in reps.items():
        assert "error" not in rep, rep.get("error")
        assert rep["counts"]["wgmma.mma_async"] >= 12 and rep["counts"]["ld.local"] == 0
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
        assert rep["registers"] <= 255
        if "overlap" in name:
            # no serialised wgmmas, no waits injected by ptxas
            assert rep["ptxas_wgmma_notes"] == [], rep["ptxas_wgmma_notes"]
            # the softmax (block_n / 2 + 2 ex2 per thread, the row-max shuffles) sits between
            # wait_group(1) and wait_group(0) in the machine code: it overlaps the P·V wgmmas
            if "ex2_in_flight" in rep:
                bn = int(name.split("x")[1].split("_")[0])
                assert rep["ex2_in_flight"] == [bn // 2 + 2], rep["ex2_in_flight"]
                assert rep["shfl_in_flight"][0] >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True)])
def test_gpu_against_sdpa(d, causal):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d))


@pytest.mark.gpu
@pytest.mark.parametrize("d,bn,causal", [(64, 64, False), (64, 128, True), (128, 64, False),
                                         (128, 64, True)])
def test_gpu_overlap_against_sdpa(d, bn, causal):
    gpu_against_sdpa(d, causal, WgmmaAttentionConfig(d, 128, bn, overlap=True))


def gpu_against_sdpa(d, causal, cfg):
    torch = pytest.importorskip("torch")
    from tilepy.ops.gemm import _is_hopper

    if not _is_hopper():
        pytest.skip("not a compute capability 9.0 GPU")
    q = torch.randn(2, 8, 1000, d, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4, 1100, d, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 4, 1100, d, device="cuda", dtype=torch.float16)
    got = tilepy.flash_attention(q, k, v, causal=causal, config=cfg)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    if causal:   # bottom-right alignment, as tilepy documents
        i = torch.arange(1000, device="cuda")[:, None]
        j = torch.arange(1100, device="cuda")[None, :]
        mask = j <= i + 100
        want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    else:
        want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv)
    assert (got.float() - want.float()).abs().max().item() < 1e-2
