"""Offline compilation: PTX for a chosen compute capability and ``ptxas -v``'s resource report.

Needs no GPU, but needs the real Numba-CUDA target: in a process where the CUDA simulator is
on (``NUMBA_ENABLE_CUDASIM=1``, e.g. a test run on a machine without GPU), use
:func:`run_in_subprocess`, which starts a clean interpreter for the compile.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field

# Instruction families whose counts the reports carry (regex on PTX instruction lines).
COUNTED = {
    "mma": r"^\s*mma\.sync",
    "wgmma": r"^\s*wgmma\.",
    "wgmma.mma_async": r"^\s*wgmma\.mma_async",
    "cp.async.bulk.tensor": r"^\s*cp\.async\.bulk\.tensor",
    "mbarrier": r"^\s*mbarrier\.",
    "ldmatrix": r"^\s*ldmatrix\.",
    "stmatrix": r"^\s*stmatrix\.",
    "cp.async": r"^\s*cp\.async\.(ca|cg)\.",
    "cp.async.commit": r"^\s*cp\.async\.commit_group",
    "cp.async.wait": r"^\s*cp\.async\.wait_(group|all)",
    "shfl": r"^\s*shfl\.sync",
    "bar.sync": r"^\s*bar(rier)?\.sync",
    "bar.arrive": r"^\s*bar(rier)?\.arrive",
    "setmaxnreg": r"^\s*setmaxnreg\.",
    "griddepcontrol": r"^\s*griddepcontrol\.",
    "ld.global": r"^\s*ld(\.global)?(\.nc)?(\.v[24])?\.[usbf]\d+\s",   # global or generic
    "ld.local": r"^\s*ld\.local",
    "st.local": r"^\s*st\.local",
    # 64-bit integer division by a run-time value: a call to the division routine, which
    # serialises every wgmma of the kernel where it is assembled as a separate compilation
    # unit (ptxas C7509; tilepy.tile.schedule.udiv)
    "div64": r"^\s*(div|rem)\.[su]64\s",
}


@dataclass
class Report:
    """What one kernel compiled to."""

    name: str
    arch: str
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack_frame: int = -1
    shared_bytes: int = -1
    local_bytes: int = -1
    counts: dict = field(default_factory=dict)
    ptxas_log: str = ""
    ptx: str = ""
    sass: dict | None = None   # what compile_kernel's ``sass`` function found in the cubin

    def summary(self) -> str:
        c = " ".join(f"{k}={v}" for k, v in self.counts.items() if v)
        return (f"{self.name} [{self.arch}] regs={self.registers} spill(st/ld)="
                f"{self.spill_stores}/{self.spill_loads} stack={self.stack_frame}B "
                f"smem={self.shared_bytes}B {c}")


def count_instructions(ptx: str) -> dict:
    lines = ptx.splitlines()
    return {k: sum(1 for ln in lines if re.search(rx, ln)) for k, rx in COUNTED.items()}


def find_ptxas() -> str | None:
    """ptxas from PATH, CUDA_HOME, or the nvidia-cuda-nvcc wheel; None if there is none."""
    env = os.environ.get("TILEPY_PTXAS")
    if env:
        return env
    candidates = []
    for root in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "ptxas")),
                             reverse=True)
        candidates += glob.glob(os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "ptxas"))
    which = shutil.which("ptxas")
    if which:
        candidates.append(which)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def parse_ptxas(log: str, report: Report) -> None:
    m = re.search(r"Used (\d+) registers", log)
    if m:
        report.registers = int(m.group(1))
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                  log)
    if m:
        report.stack_frame, report.spill_stores, report.spill_loads = map(int, m.groups())
    m = re.search(r"(\d+) bytes smem", log)
    report.shared_bytes = int(m.group(1)) if m else 0
    m = re.search(r"(\d+) bytes lmem", log)
    report.local_bytes = int(m.group(1)) if m else 0


#: ``TILEPY_ASSEMBLER=lto``: compile the kernel as Numba-CUDA does for a launch where nvJitLink
#: is present — NVVM's LTO-IR, link-time optimised and assembled by nvJitLink
#: (``cuda.core.Linker``) — instead of PTX through the ``ptxas`` executable: the machine code
#: a launch runs, which can differ (its own optimisation of the IR, its own ptxas).
#: ``TILEPY_CUBIN_DIR``: a directory that keeps each assembled cubin as ``<name>.cubin``.
ASSEMBLER_ENV, CUBIN_DIR_ENV = "TILEPY_ASSEMBLER", "TILEPY_CUBIN_DIR"


def lto_assembler() -> str:
    """The nvJitLink that ``TILEPY_ASSEMBLER=lto`` uses here ("nvJitLink 13.0"), or why there
    is none."""
    try:
        from cuda.bindings import nvjitlink

        return "nvJitLink %d.%d" % nvjitlink.version()
    except Exception as e:  # noqa: BLE001  (a report line, not a failure)
        return f"unavailable ({type(e).__name__}: {e})"


def _lto_assemble(ltoir: bytes, arch: str, cubin_path: str) -> str:
    """Link-time optimise and assemble ``ltoir`` through nvJitLink (verbose): write the cubin,
    return the log."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    linker = Linker(ObjectCode.from_ltoir(ltoir),
                    options=LinkerOptions(arch=arch, link_time_optimization=True, verbose=True))
    try:
        code = linker.link("cubin").code
    except Exception as e:
        raise RuntimeError(f"nvJitLink failed for {arch}: {e}\n"
                           f"{linker.get_error_log()}") from e
    log = (linker.get_info_log() or "") + (linker.get_error_log() or "")
    linker.close()
    with open(cubin_path, "wb") as f:
        f.write(bytes(code))
    return log


