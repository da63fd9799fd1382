"""Host-side cost of one op call on tiny inputs (µs per call; the GPU is not the bottleneck).

Usage: python bench/overhead.py [--json FILE] [--profile OP ...]
Times tilepy.gemm / softmax / flash_attention / grouped_gemm / flash_attention_with_kvcache
next to torch.matmul, cupy.matmul, torch.softmax, SDPA and torch._grouped_mm in the same run:
CPU time per asynchronous call, averaged over many calls after a warm-up (the queue is
drained every 200 calls so it never fills). ``--profile gemm attention kvcache grouped``
prints the top of a cProfile of those ops' repeated calls, by own time and by cumulative
time (where the host time goes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def per_call_us(fn, sync, calls=2000, warmup=50):
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for i in range(calls):
        fn()
        if i % 200 == 199:
            sync()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--profile", nargs="*", choices=PROFILED, default=None,
                   help="ops to profile (none named: gemm)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--breakdown", action="store_true",
                   help="also time the pieces of one tilepy.gemm call (front, cache lookup, "
                        "allocation, the launch through cuda.bindings and through ctypes)")
    args = p.parse_args(argv)

    import torch

    import tilepy

    sync = torch.cuda.synchronize
    rows = []

    def add(name, fn, peer=False):
        us = per_call_us(fn, sync, args.calls)
        rows.append({"name": name, "us_per_call": round(us, 2), "peer": peer})
        print(f"{name:48s} {us:8.1f} µs/call", flush=True)

    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.float16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    # four groups of 16 rows (offsets unchecked: no host synchronisation), b K-major as
    # torch._grouped_mm takes it
    ga = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    gw = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)
    # one decoding step over a small cache (host cost: the GPU work is a few µs), split in
    # four (the decoding kernel and the combine kernel, two launches)
    kq = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn_like(kc)
    lens = torch.full((1,), 256, device="cuda", dtype=torch.int32)
    kout = torch.empty_like(kq)
    # issue 27's small-M rows (bf16, N = K = 4096): host-bound as called, so the host time
    # per call decides their as-called ratio
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x16 = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    x128 = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    # the tilepy calls that are timed and can be profiled (--profile)
    calls = {
        "gemm": lambda: tilepy.gemm(a, b),
        "gemm_m16": lambda: tilepy.gemm(x16, w),
        "gemm_m128": lambda: tilepy.gemm(x128, w),
        "attention": lambda: tilepy.flash_attention(q, q, q),
        "grouped": lambda: tilepy.grouped_gemm(ga, gw.mT, ends, check_offsets=False),
        "kvcache": lambda: tilepy.flash_attention_with_kvcache(
            kq, kc, kv, lens, out=kout, num_splits=4, check_seqlens=False),
    }
    add("torch.matmul 64x64x64 f16", lambda: torch.matmul(a, b), True)
    add("torch.softmax 64x256 f16", lambda: torch.softmax(x, -1), True)
    add("torch SDPA 1x2x64x64 f16",
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), True)
    try:
        import cupy

        ca, cb = cupy.asarray(a), cupy.asarray(b)
        add("cupy.matmul 64x64x64 f16", lambda: cupy.matmul(ca, cb), True)
    except Exception as e:  # noqa: BLE001
        print("cupy unavailable:", e)
        ca = cb = None
    add("tilepy.gemm 64x64x64 f16 (torch)", calls["gemm"])
    add("torch.matmul 16x4096x4096 bf16", lambda: torch.matmul(x16, w), True)
    add("tilepy.gemm 16x4096x4096 bf16 (torch)", calls["gemm_m16"])
    add("torch.matmul 128x4096x4096 bf16", lambda: torch.matmul(x128, w), True)
    add("tilepy.gemm 128x4096x4096 bf16 (torch)", calls["gemm_m128"])
    add("tilepy.gemm 64x64x64 f16 (torch, out=)", lambda: tilepy.gemm(a, b, out=out))
    if ca is not None:
        add("tilepy.gemm 64x64x64 f16 (cupy)", lambda: tilepy.gemm(ca, cb))
    add("tilepy.softmax 64x256 f16 (torch)", lambda: tilepy.softmax(x))
    add("tilepy.flash_attention 1x2x64x64 f16 (torch)", calls["attention"])

    add("tilepy.gemm_softmax 64x64x64 f16 (torch)", lambda: tilepy.gemm_softmax(a, b))
    add("tilepy.grouped_gemm 4 x 16x64x64 bf16 (torch)", calls["grouped"])
    if hasattr(torch, "_grouped_mm"):
        add("torch._grouped_mm 4 x 16x64x64 bf16", lambda: torch._grouped_mm(ga, gw.mT,
                                                                             offs=ends), True)
    add("tilepy.log_softmax 64x256 f16 (torch)", lambda: tilepy.log_softmax(x))
    add("tilepy.flash_attention_with_kvcache B1 256 keys 4 splits (torch, out=)",
        calls["kvcache"])
    add("tilepy.flash_attention_with_kvcache B1 256 keys 1 split (torch, out=)",
        lambda: tilepy.flash_attention_with_kvcache(kq, kc, kv, lens, out=kout, num_splits=1,
                                                    check_seqlens=False))
    add("torch SDPA 1x32x1x256 GQA bf16",
        lambda: torch.nn.functional.scaled_dot_product_attention(
            kq.transpose(1, 2), kc.transpose(1, 2), kv.transpose(1, 2), enable_gqa=True), True)
    if args.breakdown:
        breakdown(add, torch, tilepy, a, b, out)

    if args.profile is not None:
        import cProfile
        import pstats

        for op in args.profile or ["gemm"]:
            fn = calls[op]
            for _ in range(50):
                fn()
            sync()
            pr = cProfile.Profile()
            pr.enable()
            for i in range(500):
                fn()
                if i % 200 == 199:
                    sync()
            sync()
            pr.disable()
            print(f"\n=== cProfile of 500 calls: {op} ===", flush=True)
            stats = pstats.Stats(pr)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(25)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


#: --profile's choices: the repeated calls it can profile.
PROFILED = ("attention", "gemm", "gemm_m16", "gemm_m128", "grouped", "kvcache")


def breakdown(add, torch, tilepy, a, b, out):
    """The pieces of a repeated ``tilepy.gemm(a, b)`` on PyTorch tensors, each timed alone."""
    import ctypes

    from tilepy import arrays
    from tilepy.ops import gemm as gemm_op

    import tilepy.integrations.pytorch as front

    add("  api.gemm (tilepy.gemm)", lambda: tilepy.api.gemm(a, b))
    add("  integrations.pytorch.gemm", lambda: front.gemm(a, b, None, None, 1.0, 0.0, None,
                                                           None, None, None, False))
    print("    _direct:", front._direct(a, b, None, None, None), "is_compiling:",
          torch.compiler.is_compiling(), "dispatch modes:", front._dispatch_modes(),
          "function modes:", front._function_modes(), "functorch:", front._functorch())
    add("  integrations.pytorch._direct(a, b, 3 x None)",
        lambda: front._direct(a, b, None, None, None))
    add("  torch.compiler.is_compiling()", torch.compiler.is_compiling)
    add("  ops.gemm.gemm (no PyTorch front)", lambda: gemm_op.gemm(a, b))
    add("  ops.gemm.gemm (no PyTorch front) again", lambda: gemm_op.gemm(a, b))
    add("  tilepy.gemm again", lambda: tilepy.gemm(a, b))
    add("  arrays.fingerprint(a)", lambda: arrays.fingerprint(a))
    add("  torch.empty(64, 64) f16", lambda: torch.empty(64, 64, dtype=torch.float16,
                                                           device="cuda"))
    key = next(k for k, v in gemm_op._PLANS._entries.items()
               if k[0] is not None and k[0][2] == a.shape)
    entry = gemm_op._PLANS._entries[key]
    ptrs = [a.data_ptr(), b.data_ptr(), 0, 0, out.data_ptr()]
    stream = entry.stream
    add("  bound plan launch (out given)", lambda: entry.bound(stream(), list(ptrs), (1.0, 0.0)))
    plan = entry.bound.plan
    if getattr(plan, "_func", None) is None:
        return
    from cuda.bindings import driver

    gx, gy, gz = plan.grid
    bx, by, bz = plan.block
    h = stream()
    add("  cuLaunchKernel (cuda.bindings), prebuilt", lambda: driver.cuLaunchKernel(
        plan._func, gx, gy, gz, bx, by, bz, plan.smem, h, plan._params_addr, 0))
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    f = int(plan._func)
    add("  cuLaunchKernel (ctypes), prebuilt", lambda: fn(
        f, gx, gy, gz, bx, by, bz, plan.smem, h, plan._params_addr, None))
    # the same parameters as one buffer (CU_LAUNCH_PARAM_BUFFER_POINTER): one copy in the
    # driver instead of one per field
    offset, placed = 0, []
    for slot in plan._slots:
        size = ctypes.sizeof(slot)
        offset = -(-offset // size) * size
        placed.append((offset, slot))
        offset += size
    buf = (ctypes.c_char * max(offset, 8))()
    for off, slot in placed:
        ctypes.memmove(ctypes.addressof(buf) + off, ctypes.addressof(slot), ctypes.sizeof(slot))
    size = ctypes.c_size_t(offset)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
    add("  cuLaunchKernel (ctypes), one parameter buffer", lambda: fn(
        f, gx, gy, gz, bx, by, bz, plan.smem, h, None, extra))
    add("  cuLaunchKernel (cuda.bindings), one parameter buffer", lambda: driver.cuLaunchKernel(
        plan._func, gx, gy, gz, bx, by, bz, plan.smem, h, 0, ctypes.addressof(extra)))
    print("    parameters:", len(plan._slots), "fields,", offset, "bytes")
    from tilepy.tile import device_write

    add("  device_write.stream_capturing (per TMA launch)",
        lambda: device_write.stream_capturing(h))
    out.zero_()
    torch.cuda.synchronize()
    err = fn(f, gx, gy, gz, bx, by, bz, plan.smem, h, None, extra)
    torch.cuda.synchronize()
    print("    one-buffer launch:", err, "result right:",
          torch.allclose(out.float(), a.float() @ b.float(), atol=0.1, rtol=0.01))


if __name__ == "__main__":
    main()
