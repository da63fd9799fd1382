"""tilepy.flash_attention: results against a float64 NumPy reference (simulator, tiny shapes;
GPU, full size against PyTorch's scaled_dot_product_attention), the LSE, every user error
raised before launch, and the compiled kernels' resources (offline, sm_90)."""

import math

import numpy as np
import pytest

import tilepy
from tilepy import launch
from tilepy.ops.attention import flash_attention
from tilepy.ops.attention_mma_sync import HEAD_DIMS, AttentionConfig
from tilepy.ops.attention_wgmma import WgmmaAttentionConfig
from tilepy.tile.attention import key_window

ml_dtypes = pytest.importorskip("ml_dtypes")

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Max |error| relative to max |v|: p is rounded to the input dtype before p·v and the output
# is rounded to it (FlashAttention's numerics), so the bound is a few ulp of the dtype.
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
LSE_TOL = 1e-5

sim = pytest.mark.sim
gpu = pytest.mark.gpu


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(NP[dtype])


def f64(x):
    return np.asarray(x).astype(np.float64)


def reference(q, k, v, causal=False, scale=None, layout="bhsd", window=(-1, -1), cap=0.0,
              score_mod=None, mask_mod=None, alibi=None, mod_args=()):
    """float64 softmax(scale · q kᵀ + mask) v and its natural-log LSE, (B, Hq, Sq[, D]).

    Causal mask aligned bottom-right (key j visible to query i iff j <= i + Sk - Sq); a row
    with no visible key gives zeros and lse -inf. GQA by repeating k, v over the query heads.
    ``window`` (left, right), -1 unbounded: key j visible to query i iff i + Sk - Sq - left <=
    j <= i + Sk - Sq + right; ``cap``: the scaled scores soft-capped (cap · tanh(s / cap))
    before the mask; then ``score_mod(score, b, h, i, j)`` and ``mask_mod(b, h, i, j)`` (the
    user functions of flash_attention, FlexAttention's convention) element by element, with
    ``mod_args`` after their fixed parameters; ``alibi`` slopes ((Hq,) or (B, Hq)): ``-slope ·
    |i + Sk - Sq - j|`` added after the cap.
    """
    q, k, v = f64(q), f64(k), f64(v)
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    _, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    k = np.repeat(k, hq // hk, axis=1)
    v = np.repeat(v, hq // hk, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if cap:
        s = cap * np.tanh(s / cap)
    if alibi is not None:
        slopes = np.broadcast_to(f64(alibi), (s.shape[0], hq))[:, :, None, None]
        dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
        s = s - slopes * dist
    if score_mod is not None or mask_mod is not None:
        bb, hh, ii, jj = np.meshgrid(*(np.arange(n) for n in s.shape), indexing="ij")
        if score_mod is not None:
            s = np.vectorize(lambda *a: score_mod(*a, *mod_args), otypes=[np.float64])(
                s, bb, hh, ii, jj)
        if mask_mod is not None:
            s = np.where(np.vectorize(lambda *a: mask_mod(*a, *mod_args), otypes=[bool])(
                bb, hh, ii, jj), s, -np.inf)
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if left >= 0:
        s = np.where(j >= i + sk - sq - left, s, -np.inf)
    if right >= 0:
        s = np.where(j <= i + sk - sq + right, s, -np.inf)
    m = s.max(-1, keepdims=True) if sk else np.full(s.shape[:-1] + (1,), -np.inf)
    seen = np.isfinite(m)
    m0 = np.where(seen, m, 0.0)
    p = np.exp(s - m0)
    total = p.sum(-1, keepdims=True)
    o = np.where(seen, (p / np.where(seen, total, 1.0)) @ v, 0.0)
    lse = np.where(seen[..., 0], np.log(np.where(seen, total, 1.0))[..., 0] + m0[..., 0],
                   -np.inf)
    if layout == "bshd":
        o = o.transpose(0, 2, 1, 3)
    return o, lse


def check(got, ref, v, dtype):
    got = f64(got)
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), "NaN or unwritten element"
    err = np.abs(got - ref).max() if got.size else 0.0
    assert err <= TOL[dtype] * max(np.abs(f64(v)).max(), 1e-6), err


def check_lse(got, ref):
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), "rows without keys: lse -inf"
    fin = np.isfinite(ref)
    assert np.isfinite(got[fin]).all()
    assert np.abs(f64(got[fin]) - ref[fin]).max(initial=0) <= LSE_TOL * (1 + np.abs(ref).max())


def run_case(shape_q, shape_kv, dtype, causal, layout="bhsd", rng=None, **kw):
    rng = rng or np.random.default_rng()
    q = rand(rng, shape_q, dtype)
    k = rand(rng, shape_kv, dtype)
    v = rand(rng, shape_kv, dtype)
    out = np.full(shape_q, np.nan, NP[dtype])
    res, lse = flash_attention(q, k, v, causal=causal, out=out, return_lse=True,
                               layout=layout, **kw)
    assert res is out
    ro, rl = reference(q, k, v, causal, kw.get("scale"), layout,
                       key_window(causal, kw.get("window")), kw.get("softcap", 0.0))
    check(out, ro, v, dtype)
    check_lse(lse, rl)
    return out, ro


# ---- simulator ---------------------------------------------------------------------------

@sim
def test_repeated_calls_reuse_the_plan_with_new_data():
    """Calls 2… with the same signature take the cached launch plan: each must read its own
    q, k, v and write its own out and lse (new allocations or the caller's)."""
    from tilepy.ops import attention as at

    at._PLANS.clear()
    rng = np.random.default_rng()
    for i in range(3):
        q = rand(rng, (1, 2, 9, 16), "float16")
        k, v = rand(rng, (1, 1, 12, 16), "float16"), rand(rng, (1, 1, 12, 16), "float16")
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        ro, rl = reference(q, k, v, True)
        check(o, ro, v, "float16")
        check_lse(lse, rl)
    assert len(at._PLANS) == 1