def _keep_cubin(cubin: str, name: str) -> None:
    keep = os.environ.get(CUBIN_DIR_ENV)
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copyfile(cubin, os.path.join(keep, re.sub(r"[^\w.-]", "_", name) + ".cubin"))


def ptxas(ptx: str, arch: str, sass=None, name: str = "kernel") -> str:
    """Assemble ``ptx`` for ``arch`` (e.g. 'sm_90a') with -v; return the log. Raises on error.
    ``sass``: a function of the cubin's path, called before the cubin is deleted (e.g.
    :func:`sass_in_flight`); its result is stored in ``ptxas.last_sass``. ``TILEPY_CUBIN_DIR``
    keeps the cubin as ``<name>.cubin``."""
    exe = find_ptxas()
    if exe is None:
        raise FileNotFoundError("ptxas not found: pip install 'tilepy[test]' (nvidia-cuda-nvcc), "
                                "or set TILEPY_PTXAS / CUDA_HOME")
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", cubin],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed for {arch}:\n{proc.stderr}")
        _keep_cubin(cubin, name)
        ptxas.last_sass = sass(cubin) if sass is not None else None
    return proc.stderr + proc.stdout


def sass_in_flight(cubin_path: str) -> dict:
    """What the machine code does between a partial wgmma wait and the full one (``nvdisasm``
    from the nvidia-cuda-nvcc wheel): per ``WARPGROUP.DEPBAR.LE gsb0, 0x1``, the ex2
    (MUFU.EX2) and shuffle instructions before the next ``… 0x0`` — work that overlaps the
    wgmmas still in flight (an overlapped softmax should be there). ``{"ex2_in_flight":
    [...], "shfl_in_flight": [...]}``; empty if nvdisasm is missing."""
    exe = os.path.join(os.path.dirname(find_ptxas() or ""), "nvdisasm")
    if not os.path.isfile(exe):
        return {}
    sass = subprocess.run([exe, "-c", cubin_path], capture_output=True, text=True,
                          check=True).stdout
    ex2, shfl, inside = [], [], False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = True
            ex2.append(0)
            shfl.append(0)
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            inside = False
        elif inside and "MUFU.EX2" in line:
            ex2[-1] += 1
        elif inside and "SHFL." in line:
            shfl[-1] += 1
    return {"ex2_in_flight": ex2, "shfl_in_flight": shfl}


