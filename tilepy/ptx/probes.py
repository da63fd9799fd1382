"""Probe kernels: each PTX intrinsic alone in a tiny kernel, for offline compile checks.

For every instruction declared through :func:`tilepy.ptx.asm.instruction` a probe is generated
from its operand kinds (inputs loaded from arrays, outputs stored, so nothing is dead code).
Hand-written intrinsics (addresses, shuffles, ``cp_async_wait_group``) register their own
probes in :data:`EXTRA`. ``python -m tilepy.offline tilepy.ptx.probes:compile_all`` compiles
them all for sm_80 and sm_90 and reports, per probe, how often the intended instruction occurs
in the PTX and what ``ptxas -v`` says.
"""

from __future__ import annotations

import importlib

from . import asm

#: name -> (pyfunc, argtypes builder, opcode expected in the PTX, min_cc)
EXTRA: dict = {}

#: Probes of arch-specific instructions (wgmma, setmaxnreg: sm_90a only). They are compiled for
#: the ``a`` variant of each compute capability at or above their min_cc (reported under the
#: plain name, e.g. ``@sm_90``, with ``"arch": "sm_90a"``).
ARCH_SPECIFIC: set = set()

_MODULES = ("mma", "ldmatrix", "cp_async", "shuffle", "math", "address", "wgmma", "mbarrier",
            "tma", "cluster", "timer", "griddep")

_ARRAYS = ("u32", "i32", "u64", "f32", "f16", "u16")


def load_all():
    """Import every tilepy.ptx module that exists, so REGISTRY and EXTRA are complete."""
    for m in _MODULES:
        try:
            importlib.import_module(f"tilepy.ptx.{m}")
        except ModuleNotFoundError as e:
            if e.name != f"tilepy.ptx.{m}":
                raise


def opcode(spec) -> str:
    """The instruction's mnemonic as it appears in the PTX (first token of the template)."""
    for part in spec.template.replace("\n", ";").replace("{", ";").replace("}", ";").split(";"):
        part = part.strip()
        if part and not part.startswith(".reg"):
            return part.split()[0].rstrip(";")
    raise ValueError(f"no instruction in the template of {spec.name}")


def _argtypes():
    from numba import types

    return (types.uint32[:], types.int32[:], types.uint64[:], types.float32[:],
            types.float16[:], types.uint16[:])


def make_probe(name, spec):
    """A kernel(u32s, i32s, u64s, f32s, f16s, u16s) that calls instruction ``name`` once."""
    fn, _ = asm.REGISTRY[name]
    args = [f"{k}s[{i}]" for i, k in enumerate(spec.ins)]
    lines = [f"def probe_{name}({', '.join(k + 's' for k in _ARRAYS)}):"]
    call = f"fn({', '.join(args)})"
    if not spec.outs:
        lines.append(f"    {call}")
    elif len(spec.outs) == 1:
        lines.append(f"    {spec.outs[0]}s[0] = {call}")
    else:
        outs = [f"r{i}" for i in range(len(spec.outs))]
        lines.append(f"    {', '.join(outs)} = {call}")
        for i, k in enumerate(spec.outs):
            lines.append(f"    {k}s[{i + 1}] = r{i}")
    namespace = {"fn": fn}
    exec(compile("\n".join(lines) + "\n", f"<probe {name}>", "exec"), namespace)
    return namespace[f"probe_{name}"]


def all_probes():
    """[(name, pyfunc, argtypes, opcode, min_cc)] for every intrinsic."""
    load_all()
    out = []
    for name, (fn, spec) in sorted(asm.REGISTRY.items()):
        out.append((name, make_probe(name, spec), _argtypes(), opcode(spec), spec.min_cc))
    for name, (pyfunc, argtypes, op, min_cc) in sorted(EXTRA.items()):
        out.append((name, pyfunc, argtypes(), op, min_cc))
    return out


CCS = ((8, 0), (9, 0))


def compile_all():
    """Reports for every probe and compute capability (run with the simulator off)."""
    from ..offline import compile_kernel

    reports = []
    for name, pyfunc, argtypes, op, min_cc in all_probes():
        for cc in CCS:
            key = f"{name}@sm_{cc[0]}{cc[1]}"
            entry = {"name": key, "probe": name, "opcode": op, "cc": list(cc)}
            target = cc
            if name in ARCH_SPECIFIC and min_cc and tuple(cc) >= tuple(min_cc):
                target = tuple(cc) + ("a",)
            try:
                rep = compile_kernel(key, pyfunc, argtypes, target)
            except asm.UnsupportedTarget as e:
                entry["refused"] = str(e)
            except Exception as e:  # reported, and the test fails on it
                entry["error"] = f"{type(e).__name__}: {e}"
            else:
                found = sum(1 for ln in rep.ptx.splitlines()
                            if ln.strip().split(" ")[0].split("\t")[0].rstrip(";") == op)
                entry.update(found=found, arch=rep.arch, registers=rep.registers,
                             spill_stores=rep.spill_stores, spill_loads=rep.spill_loads,
                             stack_frame=rep.stack_frame, local_bytes=rep.local_bytes)
            entry["min_cc"] = list(min_cc) if min_cc else None
            reports.append(entry)
    return reports


def typing_errors():
    """Compile kernels that call intrinsics with wrong operand types; return the messages.

    Used by the compile layer to check that the error names the intrinsic and what it takes.
    """
    from numba import cuda, types

    from .address import shared_addr
    from .mma import mma_m16n8k16_f16_f32

    def mma_with_float64_fragment(x, out):
        r = mma_m16n8k16_f16_f32(x[0], x[1], x[2], x[3], x[4], x[5], out[0], out[1], out[2],
                                 out[3])
        out[0] = r[0]

    def mma_with_array_operand(x, out):
        r = mma_m16n8k16_f16_f32(x, x[1], x[2], x[3], x[4], x[5], out[0], out[1], out[2], out[3])
        out[0] = r[0]

    def shared_addr_of_scalar(x, out):
        out[0] = shared_addr(out[0], 0)

    cases = [("mma_with_float64_fragment", mma_with_float64_fragment,
              (types.float64[:], types.float32[:])),
             ("mma_with_array_operand", mma_with_array_operand,
              (types.uint32[:], types.float32[:])),
             ("shared_addr_of_scalar", shared_addr_of_scalar,
              (types.uint32[:], types.float32[:]))]
    out = []
    for name, fn, sig in cases:
        try:
            cuda.compile_ptx(fn, sig, cc=(9, 0))
            out.append({"name": name, "message": None})
        except Exception as e:  # the message is the point
            out.append({"name": name, "message": f"{type(e).__name__}: {e}"})
    return out