@sim
@pytest.mark.parametrize("b,hq,sq,sk,d,causal,dtype", [
    (1, 1, 1, 1, 16, False, "float16"),      # one query, one key
    (1, 1, 7, 7, 32, True, "bfloat16"),
    (1, 1, 33, 33, 64, False, "float16"),    # one row and one key past the blocks
    pytest.param(1, 1, 65, 65, 32, True, "bfloat16", marks=pytest.mark.extended),
    (2, 1, 17, 40, 32, True, "float16"),     # seq_q < seq_k: bottom-right diagonal
    (1, 2, 40, 17, 16, True, "bfloat16"),    # seq_q > seq_k: rows 0..22 see no key -> 0
    pytest.param(1, 1, 23, 70, 64, False, "bfloat16", marks=pytest.mark.extended),
    (1, 1, 70, 9, 16, False, "float16"),
    (1, 1, 20, 20, 128, True, "float16"),    # the largest head_dim
    (1, 1, 30, 26, 48, True, "bfloat16"),    # 6 chunks a row: unswizzled tiles
], ids=lambda x: str(x))
def test_against_float64(b, hq, sq, sk, d, causal, dtype):
    out, _ = run_case((b, hq, sq, d), (b, hq, sk, d), dtype, causal)
    if causal and sq > sk:
        assert not np.any(f64(out)[:, :, :sq - sk]), "rows with no visible key must be 0"


@sim
@pytest.mark.parametrize("d,causal,layout,dtype,kw", [
    (8, True, "bhsd", "float16", {}),                       # tiles of 16: half zeros
    (40, False, "bshd", "bfloat16", {"window": (9, 3)}),     # 48-column tiles, a variant
    (24, True, "bhsd", "float16", {"alibi_slopes": np.array([0.3, 0.1], np.float32)}),
    (200, True, "bshd", "bfloat16", {}),                     # past 128: 208-column tiles
])
def test_head_dims_padded_in_shared_memory(d, causal, layout, dtype, kw):
    """head_dim a multiple of 8 but not of 16: the tiles zero-padded to the next multiple of
    16 by the copies (the inputs as they are), the padded O columns never stored (poisoned
    out, its neighbours in a wider buffer untouched), against float64; GQA 2/1, odd lengths;
    the backward of these head dims: tests/test_ops_attention_backward.py."""
    rng = np.random.default_rng()
    sq, sk = 37, 45
    shq = (1, 2, sq, d) if layout == "bhsd" else (1, sq, 2, d)
    shk = (1, 1, sk, d) if layout == "bhsd" else (1, sk, 1, d)
    q, k, v = rand(rng, shq, dtype), rand(rng, shk, dtype), rand(rng, shk, dtype)
    wide = np.full(shq[:-1] + (d + 8,), np.nan, NP[dtype])
    out = wide[..., :d]          # strides of d + 8 elements: 16-byte aligned
    res, lse = flash_attention(q, k, v, causal=causal, out=out, return_lse=True,
                               layout=layout, **kw)
    ro, rl = reference(q, k, v, causal, None, layout,
                       key_window(causal, kw.get("window")), alibi=kw.get("alibi_slopes"))
    check(res, ro, v, dtype)
    check_lse(lse, rl)
    assert np.isnan(wide[..., d:].astype(np.float32)).all()


@sim
def test_whole_query_blocks_without_keys_give_zeros():
    # causal, seq_q 40 > seq_k 5: rows 0..34 see nothing, so the first query block visits
    # no key block at all (and reads no K/V); rows 35..39 see 1..5 keys.
    out, _ = run_case((1, 1, 40, 16), (1, 1, 5, 16), "float16", True)
    assert not np.any(f64(out)[0, 0, :35]) and np.all(np.any(f64(out)[0, 0, 35:], -1))


@sim
@pytest.mark.parametrize("hkv,causal,dtype", [(2, True, "float16"), (1, False, "bfloat16")])
def test_grouped_and_multi_query(hkv, causal, dtype):
    run_case((1, 4, 19, 16), (1, hkv, 23, 16), dtype, causal)


@sim
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bshd_layout_in_place(dtype):
    # (batch, seq, heads, head_dim): strided (B, H, S, D) views, no copy; GQA too.
    rng = np.random.default_rng()
    run_case((2, 21, 2, 32), (2, 30, 1, 32), dtype, True, layout="bshd", rng=rng)


@sim
def test_scale_and_without_lse():
    rng = np.random.default_rng()
    q, k, v = (rand(rng, (1, 1, 18, 32), "float16") for _ in range(3))
    got = flash_attention(q, k, v, scale=0.3)
    assert isinstance(got, np.ndarray) and got.dtype == np.float16
    check(got, reference(q, k, v, scale=0.3)[0], v, "float16")


@sim
def test_unaligned_and_strided_inputs_are_copied():
    rng = np.random.default_rng()
    # Rows of 36 elements (72 bytes: not 16-byte aligned) and a head_dim axis of stride 2.
    qb = rand(rng, (1, 1, 20, 36), "float16")
    kb = rand(rng, (1, 1, 24, 32, 2), "float16")
    v = rand(rng, (1, 1, 24, 32), "float16")
    q, k = qb[..., :32], kb[..., 0]
    got = flash_attention(q, k, v, causal=True)
    check(got, reference(q, k, v, True)[0], v, "float16")


@sim
@pytest.mark.parametrize("config", [None, WgmmaAttentionConfig(32, 64, 64, overlap=True,
                                                               tma=True)],
                         ids=["built-in", "wgmma-tma"])
