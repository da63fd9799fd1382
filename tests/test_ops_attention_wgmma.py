"""The Hopper (wgmma) FlashAttention kernel through ``tilepy.flash_attention(config=
WgmmaAttentionConfig(...))``: simulator runs against float64 (the wgmma twins read the
swizzled shared tiles the descriptors address), the sm_90a compile, and on the GPU full size
against SDPA."""

import numpy as np
import pytest
from test_ops_attention import NP, check, check_lse, rand, reference

import tilepy
from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ops.attention_wgmma import WgmmaAttentionConfig


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
    assert len(reps) == 3
    for rep in reps.values():
        assert "error" not in rep, rep.get("error")
        assert rep["counts"]["wgmma.mma_async"] >= 12 and rep["counts"]["ld.local"] == 0
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["local_bytes"] == 0
        assert rep["registers"] <= 255


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, False), (128, False), (128, True)])
def test_gpu_against_sdpa(d, causal):
    torch = pytest.importorskip("torch")
    from tilepy.ops.gemm import _is_hopper

    if not _is_hopper():
        pytest.skip("not a compute capability 9.0 GPU")
    q = torch.randn(2, 8, 1000, d, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4, 1100, d, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 4, 1100, d, device="cuda", dtype=torch.float16)
    got = tilepy.flash_attention(q, k, v, causal=causal, config=WgmmaAttentionConfig(d))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    if causal:   # bottom-right alignment, as tilepy documents
        i = torch.arange(1000, device="cuda")[:, None]
        j = torch.arange(1100, device="cuda")[None, :]
        mask = j <= i + 100
        want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    else:
        want = torch.nn.functional.scaled_dot_product_attention(q, kk, vv)
    assert (got.float() - want.float()).abs().max().item() < 1e-2
