"""The kernels' machine code as a launch builds it: each listed ``compile_reports`` target
assembled twice — by the ``ptxas`` executable (the offline compile checks) and by the runtime's
linker (``cuda.core.Linker``: nvJitLink or the driver's JIT, what Numba-CUDA loads kernels
through; ``TILEPY_ASSEMBLER=runtime``) — with each kernel's registers, spills and ptxas's
notes on wgmma (C75xx: serialised wgmmas, setmaxnreg ignored) side by side.

Why: the runtime linker assembles each PTX module as a separate compilation unit. A kernel
whose PTX divides 64-bit integers by a value known only at run time (``div.s64`` /
``rem.s64``) then calls the division routine, and ptxas serialises every wgmma of the kernel
(C7509) and drops its ``setmaxnreg`` (C7504) — while the executable, compiling the whole
program, inlines the routine and reports nothing.

    python bench/probe_runtime_ptxas.py [--targets mod:fn,...] [--json out.json]
        [--cubins DIR]   # keep the runtime linker's cubins (disassemble with nvdisasm -c)

Needs no GPU (nvJitLink from the nvidia-nvjitlink wheel is enough); on a GPU machine without
nvJitLink the driver assembles.
"""

from __future__ import annotations

import argparse
import json
import os
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
    return sorted({n.split(")")[0] + ")" for n in entry.get("ptxas_wgmma_notes") or []})


def div64(entry: dict) -> int:
    return (entry.get("counts") or {}).get("div64", -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--json")
    ap.add_argument("--cubins")
    ap.add_argument("--runtime-only", action="store_true",
                    help="skip the ptxas executable (only the runtime linker)")
    args = ap.parse_args(argv)
    from tilepy.offline import runtime_assembler, run_in_subprocess

    rows = []
    print(f"runtime assembler: {runtime_assembler()}", flush=True)
    for target in args.targets.split(","):
        t0 = time.perf_counter()
        got = {}
        for how in (("runtime",) if args.runtime_only else ("ptxas", "runtime")):
            env = {"TILEPY_ASSEMBLER": how}
            if how == "runtime" and args.cubins:
                env["TILEPY_CUBIN_DIR"] = args.cubins
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                got[how] = run_in_subprocess(target)
            except Exception as e:  # noqa: BLE001  (one target's failure is a report line)
                got[how] = {"_error": {"name": "_error", "error": str(e)[-400:]}}
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        for name in got["runtime"]:
            rt = got["runtime"][name]
            px = got.get("ptxas", {}).get(name, {})
            row = dict(target=target, name=name, error=rt.get("error") or px.get("error"),
                       div64=div64(rt),
                       runtime=dict(registers=rt.get("registers"),
                                    spill_stores=rt.get("spill_stores"), notes=notes(rt)),
                       ptxas=dict(registers=px.get("registers"),
                                  spill_stores=px.get("spill_stores"), notes=notes(px)))
            rows.append(row)
            flag = "  <-- serialised at run time" if "(C7509)" in row["runtime"]["notes"] else ""
            print(f"{name:48s} div64={row['div64']:3d} runtime regs={rt.get('registers')} "
                  f"spill={rt.get('spill_stores')} {' '.join(row['runtime']['notes'])} | ptxas "
                  f"regs={px.get('registers')} spill={px.get('spill_stores')} "
                  f"{' '.join(row['ptxas']['notes'])}{flag}"
                  + (f" ERROR {row['error'][:200]}" if row["error"] else ""), flush=True)
        print(f"  ({target}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(assembler=runtime_assembler(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