def test_a_nan_score_gives_a_nan_row_and_lse(config):
    """A NaN in one query row (and, causal, in a key: the rows that see it): those rows and
    their LSE are NaN — not zeros and -inf, which mean "no key" — the others finite."""
    rng = np.random.default_rng()
    q = rand(rng, (1, 2, 40, 32), "float16")
    k = rand(rng, (1, 2, 50, 32), "float16")
    v = rand(rng, (1, 2, 50, 32), "float16")
    q[0, 0, 7, 3] = np.nan
    k[0, 1, 30, 5] = np.nan      # causal, bottom-right: rows 20 … see key 30
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, config=config)
    out, lse = f64(out), np.asarray(lse)
    assert np.isnan(out[0, 0, 7]).all() and np.isnan(lse[0, 0, 7])
    assert np.isnan(out[0, 1, 20:]).all() and np.isnan(lse[0, 1, 20:]).all()
    keep = np.ones((2, 40), bool)
    keep[0, 7] = False
    keep[1, 20:] = False
    assert np.isfinite(out[0][keep]).all() and np.isfinite(lse[0][keep]).all()


@sim
def test_other_configs():
    # 32 rows per warp (two m16 tiles), 32-key blocks, one warp per block.
    rng = np.random.default_rng()
    cfg = AttentionConfig(32, block_m=32, block_n=32, warp_rows=32, dtype="bfloat16")
    run_case((1, 1, 45, 32), (1, 1, 50, 32), "bfloat16", True, rng=rng, config=cfg)


@sim
def test_empty_sizes():
    q = np.ones((1, 2, 0, 16), np.float16)
    k = np.ones((1, 2, 5, 16), np.float16)
    out, lse = flash_attention(q, k, k, return_lse=True)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    # No keys at all: every row sees nothing -> zeros, lse -inf.
    q = np.ones((1, 1, 3, 16), np.float16)
    k = np.ones((1, 1, 0, 16), np.float16)
    out = np.full_like(q, np.nan)
    _, lse = flash_attention(q, k, k, out=out, return_lse=True)
    assert not np.any(f64(out)) and np.all(np.isneginf(lse))



# ---- heads and batches past the grid's y / z limit (tilepy.launch.MAX_GRID_YZ, lowered) ----

@pytest.fixture
def plans_cleared():
    """No attention launch plan built under another grid limit before or after the test."""
    from tilepy.ops import attention as at

    at._PLANS.clear()
    yield at._PLANS
    at._PLANS.clear()


@sim
@pytest.mark.parametrize("b,hq,hk,layout,causal,limit", [
    pytest.param(5, 2, 2, "bhsd", True, 3, marks=pytest.mark.extended),   # batch past it
    pytest.param(1, 7, 7, "bshd", False, 3, marks=pytest.mark.extended),  # heads past it
    (1, 6, 2, "bhsd", True, 4),    # GQA: chunks of whole groups (3 query heads per K/V head)
    (1, 6, 1, "bshd", True, 4),    # one K/V head for all (it stays put)
    (3, 6, 2, "bhsd", True, 2),    # a group (3) larger than the limit, and the batch past it
], ids=lambda x: str(x))
def test_heads_and_batches_past_the_grid_limit(monkeypatch, plans_cleared, b, hq, hk, layout,
                                               causal, limit):
    """The grid kernel's heads (y) and batches (z) launch in chunks of at most ``limit``
    blocks, the views shifted to each chunk's first head / batch (K/V by head // group);
    twice, the second call through the bound plan with new data."""
    from tilepy import launch

    monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    rng = np.random.default_rng()
    sq, sk, d = 9, 12, 16
    shape_q, shape_kv = (b, hq, sq, d), (b, hk, sk, d)
    if layout == "bshd":
        shape_q, shape_kv = (b, sq, hq, d), (b, sk, hk, d)
    for _ in range(2):
        run_case(shape_q, shape_kv, "float16", causal, layout=layout, rng=rng)
    (entry,) = plans_cleared.values()
    chunks = entry[0].plan.chunks
    assert chunks is not None and all(max(g[1:]) <= limit for g, _ in chunks)


@sim
def test_tma_grid_configs_past_the_limit_run_one_dimensional(monkeypatch, plans_cleared):
    """The TMA grid kernel's tensor maps describe whole tensors, so its grid is not chunked:
    past the limit a config with a producer warpgroup runs persistent (one-dimensional grid),
    one without as the cp.async grid kernel of its tile (chunked); within it, as given."""
    from tilepy import launch
    from tilepy.ops import attention as at
    from tilepy.ops import attention_wgmma as aw

    monkeypatch.setattr(launch, "MAX_GRID_YZ", 1)
    producer = aw.WgmmaAttentionConfig(64, 128, 64, overlap=True, tma=True, producer=True)
    thread0 = aw.WgmmaAttentionConfig(64, 64, 64, overlap=True, tma=True)
    assert at._grid_safe(producer, 1, 1) is producer
    assert at._grid_safe(producer, 1, 2) == aw.WgmmaAttentionConfig(
        64, 128, 64, overlap=True, tma=True, producer=True, persistent=True)
    assert at._grid_safe(thread0, 2, 1) == aw.WgmmaAttentionConfig(64, 64, 64, overlap=True)
    rng = np.random.default_rng()
    run_case((1, 2, 16, 64), (1, 1, 16, 64), "float16", True, rng=rng, config=thread0)
    (entry,) = plans_cleared.values()
    assert entry[0].plan.chunks is not None
    plans_cleared.clear()
    run_case((1, 2, 16, 64), (1, 1, 16, 64), "float16", False, rng=rng, config=producer)
    (entry,) = plans_cleared.values()
    assert isinstance(entry[0].plan, aw.ScheduledTmaPlan) and entry[0].plan.grid[1:] == (1, 1)

@sim
def test_outputs_with_overlapping_elements_are_refused():
    """An ``out`` (or a gradient output) whose elements share memory — a broadcast view —
    is refused before launch, naming it: the forward's, the backward's and the packed
    forward's."""
    rng = np.random.default_rng()
    q = rand(rng, (1, 2, 8, 16), "float16")
    shared = np.broadcast_to(np.zeros((1, 1, 8, 16), np.float16), q.shape)
    with pytest.raises(ValueError, match="out has overlapping elements"):
        flash_attention(q, q, q, out=shared)
    out, lse = flash_attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="dk has overlapping elements"):
        tilepy.flash_attention_backward(q, q, q, q, out, lse, dk=shared)
    packed = q[0].transpose(1, 0, 2)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="out has overlapping elements"):
        tilepy.flash_attention_varlen(packed, packed, packed, cu, cu, 8, 8,
                                      out=np.broadcast_to(packed[:1], packed.shape))