def compile_kernel(name, pyfunc, argtypes, cc=(9, 0), *, assemble=True, sass=None,
                   **options) -> Report:
    """compile_ptx(pyfunc, argtypes) for ``cc`` and, if ``assemble``, run ptxas -v on it
    (``sass``: a function of the cubin's path, its result in ``Report.sass``)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        raise RuntimeError("offline compilation needs the real CUDA target; this process runs "
                           "the simulator (NUMBA_ENABLE_CUDASIM=1): use run_in_subprocess")
    from numba import cuda

    ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=tuple(cc), **options)
    arch = "sm_%d%d%s" % (cc[0], cc[1], cc[2] if len(cc) > 2 else "")
    rep = Report(name=name, arch=arch, counts=count_instructions(ptx), ptx=ptx)
    if assemble and os.environ.get(ASSEMBLER_ENV, "").strip().lower() == "lto":
        # the launch's path: LTO-IR of the same function, nvJitLink's optimisation and ptxas
        ltoir, _ = cuda.compile(pyfunc, argtypes, cc=tuple(cc), device=False, abi="numba",
                                output="ltoir", **options)
        with tempfile.TemporaryDirectory() as d:
            cubin = os.path.join(d, "k.cubin")
            rep.ptxas_log = _lto_assemble(ltoir, arch, cubin)
            _keep_cubin(cubin, name)
            rep.sass = sass(cubin) if sass is not None else None
        parse_ptxas(rep.ptxas_log, rep)
    elif assemble:
        rep.ptxas_log = ptxas(ptx, arch, sass=sass, name=name)
        parse_ptxas(rep.ptxas_log, rep)
        if sass is not None:
            rep.sass = ptxas.last_sass
    return rep


def report_entry(name, build, argtypes, cc=(9, 0), *, threads, launch_bounds=None,
                 sass=False, **info) -> dict:
    """Compile the kernel ``build()`` returns for ``argtypes`` (launch bounds ``threads``) and
    return ``info`` plus its report as a dict (registers, spills, instruction counts, ex2 and
    f64 instruction counts, ptxas's notes on wgmma — C75xx: serialised wgmmas, injected waits
    — and compile seconds; with ``sass``, :func:`sass_in_flight` of the machine code), or plus
    ``error`` when building or compiling raised — reported per kernel so one failure does not
    hide the others. ``launch_bounds``: Numba's (default ``threads``)."""
    import time

    entry = dict(info, name=name, threads=threads)
    t0 = time.perf_counter()
    try:
        rep = compile_kernel(name, build().py_func, argtypes, cc,
                             launch_bounds=threads if launch_bounds is None else launch_bounds,
                             sass=sass_in_flight if sass else None)
        if sass:
            entry.update(rep.sass or {})
    except Exception as e:  # noqa: BLE001  (reported per kernel; the tests fail on it)
        entry["error"] = f"{type(e).__name__}: {e}"
        return entry
    entry.update(registers=rep.registers, spill_stores=rep.spill_stores,
                 spill_loads=rep.spill_loads, stack_frame=rep.stack_frame,
                 local_bytes=rep.local_bytes, counts=rep.counts,
                 ex2=len(re.findall(r"^\s*ex2\.approx", rep.ptx, re.MULTILINE)),
                 f64=len(re.findall(r"^\s*\w+(\.\w+)*\.f64\b", rep.ptx, re.MULTILINE)),
                 ptxas_wgmma_notes=re.findall(r"\(C75\d\d\)[^\n]*", rep.ptxas_log),
                 timer_reads=rep.ptx.count("%globaltimer"),   # a traced kernel's marks
                 compile_seconds=time.perf_counter() - t0)
    return entry


def run_in_subprocess(target: str, timeout: float = 900, env: dict | None = None) -> dict:
    """Run ``python -m tilepy.offline TARGET`` with the simulator off; return its JSON.

    ``TARGET`` is ``module:function``; the function is called with no arguments and returns
    a list of :class:`Report` (or dicts). Errors per kernel come back as
    ``{"name": …, "error": …}`` entries. ``env``: variables set for that process only (e.g.
    :data:`ASSEMBLER_ENV`).
    """
    env = dict(os.environ, **(env or {}))
    env["NUMBA_ENABLE_CUDASIM"] = "0"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "tilepy.offline", target], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"offline compile of {target} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(argv) -> int:
    import importlib

    from numba import config

    if config.ENABLE_CUDASIM:  # `import tilepy` chose the simulator (no GPU): compile without it
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        return subprocess.call([sys.executable, "-m", "tilepy.offline"] + list(argv), env=env)
    (target,) = argv
    mod, fn = target.split(":")
    reports = importlib.import_module(mod).__dict__[fn]()
    out = {}
    for r in reports:
        d = asdict(r) if isinstance(r, Report) else dict(r)
        out[d["name"]] = d
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


