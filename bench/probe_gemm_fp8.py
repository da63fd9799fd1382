"""The FP8 GEMM's configs against ``torch._scaled_mm`` in one process: GPU-only TFLOPS
(``measure.gpu_time``) of ``tilepy.gemm`` on e4m3 operands with row / column scales and bf16
out, for each :class:`~tilepy.ops.gemm_kmajor_wgmma.KMajorConfig` below, at square and Llama layer
shapes; the error against ``_scaled_mm`` per row; then block scales (1 × 128 / 128 × 128)
against ``_scaled_mm``'s blockwise form where this PyTorch has it.

Usage: python bench/probe_gemm_fp8.py [--json FILE] [--shapes 4096x4096x4096,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

#: (block_n, stages, persistent, TMA-store epilogue)
CONFIGS = [(128, 4, True, False), (256, 4, True, False), (256, 4, False, False),
           (128, 4, True, True), (256, 4, True, True), (256, 4, False, True)]
SHAPES = "4096x4096x4096,8192x8192x8192,2048x14336x4096,4096x4096x14336,8192x28672x8192"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--shapes", default=SHAPES)
    args = p.parse_args(argv)

    import torch

    import tilepy
    from measure import gpu_time
    from tilepy.ops.gemm_kmajor_wgmma import KMajorConfig

    rows = []
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        a = (torch.randn(m, k, device="cuda") * 3).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device="cuda") * 3).to(torch.float8_e4m3fn)
        sa = torch.rand(m, 1, device="cuda") + 0.5
        sb = torch.rand(1, n, device="cuda") + 0.5
        flop = 2.0 * m * n * k

        def peer():
            return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        want = peer().float()
        t = gpu_time(torch, peer)
        peer_tf = flop / t.ms / 1e9
        print(f"{shape}: torch._scaled_mm {peer_tf:.0f} TFLOPS", flush=True)
        rows.append(dict(shape=shape, name="torch._scaled_mm", tflops=peer_tf, gpu_us=t.ms * 1e3))
        for bn, st, pers, tma in CONFIGS:
            name = f"tilepy fp8 128x{bn} x{st}" + (" persistent" if pers else "") + \
                (" tma-store" if tma else "")
            try:
                cfg = KMajorConfig(block_n=bn, stages=st, persistent=pers, tma_store=tma)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)

                def run():
                    tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sb, out=out, config=cfg)

                run()
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                t = gpu_time(torch, run)
            except Exception as e:  # noqa: BLE001 — a config that does not fit is a row too
                print(f"  {name:28s} failed: {type(e).__name__}: {e}", flush=True)
                rows.append(dict(shape=shape, name=name, error=str(e)))
                continue
            tf = flop / t.ms / 1e9
            rows.append(dict(shape=shape, name=name, tflops=tf, gpu_us=t.ms * 1e3,
                             as_called_us=(t.ms_as_called or 0) * 1e3, of_peer=tf / peer_tf,
                             rel_err=err))
            print(f"  {name:28s} {tf:7.0f} TFLOPS  {tf / peer_tf:5.2f}x  (as called "
                  f"{(t.ms_as_called or 0) * 1e3:.1f} µs, GPU {t.ms * 1e3:.1f} µs, rel err "
                  f"{err:.1e})", flush=True)
        # block scales (DeepGEMM's recipe): 128-column tiles; _scaled_mm's blockwise form where
        # this PyTorch takes it (scales outer-dimension-major, as cuBLASLt wants them)
        kb, nb = -(-k // 128), -(-n // 128)
        sa_blk = torch.rand(m, kb, device="cuda") + 0.5
        sw_blk = torch.rand(nb, kb, device="cuda") + 0.5
        try:
            def peer_blk():
                return torch._scaled_mm(a, w.t(), scale_a=sa_blk.t().contiguous().t(),
                                        scale_b=sw_blk.t(), out_dtype=torch.bfloat16)
            want_blk = peer_blk().float()
            t = gpu_time(torch, peer_blk)
            ptf = flop / t.ms / 1e9
            print(f"  torch._scaled_mm block scales {ptf:7.0f} TFLOPS", flush=True)
            rows.append(dict(shape=shape, name="torch._scaled_mm block", tflops=ptf))
        except Exception as e:  # noqa: BLE001 — a PyTorch without blockwise scaling
            want_blk, ptf = None, None
            print(f"  torch._scaled_mm block scales: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]}", flush=True)
        for bn, st, tma in ((128, 4, False), (128, 6, False), (128, 4, True)):
            cfg = KMajorConfig(block_n=bn, stages=st, tma_store=tma)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)

            def run_blk():
                tilepy.gemm(a, w.t(), scale_a=sa_blk, scale_b=sw_blk.t(), out=out, config=cfg)

            run_blk()
            err = ((out.float() - want_blk).abs().max() / want_blk.abs().max()).item() \
                if want_blk is not None else float("nan")
            t = gpu_time(torch, run_blk)
            tf = flop / t.ms / 1e9
            name = f"tilepy fp8 block scales 128x{bn} x{st}" + (" tma-store" if tma else "")
            rows.append(dict(shape=shape, name=name, tflops=tf, gpu_us=t.ms * 1e3,
                             of_peer=tf / (ptf or peer_tf), rel_err=err))
            print(f"  {name:36s} {tf:7.0f} TFLOPS  {tf / (ptf or peer_tf):5.2f}x "
                  f"{'block' if ptf else 'per-row'} _scaled_mm  (rel err {err:.1e})", flush=True)
        del a, w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