@sim
def test_errors_are_raised_before_launch():
    h = np.ones((1, 2, 8, 16), np.float16)
    kv = np.ones((1, 1, 8, 16), np.float16)
    with pytest.raises(ValueError, match="head_dim 20 is not supported; supported: the "
                                         "multiples of 8 from 8 to 256"):
        x = np.ones((1, 1, 8, 20), np.float16)
        flash_attention(x, x, x)
    with pytest.raises(ValueError, match="head_dim 264 is not supported"):
        x = np.ones((1, 1, 8, 264), np.float16)
        flash_attention(x, x, x)
    with pytest.raises(ValueError, match="head_dim differs: q 16, k 32"):
        flash_attention(h, np.ones((1, 1, 8, 32), np.float16), kv)
    with pytest.raises(ValueError, match=r"heads_q \(2\) must be a multiple of heads_kv \(3\)"):
        x = np.ones((1, 3, 8, 16), np.float16)
        flash_attention(h, x, x)
    with pytest.raises(ValueError, match="batch sizes differ"):
        x = np.ones((2, 1, 8, 16), np.float16)
        flash_attention(h, x, x)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attention(h, kv, np.ones((1, 1, 9, 16), np.float16))
    with pytest.raises(TypeError, match="same dtype"):
        flash_attention(h, kv, kv.astype(ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="float32 is not supported"):
        flash_attention(h.astype(np.float32), kv, kv)
    with pytest.raises(TypeError, match="list"):
        flash_attention([[1.0]], kv, kv)
    with pytest.raises(ValueError, match="must be 4-D"):
        flash_attention(h[0], kv, kv)
    with pytest.raises(ValueError, match="layout must be one of"):
        flash_attention(h, kv, kv, layout="sbhd")
    # (and where float32 would round it to 0 or overflow: NaN out of the kernels)
    for bad in (-1.0, 1e39, 1e-50, float("nan")):
        with pytest.raises(ValueError, match="scale must be a positive number in"):
            flash_attention(h, kv, kv, scale=bad)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(h, kv, kv, causal="yes")
    with pytest.raises(ValueError, match="out must have shape"):
        flash_attention(h, kv, kv, out=np.empty((1, 2, 8, 32), np.float16))
    with pytest.raises(ValueError, match="out must have dtype"):
        flash_attention(h, kv, kv, out=np.empty(h.shape, ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="config is for head_dim 32"):
        flash_attention(h, kv, kv, config=AttentionConfig(32, 32, 16))
    with pytest.raises(ValueError, match="window left must be an int >= 0, or -1 / None"):
        flash_attention(h, kv, kv, window=(-2, 0))
    with pytest.raises(ValueError, match="window must be None or"):
        flash_attention(h, kv, kv, window=3)
    with pytest.raises(ValueError, match="causal=True means window right = 0"):
        flash_attention(h, kv, kv, causal=True, window=(4, 2))
    # a side longer than any sequence: unbounded, the same keys (no 64-bit constant)
    assert key_window(True, (2 ** 64, 0)) == (-1, 0) == key_window(True, None)
    assert key_window(False, (5, 2 ** 40)) == (5, -1)
    for bad in (-1.0, float("nan"), float("inf"), 1e39, 1e-50):
        with pytest.raises(ValueError, match="softcap must be 0.0"):
            flash_attention(h, kv, kv, softcap=bad)
    with pytest.raises(TypeError, match="softcap must be a float"):
        flash_attention(h, kv, kv, softcap="2")
    x64 = np.ones((1, 1, 8, 64), np.float16)
    with pytest.raises(NotImplementedError, match="only the TMA ones take a window"):
        flash_attention(x64, x64, x64, window=(4, 4),
                        config=WgmmaAttentionConfig(64, 128, 64, overlap=True))
    # In bshd, the heads are axis 2: (1, 8, 2, 16) q with (1, 8, 3, 16) k.
    with pytest.raises(ValueError, match=r"heads_q \(2\) must be a multiple of heads_kv \(3\)"):
        x = np.ones((1, 8, 3, 16), np.float16)
        flash_attention(np.ones((1, 8, 2, 16), np.float16), x, x, layout="bshd")


def test_p_fragments_are_the_a_operand():
    """S accumulator tiles 2kk, 2kk+1 (keys 16kk..16kk+15), registers paired (c0, c1) and
    (c2, c3), are the A fragment of k16 step kk: the kernel's packing, checked against the
    fragment maps of tilepy.ptx.fragments."""
    from tilepy.ptx.fragments import a_map, c_map

    c_at = {(lane, r): (row, col) for lane, r, _, row, col in c_map(1)}
    for lane, r, j, row, col in a_map(16, 2):
        tile = r // 2                      # a0, a1 <- tile 2kk; a2, a3 <- tile 2kk + 1
        creg = 2 * (r % 2) + j             # a0/a2 <- (c0, c1); a1/a3 <- (c2, c3)
        srow, scol = c_at[(lane, creg)]
        assert (srow, 8 * tile + scol) == (row, col)


def test_config_validation():
    with pytest.raises(ValueError, match="head_dim must be one of"):
        AttentionConfig(36)
    with pytest.raises(ValueError, match="block_n=24 is not a positive multiple of 16"):
        AttentionConfig(64, block_n=24)
    with pytest.raises(ValueError, match="warp_rows"):
        AttentionConfig(64, block_m=48, warp_rows=32)
    with pytest.raises(ValueError, match="shared memory"):
        AttentionConfig(128, block_m=256, block_n=256, warp_rows=32)
    assert AttentionConfig(128).smem_bytes == 96 * 1024
    assert tuple(HEAD_DIMS) == tuple(range(8, 257, 8))
    assert AttentionConfig(40).tile_dim == 48 and AttentionConfig(8).tile_dim == 16
    assert AttentionConfig(40, 64, 64).smem_bytes == (64 + 4 * 64) * 48 * 2


def test_fallback_configs_past_128_fit_the_smaller_gpus():
    """The mma.sync fallbacks past head_dim 128 (forward, backward, a decoding step and a
    prefill against a cache) fit the 99 KB of shared memory of sm_86 / sm_89."""
    from tilepy.ops.attention import GPU_CONFIGS
    from tilepy.ops.attention_backward import GPU_BLOCKS
    from tilepy.ops.attention_backward_mma_sync import BackwardConfig
    from tilepy.ops.attention_decode_mma_sync import DecodeConfig

    for d in (136, 200, 256):
        AttentionConfig(d, *GPU_CONFIGS[256], cc=(8, 6))
        BackwardConfig(d, **GPU_BLOCKS[256], cc=(8, 6))
        DecodeConfig(d, 16, 4, "bfloat16", cc=(8, 6))      # attention_kvcache's choice
        AttentionConfig(d, 64, 32, 16, cc=(8, 6))


# ---- compile layer: the real kernels, offline, sm_90 -------------------------------------

@pytest.mark.compile
def test_kernels_compile_to_mma_ldmatrix_cp_async_without_spills():
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    reports = run_in_subprocess("tilepy.ops.attention_mma_sync:compile_reports")
    # five plain kernels (one of head_dim 40), a variant, packed sequences (varlen), a paged
    # KV cache's decoding kernel
    assert len(reports) == 8
    for name, rep in reports.items():
        assert "error" not in rep, rep.get("error")
        c = rep["counts"]
        d = 128 if "d128" in name else 48 if "d40" in name else 64   # d40: 48-column tiles
        # per key block of 64: Q·Kᵀ (D/16)·8 mma + P·V 4·(D/8) mma; ldmatrix for Q, K, V
        # (head_dim 40: the P·V mma of the zero columns are gone, their O never stored)
        dv = 40 if "d40" in name else d
        assert c["mma"] >= (d // 16) * 8 + 4 * (dv // 8), (name, c)
        assert c["ldmatrix"] >= d // 16 + (d // 16) * 4 + 4 * (d // 16), (name, c)
        assert c["cp.async"] >= 1 and c["cp.async.wait"] >= 2 and c["bar.sync"] >= 2
        assert c["ld.local"] == 0 and c["st.local"] == 0, (name, c)
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
        assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0, rep
        assert rep["f64"] == 0, "64-bit float arithmetic in the kernel"
        assert 0 < rep["registers"] <= 255
        print(f"{name}: {rep['registers']} registers, {rep['config']}")


# ---- GPU: full size against PyTorch --------------------------------------------------------

def _torch_reference(torch, q, k, v, causal, scale=None, layout="bhsd"):
    """float64 attention with the bottom-right causal mask, (B, Hq, Sq, D) and lse."""
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = q.double(), k.double(), v.double()
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    hk, sk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = p @ v
    if layout == "bshd":
        o = o.transpose(1, 2)
    return o, lse


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_against_sdpa(dtype, causal):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    for b, h, s, d in [(2, 8, 1024, 128), (4, 4, 777, 64), (1, 2, 4096, 128)]:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=tdt) for _ in range(3))
        got = flash_attention(q, k, v, causal=causal)
        assert isinstance(got, torch.Tensor) and got.device == q.device and got.dtype == tdt
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2 * TOL[dtype] * v.abs().max().item(), (b, h, s, d, err)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_odd_shapes_gqa_layouts_lse(dtype):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    rng = np.random.default_rng()
    cases = [(1, 4, 1, 1, 1, 64, "bhsd"), (2, 8, 2, 333, 1000, 128, "bhsd"),
             (2, 8, 8, 1000, 333, 64, "bshd"), (1, 16, 4, 129, 129, 96, "bshd"),
             (3, 4, 2, 65, 4097, 16, "bhsd"), (2, 6, 3, 513, 200, 80, "bshd")]
    for b, hq, hk, sq, sk, d, layout in cases:
        causal = bool(rng.integers(2))
        shape_q, shape_kv = (b, hq, sq, d), (b, hk, sk, d)
        if layout == "bshd":
            shape_q, shape_kv = (b, sq, hq, d), (b, sk, hk, d)
        q = torch.randn(shape_q, device="cuda", dtype=tdt)
        k = torch.randn(shape_kv, device="cuda", dtype=tdt)
        v = torch.randn(shape_kv, device="cuda", dtype=tdt)
        out = torch.full_like(q, float("nan"))
        got, lse = flash_attention(q, k, v, causal=causal, return_lse=True, out=out,
                                   layout=layout)
        want, want_lse = _torch_reference(torch, q, k, v, causal, layout=layout)
        assert got is out and not got.isnan().any()
        err = (got.double() - want).abs().max().item()
        assert err <= TOL[dtype] * v.abs().max().item(), (b, hq, hk, sq, sk, d, layout, err)
        fin = want_lse.isfinite()
        assert torch.equal(lse.isneginf(), ~fin)
        lerr = (lse.double()[fin] - want_lse[fin]).abs().max().item() if fin.any() else 0.0
        assert lerr <= 1e-4 * (1 + want_lse[fin].abs().max().item()), lerr


@gpu
def test_gpu_cupy_and_caller_stream():
    cupy = pytest.importorskip("cupy")
    q = cupy.random.standard_normal((2, 4, 300, 64), dtype=cupy.float32).astype(cupy.float16)
    k = cupy.random.standard_normal((2, 2, 500, 64), dtype=cupy.float32).astype(cupy.float16)
    v = cupy.random.standard_normal((2, 2, 500, 64), dtype=cupy.float32).astype(cupy.float16)
    with cupy.cuda.Stream(non_blocking=True):
        got = flash_attention(q, k, v, causal=True)
        cupy.cuda.get_current_stream().synchronize()
    assert isinstance(got, cupy.ndarray)
    want, _ = reference(cupy.asnumpy(q), cupy.asnumpy(k), cupy.asnumpy(v), True)
    check(cupy.asnumpy(got), want, cupy.asnumpy(v), "float16")


def test_exported_through_the_public_front():
    """``tilepy.flash_attention`` is the front of tilepy.api (PyTorch tensors to the
    registered operator, every other kind to this op), with the op's docstring."""
    assert callable(flash_attention)
    assert tilepy.flash_attention is tilepy.api.flash_attention
    assert tilepy.flash_attention.__doc__ == flash_attention.__doc__


@pytest.mark.gpu
def test_gpu_repeated_calls_on_the_callers_stream():
    """The cached launch plan (calls 2…) follows new tensors and the caller's stream."""
    torch = pytest.importorskip("torch")
    from tilepy.ops import attention as at

    at._PLANS.clear()
    s = torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(s):
            q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16)
                       for _ in range(3))
            got = flash_attention(q, k, v, causal=True)
        s.synchronize()
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert (got.float() - want.float()).abs().max().item() < 1e-2
    assert len(at._PLANS) == 1


