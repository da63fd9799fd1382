"""The kernels' machine code as a launch builds it: each listed ``compile_reports`` target
compiled twice — PTX through the ``ptxas`` executable (the offline compile checks) and as a
launch does where nvJitLink is present (``TILEPY_ASSEMBLER=lto``: NVVM's LTO-IR, nvJitLink's
link-time optimisation and its ptxas; Numba-CUDA's default then) — with each kernel's
registers, spills, ptxas's notes on wgmma (C75xx: serialised wgmmas, injected waits) and its
64-bit divisions side by side.

    python bench/probe_runtime_ptxas.py [--targets mod:fn,...] [--json out.json]
        [--cubins DIR]   # keep the LTO cubins (disassemble with nvdisasm -c)
    python bench/probe_runtime_ptxas.py --launched [--cubins DIR] [--json out.json]   # GPU

``--launched`` runs an FP8 block-scaled GEMM, a bf16 GEMM and attention forward and backward
through the ops and lists every kernel the driver loaded with its registers and local memory
(and keeps their machine code with ``--cubins``). Without it no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = ("tilepy.ops.gemm_kmajor_wgmma:compile_reports",
           "tilepy.ops.gemm_wgmma_ws:compile_reports",
           "tilepy.ops.attention_wgmma:compile_reports",
           "tilepy.ops.attention_backward_wgmma:compile_reports",
           "tilepy.ops.attention_fp8:compile_reports",
           "tilepy.ops.gemm_softmax_wgmma:compile_reports")


def notes(entry: dict) -> list:
    """ptxas's C75xx note numbers: from the report's notes, else from its log."""
    found = entry.get("ptxas_wgmma_notes") or re.findall(r"\(C75\d\d\)",
                                                         entry.get("ptxas_log") or "")
    return sorted({n.split(")")[0] + ")" for n in found})


def div64(entry: dict) -> int:
    return (entry.get("counts") or {}).get("div64", -1)


def launched(json_path=None, cubin_dir=None) -> int:
    """The machine code the ops load: each loaded kernel's registers and local memory bytes a
    thread (spills, stacks), and how it was linked (the linker's log's first line)."""
    import gc

    import torch

    import tilepy
    from numba.cuda.dispatcher import _Kernel

    dev = "cuda"
    m = n = k = 2048
    a = (torch.randn(m, k, device=dev) * 3).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=dev) * 3).to(torch.float8_e4m3fn)
    tilepy.gemm(a, w.t(), scale_a=torch.rand(m, k // 128, device=dev) + 0.5,
                scale_b=torch.rand(k // 128, n // 128, device=dev) + 0.5)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    tilepy.gemm(x, x)
    q, kk, v = (torch.randn(2, 8, 1024, 128, device=dev, dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(3))
    tilepy.flash_attention(q, kk, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    rows = []
    if cubin_dir:
        os.makedirs(cubin_dir, exist_ok=True)
    for obj in gc.get_objects():
        if isinstance(obj, _Kernel):
            attrs = obj._codelibrary.get_cufunc().attrs
            if cubin_dir:   # the loaded machine code (an ObjectCode's bytes), for nvdisasm
                code = obj._codelibrary.get_cubin()
                with open(os.path.join(cubin_dir, obj.entry_name[:100] + ".cubin"), "wb") as f:
                    f.write(bytes(getattr(code, "code", code)))
            rows.append(dict(kernel=obj.entry_name[:120], registers=attrs.regs,
                             local_bytes=attrs.local, shared=attrs.shared,
                             how=obj._codelibrary._linkerinfo_cache.get(
                                 obj._codelibrary._ensure_cc(None), "")[:60]))
    for r in sorted(rows, key=lambda r: r["kernel"]):
        print(f"  regs={r['registers']:3d} local={r['local_bytes']:5d} {r['kernel'][:90]}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(kernels=rows), f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--json")
    ap.add_argument("--cubins")
    ap.add_argument("--lto-only", action="store_true",
                    help="skip the ptxas executable (only the launch's LTO path)")
    ap.add_argument("--launched", action="store_true",
                    help="(GPU) run an FP8 block-scaled GEMM, a bf16 GEMM, attention forward "
                         "and backward at d128 through the ops, then list every loaded "
                         "kernel's registers and local memory as the driver reports them")
    args = ap.parse_args(argv)
    if args.launched:
        return launched(args.json, args.cubins)
    from tilepy.offline import ASSEMBLER_ENV, CUBIN_DIR_ENV, lto_assembler, run_in_subprocess

    rows = []
    print(f"LTO assembler: {lto_assembler()}", flush=True)
    for target in args.targets.split(","):
        t0 = time.perf_counter()
        got = {}
        for how in (("lto",) if args.lto_only else ("ptxas", "lto")):
            env = {ASSEMBLER_ENV: how}
            if how == "lto" and args.cubins:
                env[CUBIN_DIR_ENV] = args.cubins
            try:
                got[how] = run_in_subprocess(target, env=env)
            except Exception as e:  # noqa: BLE001  (one target's failure is a report line)
                got[how] = {"_error": {"name": "_error", "error": str(e)[-400:]}}
        for name in got["lto"]:
            rt = got["lto"][name]
            px = got.get("ptxas", {}).get(name, {})
            row = dict(target=target, name=name, error=rt.get("error") or px.get("error"),
                       div64=div64(rt),
                       lto=dict(registers=rt.get("registers"),
                                spill_stores=rt.get("spill_stores"), notes=notes(rt)),
                       ptxas=dict(registers=px.get("registers"),
                                  spill_stores=px.get("spill_stores"), notes=notes(px)))
            rows.append(row)
            flag = "  <-- serialised at run time" if {"(C7509)", "(C7514)"} & set(
                row["lto"]["notes"]) else ""
            print(f"{name:48s} div64={row['div64']:3d} lto regs={rt.get('registers')} "
                  f"spill={rt.get('spill_stores')} {' '.join(row['lto']['notes'])} | ptxas "
                  f"regs={px.get('registers')} spill={px.get('spill_stores')} "
                  f"{' '.join(row['ptxas']['notes'])}{flag}"
                  + (f" ERROR {row['error'][:200]}" if row["error"] else ""), flush=True)
        print(f"  ({target}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(assembler=lto_assembler(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
