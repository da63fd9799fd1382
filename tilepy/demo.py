"""``python -m tilepy demo``: run what tilepy has on an embedded problem, check it, print a table.

On a GPU: realistic sizes, throughput and the ratio to the peer (cuBLAS through PyTorch or
CuPy) when one is installed. In the simulator: small sizes, correctness only — and it says so.

Each entry is a function ``(gpu: bool) -> dict`` with keys ``what, size, max_rel_err, ok`` and,
on a GPU, ``throughput`` / ``peer`` / ``ratio``. Ops add their entries to :data:`ENTRIES`.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
from numba import cuda  # a module global: the simulator swaps it inside kernels

from .testing.timing import time_cuda

ENTRIES = []


def entry(fn):
    ENTRIES.append(fn)
    return fn


def rel_err(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


@entry
def warp_mma(gpu: bool) -> dict:
    """One warp computes a 16×8×16 f16 product with mma.sync, checked against float64."""
    from .ptx import fragments, mma_m16n8k16_f16_f32

    rng = np.random.default_rng()
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    regs = np.zeros((32, 12), np.float16)
    for lane, r, j, row, col in fragments.a_map(16, 2):
        regs[lane, 2 * r + j] = a[row, col]
    for lane, r, j, row, col in fragments.b_map(16, 2):
        regs[lane, 8 + 2 * r + j] = b[row, col]
    regs32 = regs.view(np.uint32)
    out = np.full((32, 4), np.nan, np.float32)

    @cuda.jit
    def one_warp(regs, out):
        lane = cuda.threadIdx.x
        z = np.float32(0)
        d0, d1, d2, d3 = mma_m16n8k16_f16_f32(regs[lane, 0], regs[lane, 1], regs[lane, 2],
                                              regs[lane, 3], regs[lane, 4], regs[lane, 5],
                                              z, z, z, z)
        out[lane, 0] = d0
        out[lane, 1] = d1
        out[lane, 2] = d2
        out[lane, 3] = d3

    one_warp[1, 32](regs32, out)
    d = np.zeros((16, 8))
    for lane, r, _, row, col in fragments.c_map(1):
        d[row, col] = out[lane, r]
    err = rel_err(d, a.astype(np.float64) @ b.astype(np.float64))
    return {"what": "ptx.mma_m16n8k16 (one warp)", "size": "16x8x16 f16->f32",
            "max_rel_err": err, "ok": err < 1e-5}


def _peer_matmul_tflops(n=4096):
    """cuBLAS fp16 n³ through PyTorch (or CuPy), timed with CUDA events; None if neither."""
    try:
        import torch

        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        for _ in range(3):
            a @ b
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            a @ b
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return 2 * n**3 / float(np.median(times)) / 1e9, "torch.matmul fp16 4096^3"
    except Exception:
        pass
    try:
        import cupy

        from .testing.timing import time_cuda

        a = cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(cupy.float16)
        ms = time_cuda(lambda: a @ a, repeat=10)
        return 2 * n**3 / ms / 1e9, "cupy.matmul fp16 4096^3"
    except Exception:
        return None, None


@entry
def mma_peak(gpu: bool) -> dict | None:
    """Register-only mma.sync loop: the tensor-core rate a Numba kernel reaches."""
    if not gpu:
        return None
    from .testing.peak import run_mma_peak

    tflops, _ = run_mma_peak()
    peer, peer_name = _peer_matmul_tflops()
    return {"what": "mma.sync register loop", "size": "132 SM x 8 blocks x 4 warps",
            "max_rel_err": None, "ok": True, "throughput": f"{tflops:.0f} TFLOPS",
            "peer": peer_name and f"{peer_name}: {peer:.0f} TFLOPS",
            "ratio": peer and tflops / peer}


@entry
def gemm(gpu: bool) -> dict:
    """tilepy.gemm (mma.sync, fused bias + GELU) against float64, and on a GPU against cuBLAS."""
    from . import gemm as tp_gemm

    if not gpu:
        rng = np.random.default_rng()
        m, n, k = 48, 40, 56
        a = rng.standard_normal((m, k)).astype(np.float16)
        b = rng.standard_normal((k, n)).astype(np.float16)
        bias = rng.standard_normal(n).astype(np.float32)
        got = tp_gemm(a, b, bias=bias, activation="relu", out_dtype="float32")
        ref = np.maximum(a.astype(np.float64) @ b.astype(np.float64) + bias, 0)
        err = rel_err(got, ref)
        return {"what": "tilepy.gemm + bias + relu", "size": f"{m}x{n}x{k} f16",
                "max_rel_err": err, "ok": err < 1e-4}
    import torch

    n = 4096
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)
    tp_gemm(a, b, out=out)
    ref = a.float() @ b.float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()


    ours = time_cuda(lambda: tp_gemm(a, b, out=out), repeat=10)
    peer = time_cuda(lambda: torch.matmul(a, b), repeat=10)
    flop = 2 * n**3
    return {"what": "tilepy.gemm fp16", "size": f"{n}^3", "max_rel_err": err, "ok": err < 1e-2,
            "throughput": f"{flop / ours / 1e9:.0f} TFLOPS",
            "peer": f"torch.matmul: {flop / peer / 1e9:.0f} TFLOPS", "ratio": peer / ours}


@entry
def softmax(gpu: bool) -> dict:
    """tilepy.softmax against float64; on a GPU also GB/s against torch.softmax."""
    from . import softmax as tp_softmax

    if not gpu:
        rng = np.random.default_rng()
        x = (rng.standard_normal((6, 1000)) * 4).astype(np.float32)
        got = tp_softmax(x)
        e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        err = rel_err(got, e / e.sum(axis=1, keepdims=True))
        return {"what": "tilepy.softmax", "size": "6x1000 f32", "max_rel_err": err,
                "ok": err < 1e-5}
    import torch

    x = torch.randn(16384, 4096, device="cuda")
    out = torch.empty_like(x)
    tp_softmax(x, out=out)
    ref = torch.softmax(x.double(), dim=-1)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()


    ours = time_cuda(lambda: tp_softmax(x, out=out), repeat=10)
    peer = time_cuda(lambda: torch.softmax(x, dim=-1), repeat=10)
    nbytes = 2 * x.numel() * 4
    return {"what": "tilepy.softmax f32", "size": "16384x4096", "max_rel_err": err,
            "ok": err < 1e-5, "throughput": f"{nbytes / ours / 1e6:.0f} GB/s",
            "peer": f"torch.softmax: {nbytes / peer / 1e6:.0f} GB/s", "ratio": peer / ours}


@entry
def attention(gpu: bool) -> dict:
    """tilepy.flash_attention against float64 (simulator) or SDPA (GPU)."""
    from . import flash_attention

    if not gpu:
        rng = np.random.default_rng()
        q, k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float16) for _ in range(3))
        got = flash_attention(q, k, v, causal=True)
        s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / np.sqrt(32)
        s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
        err = rel_err(got, ref)
        return {"what": "tilepy.flash_attention causal", "size": "1x2x40x32 f16",
                "max_rel_err": err, "ok": err < 2e-3}
    import torch

    b, h, s_len, d = 4, 32, 4096, 128
    q, k, v = (torch.randn(b, h, s_len, d, device="cuda", dtype=torch.float16)
               for _ in range(3))
    out = flash_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


    ours = time_cuda(lambda: flash_attention(q, k, v, out=out), warmup=2, repeat=5)
    peer = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                     warmup=2, repeat=5)
    flop = 4 * b * h * s_len * s_len * d
    return {"what": "tilepy.flash_attention f16", "size": "B4 H32 S4096 D128",
            "max_rel_err": err, "ok": err < 1e-2,
            "throughput": f"{flop / ours / 1e9:.0f} TFLOPS",
            "peer": f"SDPA (default backend): {flop / peer / 1e9:.0f} TFLOPS",
            "ratio": peer / ours}


def run(gpu: bool) -> list[dict]:
    rows = []
    for fn in ENTRIES:
        t0 = time.perf_counter()
        try:
            # In the simulator kernel arithmetic is NumPy scalar arithmetic (in the simulator's
            # threads, so np.errstate does not reach it): padding lanes that compute
            # -inf - -inf (never stored) would print RuntimeWarnings.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                row = fn(gpu)
        except Exception as e:  # a failing entry is reported, and the demo exits non-zero
            row = {"what": fn.__name__, "size": "", "max_rel_err": None, "ok": False,
                   "error": f"{type(e).__name__}: {e}"}
        if row is not None:
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
    return rows


def format_table(rows) -> str:
    head = ["what", "size", "max rel err", "check", "throughput", "peer", "ratio", "s"]
    body = []
    for r in rows:
        err = r.get("max_rel_err")
        body.append([r["what"], r.get("size", ""),
                     "-" if err is None else f"{err:.2e}",
                     "ok" if r["ok"] else "FAIL " + r.get("error", ""),
                     r.get("throughput") or "-", r.get("peer") or "-",
                     "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x",
                     f"{r['seconds']:.1f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [head] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