@gpu
def test_gpu_heads_and_batches_past_the_grid_limit():
    """70,000 batches (grid z) or heads (grid y; CUDA's limit is 65,535), seq 16, head_dim 64:
    the built-in config, the mma.sync grid kernel (chunked launches) and, on sm_90, a
    non-persistent TMA config (run persistent) and the cp.async wgmma grid kernel; GQA with
    two K/V heads (and two batches: chunks of heads that are not contiguous); against float64
    torch."""
    torch = pytest.importorskip("torch")
    from tilepy.ops import attention_wgmma as aw

    configs = [None, AttentionConfig(64, 128, 64, 32, "float16")]
    if launch.is_hopper():
        configs += [aw.WgmmaAttentionConfig(64, 128, 128, overlap=True, tma=True,
                                            pingpong=True, producer=True),
                    aw.WgmmaAttentionConfig(64, 128, 64, overlap=True)]
    # (2, 70000, 2): head chunks of a contiguous q are not contiguous (layout "A" kernels)
    for b, hq, hk in ((70_000, 1, 1), (1, 70_000, 70_000), (2, 70_000, 2)):
        q = torch.randn(b, hq, 16, 64, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(b, hk, 16, 64, device="cuda", dtype=torch.float16)
                for _ in range(2))
        want, want_lse = _torch_reference(torch, q, k, v, True)
        for cfg in configs:
            got, lse = flash_attention(q, k, v, causal=True, return_lse=True, config=cfg)
            err = (got.double() - want).abs().max().item()
            assert err <= TOL["float16"] * v.abs().max().item(), (b, hq, hk, cfg, err)
            assert (lse.double() - want_lse).abs().max().item() <= 1e-4 * (
                1 + want_lse.abs().max().item()), (b, hq, hk, cfg)
        bshd = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               causal=True, layout="bshd")
        err = (bshd.transpose(1, 2).double() - want).abs().max().item()
        assert err <= TOL["float16"] * v.abs().max().item(), (b, hq, hk, "bshd", err)