def inspect_targets() -> dict:
    """Kernels ``python -m tilepy inspect`` knows: name -> f(dtype) -> (pyfunc, argtypes[,
    compile options])."""
    from .ptx import probes

    def fixed(pyfunc, argtypes, dtype_ok=(None,)):
        def build(dtype):
            if dtype not in dtype_ok:
                raise ValueError(f"this kernel has a fixed dtype; drop --dtype {dtype}")
            return pyfunc, argtypes
        return build

    out = {}
    for name, pyfunc, argtypes, _, _ in probes.all_probes():
        out[f"ptx.{name}"] = fixed(pyfunc, argtypes)

    def mma_loop(dtype):
        if dtype not in (None, "float16"):
            raise ValueError("mma_loop is float16 only")
        from numba import types

        from .testing.peak import mma_loop_kernel

        kernel, _ = mma_loop_kernel()
        return kernel.py_func, (types.uint32[:, :], types.float32[:], types.int64)

    out["mma_loop"] = mma_loop

    def gemm(dtype):
        from .ops.gemm_mma_sync import argtypes, gemm_kernel
        from .tile.config import GemmConfig

        dtype = dtype or "float16"
        if dtype not in ("float16", "bfloat16"):
            raise ValueError("the tensor-core gemm kernel takes float16 or bfloat16")
        cfg = GemmConfig(dtype=dtype)
        return gemm_kernel(cfg, True, dtype).py_func, argtypes(dtype)

    out["gemm"] = gemm

    def softmax(dtype):
        from .arrays import ITEMSIZE
        from .ops.softmax import (
            argtypes,
            kernel_for,
            launch_bounds,
            natural_width,
            plan,
        )

        dtype = dtype or "float32"
        p = plan(4096, simulator=False, itemsize=ITEMSIZE[dtype])   # what the op runs
        kern = kernel_for(p, dtype, False)
        return kern.py_func, argtypes(dtype), {
            "launch_bounds": launch_bounds(p, dtype, natural_width(dtype))}

    def attention(dtype):
        from .ops.attention_mma_sync import AttentionConfig, argtypes, attention_kernel

        dtype = dtype or "float16"
        if dtype not in ("float16", "bfloat16"):
            raise ValueError("flash attention takes float16 or bfloat16")
        cfg = AttentionConfig(128, dtype=dtype)
        kern = attention_kernel(cfg, False, False)
        return kern.py_func, argtypes(), {"launch_bounds": cfg.threads}

    def gemm_softmax(dtype):
        from .ops.gemm_softmax import choose_config
        from .ops.gemm_softmax_mma_sync import argtypes, gemm_softmax_kernel

        dtype = dtype or "float16"
        if dtype not in ("float16", "bfloat16"):
            raise ValueError("gemm_softmax takes float16 or bfloat16")
        cfg = choose_config(1024, dtype, simulator=False)
        return (gemm_softmax_kernel(cfg, True, True).py_func, argtypes("C", True),
                {"launch_bounds": cfg.threads})

    def gemm_wgmma(dtype):
        from .ops.gemm_wgmma import WgmmaConfig, argtypes, wgmma_gemm_kernel

        dtype = dtype or "float16"
        if dtype not in ("float16", "bfloat16"):
            raise ValueError("the wgmma gemm kernel takes float16 or bfloat16")
        cfg = WgmmaConfig(256, 128, 4, dtype)
        return wgmma_gemm_kernel(cfg, True, dtype).py_func, argtypes(dtype)

    def gemm_ws(dtype, epilogue=False):
        from .ops.gemm_wgmma_ws import WsConfig, argtypes, wgmma_ws_gemm_kernel

        dtype = dtype or "float16"
        if dtype not in ("float16", "bfloat16"):
            raise ValueError("the TMA gemm kernel takes float16 or bfloat16")
        cfg = WsConfig(dtype=dtype)
        kern = wgmma_ws_gemm_kernel(cfg, True, dtype, "gelu" if epilogue else None, epilogue,
                                    False)
        return kern.py_func, argtypes(dtype), {"launch_bounds": (cfg.threads, 1)}

    def attention_wgmma(dtype):
        from .ops.attention import hopper_config
        from .ops.attention_wgmma import kernel_argtypes, wgmma_attention_kernel

        dtype = dtype or "float16"
        if dtype not in ("float16", "bfloat16"):
            raise ValueError("flash attention takes float16 or bfloat16")
        cfg = hopper_config(128, dtype)
        return (wgmma_attention_kernel(cfg, False, False).py_func, kernel_argtypes(cfg),
                {"launch_bounds": (cfg.threads, 1) if cfg.producer else cfg.threads})

    # the sm_90 defaults of tilepy.gemm (the TMA kernel, 128x256; with bias + GELU: its
    # slowest compile) and tilepy.flash_attention (head_dim 128); need --cc 90a
    out["gemm_ws"] = gemm_ws
    out["gemm_ws_bias_gelu"] = lambda dtype: gemm_ws(dtype, True)
    out["attention_wgmma"] = attention_wgmma
    out["gemm_wgmma"] = gemm_wgmma  # the cp.async sm_90 kernel (256x128, 4 stages); --cc 90a
    out["gemm_softmax"] = gemm_softmax  # the on-chip kernel for rows of 1024
    out["softmax"] = softmax      # the block-per-row kernel for rows of 4096
    out["attention"] = attention  # head_dim 128, not causal
    return out
