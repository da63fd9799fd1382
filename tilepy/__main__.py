"""Command line: ``python -m tilepy {demo, info, inspect, tune}``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tilepy",
                                description="GPU tile kernels in plain Python on Numba-CUDA.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{demo,info,inspect,tune}")
    d = sub.add_parser("demo", help="run every op on a default problem, check it, print a table")
    d.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    sub.add_parser("info", help="versions, GPU or simulator, cache directories")
    i = sub.add_parser("inspect", help="compile a kernel offline for sm_90 and report resources")
    i.add_argument("op", help="a kernel name; 'list' shows them")
    i.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None)
    i.add_argument("--cc", default="90", help="compute capability, e.g. 80, 90, 90a (default 90)")
    i.add_argument("--ptx", action="store_true", help="print the PTX too")
    t = sub.add_parser("tune", help="time an op's candidate configs on this GPU and remember the "
                       "fastest for later calls (needs a GPU)")
    t.add_argument("op", choices=["gemm", "attention", "softmax"], help="the op to tune")
    t.add_argument("--shape", nargs="+", type=_positive, required=True,
                   help="gemm: M N K, a (M x K) @ (K x N) problem; attention: B H S D "
                        "(batch, query heads, sequence length, head_dim) or B H SQ SK D; "
                        "softmax: ROWS N (rows of N values; also serves log_softmax)")
    t.add_argument("--causal", action="store_true", help="attention: causal masking")
    t.add_argument("--heads-kv", type=_positive, default=None,
                   help="attention: key/value heads (GQA; default: the query heads)")
    t.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    t.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                   help="float32: softmax only")
    t.add_argument("--repeat", type=_positive, default=20,
                   help="timed runs per candidate (median; default 20)")
    t.add_argument("--json", metavar="FILE", help="also write the result rows as JSON")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def cmd_info() -> int:
    from importlib import metadata

    import numpy

    import tilepy

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    rows = [("tilepy", tilepy.__version__), ("python", sys.version.split()[0]),
            ("numpy", numpy.__version__), ("numba", version("numba")),
            ("numba-cuda", version("numba-cuda"))]
    # NVVM is only loadable with the simulator off: ask a clean interpreter.
    probe = ("from numba.cuda.cudadrv.nvvm import NVVM; "
             "print('.'.join(map(str, NVVM().get_version())))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"), check=False)
    nvvm = proc.stdout.strip() if proc.returncode == 0 else "unavailable"
    rows.append(("NVVM", f"{nvvm or 'unavailable'} (nvidia-nvvm wheel: {version('nvidia-nvvm')})"))
    from .offline import find_ptxas

    rows.append(("ptxas", find_ptxas() or "not found (offline checks need tilepy[test])"))
    if tilepy.SIMULATOR:
        rows.append(("target", "simulator (NUMBA_ENABLE_CUDASIM=1: no GPU found)"))
    else:
        from numba import cuda

        for dev in cuda.list_devices():
            cc = dev.compute_capability
            name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
            rows.append((f"GPU {dev.id}", f"{name} (compute capability {cc[0]}.{cc[1]})"))
    from numba.core import config

    rows.append(("numba cache", config.CACHE_DIR or "next to each source file (__pycache__)"))
    from . import cache, kcache

    rows.append(("tilepy cache", cache.cache_dir()))
    kernels = kcache.kernel_cache_dir() if kcache.enabled() else "off (TILEPY_KERNEL_CACHE=0)"
    rows.append(("kernel cache", kernels + (" (unused in the simulator)" if tilepy.SIMULATOR
                                            else "")))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return 0


def cmd_demo(args) -> int:
    import tilepy

    from . import demo

    gpu = not tilepy.SIMULATOR
    where = "GPU" if gpu else "the CUDA SIMULATOR (no GPU found): small sizes, correctness only"
    print(f"tilepy {tilepy.__version__} demo — running on {where}\n")
    rows = demo.run(gpu)
    print(demo.format_table(rows))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=1, default=str)
    if not gpu:
        print("\nRan in the CUDA simulator: each PTX instruction ran as its Python twin.")
    return 0 if all(r["ok"] for r in rows) else 1


def cmd_inspect(args) -> int:
    import tilepy

    if tilepy.SIMULATOR:
        # Offline compilation needs the real CUDA target: rerun without the simulator.
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        return subprocess.call([sys.executable, "-m", "tilepy"] + sys.argv[1:], env=env)
    from . import offline

    targets = offline.inspect_targets()
    if args.op == "list":
        for name in sorted(targets):
            print(name)
        return 0
    if args.op not in targets:
        _parser().error(f"unknown kernel {args.op!r}; 'python -m tilepy inspect list' shows them")
    cc = args.cc.strip()
    if not (cc[:2].isdigit() and cc[2:] in ("", "a")):
        _parser().error(f"--cc wants e.g. 80, 90 or 90a, not {args.cc!r}")
    try:
        pyfunc, argtypes, *options = targets[args.op](args.dtype)
    except ValueError as e:
        _parser().error(str(e))
    options = options[0] if options else {}
    import time

    t0 = time.perf_counter()
    rep = offline.compile_kernel(args.op, pyfunc, argtypes, (int(cc[0]), int(cc[1]), cc[2:]),
                                 **options)
    seconds = time.perf_counter() - t0
    print(rep.summary())
    print(f"  cold compile (NVVM + ptxas) {seconds:.2f} s")
    print(f"  registers/thread {rep.registers}, spill stores {rep.spill_stores} B, spill loads "
          f"{rep.spill_loads} B, stack frame {rep.stack_frame} B, shared {rep.shared_bytes} B, "
          f"local {rep.local_bytes} B")
    print("  PTX instructions: " + ", ".join(f"{k} {v}" for k, v in rep.counts.items()))
    if args.ptx:
        print(rep.ptx)
    return 0


def cmd_tune(args) -> int:
    import tilepy

    if tilepy.SIMULATOR:
        print("python -m tilepy tune: needs a CUDA GPU; this process runs the CUDA simulator "
              "(no GPU found, or NUMBA_ENABLE_CUDASIM=1), where timings mean nothing",
              file=sys.stderr)
        return 1
    from .cache import TuneCache
    from .tune import attention_space, softmax_space, spaces

    if args.op == "softmax":
        rows, n = args.shape
        result = softmax_space.tune_softmax(rows, n, args.dtype, repeat=args.repeat,
                                            table=False)
        what = f"softmax {rows}x{n}"
        cache = TuneCache(softmax_space.OP)
    elif args.op == "gemm":
        m, n, k = args.shape
        result = spaces.tune_gemm(m, n, k, args.dtype, args.batch, repeat=args.repeat,
                                  table=False)
        what = f"gemm {m}x{n}x{k} batch {args.batch}"
        cache = TuneCache(spaces.OP)
    else:
        b, h, sq, *rest = args.shape
        sk, d = (rest[0], rest[1]) if len(rest) == 2 else (sq, rest[0])
        result = attention_space.tune_attention(b, h, sq, sk, d, args.dtype, args.causal,
                                                args.heads_kv, repeat=args.repeat, table=False)
        what = (f"attention B{b} H{h}" + (f" Hkv{args.heads_kv}" if args.heads_kv else "")
                + f" S{sq}" + (f"/{sk}" if sk != sq else "") + f" D{d}"
                + (" causal" if args.causal else ""))
        cache = TuneCache(attention_space.OP)
    print(f"tilepy {tilepy.__version__} tune {what} {args.dtype} on {result.key.split('|')[3]}")
    print(result.table)
    for what, why in result.rejected:
        print(f"   {'not tried':>12}  {what}  ({why})")
    where = cache.path
    print(f"best: {result.config.describe()}" + (f"\nsaved to {where} under {result.key}"
                                                 if result.saved else "\nnot saved"))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"key": result.key, "best": result.config.describe(),
                       "rows": result.rows, "rejected": result.rejected}, f, indent=1)
    return 0


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "tune":
        wanted = {"gemm": (3,), "attention": (4, 5), "softmax": (2,)}[args.op]
        if len(args.shape) not in wanted:
            parser.error(f"--shape: {args.op} takes "
                         + {"gemm": "M N K", "attention": "B H S D or B H SQ SK D",
                            "softmax": "ROWS N"}[args.op]
                         + f", got {len(args.shape)} values")
        if args.dtype == "float32" and args.op != "softmax":
            parser.error(f"--dtype float32: {args.op} tunes float16 or bfloat16")
    if args.command == "info":
        return cmd_info()
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "tune":
        return cmd_tune(args)
    return cmd_inspect(args)


if __name__ == "__main__":
    sys.exit(main())