# ---- the kernel's variants: windows and score functions (generator parameters) --------------

@sim
@pytest.mark.parametrize("sq,sk,causal,window,cap,dtype,layout", [
    (45, 29, True, (7, None), 0.0, "float16", "bhsd"),    # Mistral's window; rows without keys
    (23, 51, False, (5, 9), 0.0, "bfloat16", "bshd"),     # both sides bounded
    pytest.param(37, 37, False, None, 3.0, "float16", "bhsd",   # soft cap alone
                 marks=pytest.mark.extended),
    (40, 53, False, (16, -1), 2.5, "bfloat16", "bhsd"),   # left only, with a soft cap
])
def test_windows_and_softcap(sq, sk, causal, window, cap, dtype, layout):
    """flash_attention(..., window=, softcap=) — the mma.sync kernel's variants (generator
    parameters: tilepy.tile.attention's key ranges and score hook) — against a float64
    reference; GQA 4 / 2, poisoned outputs, the LSE of the capped scores. A second call with
    another window (same shapes) must not take the first one's plan."""
    rng = np.random.default_rng()
    b, hq, hk, d = 1, 4, 2, 32
    shape = (lambda h, s: (b, h, s, d)) if layout == "bhsd" else (lambda h, s: (b, s, h, d))
    q0 = rand(rng, shape(hq, sq), dtype)
    q0 = (q0.astype(np.float32) * 2).astype(NP[dtype])     # larger scores: the cap bites
    kv = (rand(rng, shape(hk, sk), dtype), rand(rng, shape(hk, sk), dtype))
    for win in (window, (2, 0 if causal else 2)):
        out = np.full(q0.shape, np.nan, NP[dtype])
        res, lse = flash_attention(q0, *kv, causal=causal, window=win, softcap=cap, out=out,
                                   return_lse=True, layout=layout)
        ro, rl = reference(q0, *kv, causal, None, layout,
                           key_window(causal, win), cap)
        check(res, ro, kv[1], dtype)
        check_lse(lse, rl)


def alibi_like(score, b, h, q_idx, kv_idx):
    """A per-head linear distance bias (ALiBi's shape), slopes from the head index."""
    return score - (h + 1) * 0.25 * abs(q_idx - kv_idx)


def prefix_lm(b, h, q_idx, kv_idx):
    """Prefix-LM: the first 7 keys are visible to every row, the rest causally."""
    return kv_idx <= q_idx or kv_idx < 7


@sim
@pytest.mark.parametrize("sq,sk,causal,window,cap,score_mod,mask_mod,dtype,layout,again", [
    (45, 45, False, None, 0.0, None, prefix_lm, "float16", "bhsd", True),          # mask alone
    (37, 52, True, None, 0.0, alibi_like, None, "bfloat16", "bshd", False),        # bias, causal
    (40, 33, False, (9, 4), 3.0, alibi_like, prefix_lm, "float16", "bhsd", False),  # all
])
def test_user_score_and_mask_functions(sq, sk, causal, window, cap, score_mod, mask_mod, dtype,
                                       layout, again):
    """score_mod= / mask_mod= (plain Python functions, FlexAttention's convention) on the
    simulator's kernel against float64 with the same functions element by element; GQA 4 / 2,
    poisoned outputs, the LSE, rows whose keys are all masked (prefix-LM with seq_k < seq_q
    under the window). A second call with another function takes a plan of its own."""
    others = [(score_mod, lambda b, h, i, j: j % 3 != 1)] if again else []
    rng = np.random.default_rng()
    b, hq, hk, d = 1, 4, 2, 32
    shape = (lambda h, s: (b, h, s, d)) if layout == "bhsd" else (lambda h, s: (b, s, h, d))
    q = (rand(rng, shape(hq, sq), dtype).astype(np.float32) * 2).astype(NP[dtype])
    kv = (rand(rng, shape(hk, sk), dtype), rand(rng, shape(hk, sk), dtype))
    for sm, mm in [(score_mod, mask_mod)] + others:
        out = np.full(q.shape, np.nan, NP[dtype])
        res, lse = flash_attention(q, *kv, causal=causal, window=window, softcap=cap,
                                   score_mod=sm, mask_mod=mm, out=out, return_lse=True,
                                   layout=layout)
        ro, rl = reference(q, *kv, causal, None, layout, key_window(causal, window), cap, sm, mm)
        check(res, ro, kv[1], dtype)
        check_lse(lse, rl)


def same_document(b, h, q_idx, kv_idx, doc_q, doc_k):
    """Document masking (packed sequences): a key is seen only from its own document. The
    ids are (batch, seq) int32; the indices are bounded (edge tiles pass positions past the
    sequences)."""
    i = min(q_idx, doc_q.shape[1] - 1)
    j = min(kv_idx, doc_k.shape[1] - 1)
    return doc_q[b, i] == doc_k[b, j]


def table_bias(score, b, h, q_idx, kv_idx, doc_q, doc_k, table, span):
    """A learned relative-position bias: ``table[h, clamp(q - k, ±span) + span]`` (float32)."""
    r = min(max(q_idx - kv_idx, -span), span)
    return score + table[h, r + span]


def documents(rng, b, s, n):
    """(b, s) int32 document ids: ``n`` runs of random lengths per row, in order."""
    cuts = np.sort(rng.choice(np.arange(1, s), size=(b, n - 1), replace=True), axis=1)
    return np.stack([np.searchsorted(c, np.arange(s), side="right") for c in cuts]).astype(
        np.int32)


@sim
@pytest.mark.parametrize("sq,sk,causal,layout,bias", [
    pytest.param(45, 45, True, "bhsd", False,   # document mask under causal
                 marks=pytest.mark.extended),
    (37, 50, False, "bshd", True),      # + a bias table and a scalar, seq_q != seq_k
])
def test_mod_args_document_mask_and_bias_table(sq, sk, causal, layout, bias):
    """mod_args= arrays (and a number) read by the user functions inside the kernel, against
    float64 with the same functions; a second call with new array contents (same shapes:
    the same compiled kernel and launch plan, the new pointers) must see the new data."""
    rng = np.random.default_rng()
    b, hq, hk, d, dtype = 2, 2, 1, 32, "float16"
    shape = (lambda h, s: (b, h, s, d)) if layout == "bhsd" else (lambda h, s: (b, s, h, d))
    q, k, v = rand(rng, shape(hq, sq), dtype), rand(rng, shape(hk, sk), dtype), \
        rand(rng, shape(hk, sk), dtype)
    sm = table_bias if bias else None
    for _ in range(2):
        doc_q = documents(rng, b, sq, 4)
        doc_k = doc_q if sq == sk else documents(rng, b, sk, 4)
        args = (doc_q, doc_k) + ((rng.standard_normal((hq, 9)).astype(np.float32), 4)
                                 if bias else ())
        mm = same_document if not bias else (lambda bb, h, i, j, dq, dk, t, sp:
                                             same_document(bb, h, i, j, dq, dk))
        out = np.full(q.shape, np.nan, np.float16)
        res, lse = flash_attention(q, k, v, causal=causal, score_mod=sm, mask_mod=mm,
                                   mod_args=args, out=out, return_lse=True, layout=layout)
        ro, rl = reference(q, k, v, causal, None, layout, key_window(causal, None), 0.0, sm,
                           mm, mod_args=args)
        check(res, ro, v, dtype)
        check_lse(lse, rl)


@sim
@pytest.mark.parametrize("sq,sk,causal,per_batch,cap,layout", [
    pytest.param(45, 45, True, False, 0.0, "bhsd",   # BLOOM / MPT: one slope per head
                 marks=pytest.mark.extended),
    (29, 52, False, True, 4.0, "bshd"),     # per (batch, head), bidirectional, with a cap
])
def test_alibi_slopes(sq, sk, causal, per_batch, cap, layout):
    """alibi_slopes= (FlashAttention's): ``-slope · |i + sk - sq - j|`` on the scaled (capped)
    scores, slopes read on the device; a second call with other slopes reuses the plan."""
    rng = np.random.default_rng()
    b, hq, hk, d, dtype = 2, 3, 1, 32, "bfloat16"
    shape = (lambda h, s: (b, h, s, d)) if layout == "bhsd" else (lambda h, s: (b, s, h, d))
    q, k, v = rand(rng, shape(hq, sq), dtype), rand(rng, shape(hk, sk), dtype), \
        rand(rng, shape(hk, sk), dtype)
    for _ in range(2):
        slopes = rng.uniform(0.01, 0.6, (b, hq) if per_batch else (hq,)).astype(np.float32)
        out = np.full(q.shape, np.nan, NP[dtype])
        res, lse = flash_attention(q, k, v, causal=causal, softcap=cap, alibi_slopes=slopes,
                                   out=out, return_lse=True, layout=layout)
        ro, rl = reference(q, k, v, causal, None, layout, key_window(causal, None), cap,
                           alibi=slopes)
        check(res, ro, v, dtype)
        check_lse(lse, rl)


def test_mod_args_and_alibi_are_checked_before_launch():
    x = np.ones((1, 2, 8, 32), np.float16)
    ids = np.zeros((1, 8), np.int32)
    with pytest.raises(TypeError, match="mod_args are passed to score_mod / mask_mod"):
        flash_attention(x, x, x, mod_args=(ids,))
    with pytest.raises(TypeError, match=r"mask_mod .*must take 6 positional parameters"):
        flash_attention(x, x, x, mask_mod=prefix_lm, mod_args=(ids, ids))
    with pytest.raises(TypeError, match="mod_args must be a tuple"):
        flash_attention(x, x, x, mask_mod=prefix_lm, mod_args=ids)
    with pytest.raises(ValueError, match="at most 6"):
        flash_attention(x, x, x, mask_mod=prefix_lm, mod_args=(1,) * 7)
    with pytest.raises(TypeError, match=r"mod_args\[1\]: expected a CuPy array"):
        flash_attention(x, x, x, mask_mod=lambda b, h, i, j, a, c: True,
                        mod_args=(ids, "no"))
    with pytest.raises(TypeError, match=r"mod_args\[0\]: dtype complex64"):
        flash_attention(x, x, x, mask_mod=lambda b, h, i, j, a: True,
                        mod_args=(ids.astype(np.complex64),))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attention(x, x, x, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="alibi_slopes: dtype"):
        flash_attention(x, x, x, alibi_slopes=np.ones(2, np.float64))
    with pytest.raises(NotImplementedError, match="only the TMA ones"):
        y = np.ones((1, 2, 8, 64), np.float16)
        flash_attention(y, y, y, alibi_slopes=np.ones(2, np.float32),
                        config=WgmmaAttentionConfig(64, 128, 64, overlap=True))


def test_user_functions_are_checked_before_launch():
    x = np.ones((1, 1, 8, 32), np.float16)
    with pytest.raises(TypeError, match=r"score_mod .*must take 5 positional parameters"):
        flash_attention(x, x, x, score_mod=lambda s, b, h: s)
    with pytest.raises(TypeError, match=r"mask_mod .*must take 4 positional parameters"):
        flash_attention(x, x, x, mask_mod=alibi_like)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        flash_attention(x, x, x, score_mod=3.0)
    with pytest.raises(NotImplementedError, match="only the TMA ones take a window"):
        flash_attention(np.ones((1, 1, 8, 64), np.float16), np.ones((1, 1, 8, 64), np.float16),
                        np.ones((1, 1, 8, 64), np.float16), mask_mod=prefix_lm,
                        config=WgmmaAttentionConfig(64, 128, 64, overlap=True))


def test_kernel_variants_share_generators_and_refuse_bad_caps():
    from tilepy.ops import attention_mma_sync as fa
    from tilepy.tile.attention import softcap_score

    cfg = AttentionConfig(32, 32, 16, 16, "float16")
    assert fa.attention_kernel(cfg, True) is fa.attention_kernel(cfg, False, False, (-1, 0))
    assert fa.attention_kernel(cfg, True, False, (4, -1)) is \
        fa.attention_kernel(cfg, False, False, [4, 0])
    assert softcap_score(2.0) is softcap_score(2.0) is softcap_score(2)
    softcap_score(1.0)   # True == 1 must still be refused, not found in a cache
    for bad in (0.0, -1.0, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="softcap"):
            softcap_score(bad)


def _imports_inside(score, b, h, q_idx, kv_idx):
    import math   # an import statement: Numba does not compile it

    return score * math.e


@gpu
def test_gpu_a_user_function_that_does_not_compile_is_a_type_error_naming_it():
    """A score_mod Numba cannot compile (here an import inside it, numba.cuda.errors'
    UnsupportedBytecodeError) is a TypeError that names the function, not a Numba
    traceback."""
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="score_mod '_imports_inside' did not compile"):
        flash_attention(q, q, q, score_mod=_imports_inside)


def _cap_in_float64(score, b, h, q_idx, kv_idx):
    return 30.0 * score / (30.0 + abs(score))   # Python floats: float64 arithmetic


def _cap_in_float32(score, b, h, q_idx, kv_idx):
    return np.float32(30.0) * score / (np.float32(30.0) + abs(score))


def test_float64_in_a_user_function_is_warned_of_once_per_kernel():
    """The PTX check behind the warning: float64 instructions counted (conversions too), the
    functions named, nothing said of float32 PTX or without PTX (the simulator)."""
    import warnings

    from tilepy.ops.attention import warn_float64

    ptx = ("\tmul.rn.f32 \t%f1, %f2, %f3;\n\tcvt.f64.f32 \t%fd1, %f1;\n"
           "\tmul.rn.f64 \t%fd2, %fd1, 0d403E000000000000;\n\tcvt.rn.f32.f64 \t%f4, %fd2;\n")
    with pytest.warns(RuntimeWarning, match=r"score_mod '_cap_in_float64' / mask_mod "
                      r"'prefix_lm' computes in float64 \(3 float64 instructions"):
        assert warn_float64(ptx, _cap_in_float64, prefix_lm, "flash_attention") == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_float64(ptx.split("\tcvt")[0], _cap_in_float32, None, "x") == 0
        assert warn_float64(None, _cap_in_float64, None, "x") == 0


@gpu
def test_gpu_float64_in_a_user_function_is_warned_of():
    """On the GPU the kernel's own PTX is read: a score_mod with Python float constants warns
    (once per kernel, pointing at the caller), the same in np.float32 does not."""
    import warnings

    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="'_cap_in_float64' computes in float64") as rec:
        flash_attention(q, q, q, score_mod=_cap_in_float64)
    assert rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attention(q, q, q, score_mod=_cap_in_float64)   # the same kernel: said once
        out = flash_attention(q, q, q, score_mod=_cap_in_float32)
    s = (q.double() @ q.double().transpose(-1, -2)) / 8.0
    want = torch.softmax(30.0 * s / (30.0 + s.abs()), -1) @ q.double()
    assert (out.double() - want).abs().max().item() < 1e-2
