"""Where the fused GEMM epilogue's time goes on Hopper: the warp-specialised TMA GEMM at one
shape with each epilogue piece alone (bias in float32 or float16, the activations, bias +
GELU), for the register epilogue and the shared-memory-staged one, beside torch's unfused
matmul + bias + GELU, all in one process.

    python bench/probe_epilogue.py [--n 4096] [--json FILE]

Each variant is checked against torch (float32 math) before it is timed; the peer is re-timed
next to every variant (the GPU's clocks drift over a run, bench/NOTES.md).
"""
# ruff: noqa: B023  (closures are timed inside the iteration that makes them)

import argparse
import json

VARIANTS = [  # (name, bias dtype or None, activation)
    ("plain", None, None),
    ("bias f32", "float32", None),
    ("bias f16", "float16", None),
    ("relu", None, "relu"),
    ("gelu", None, "gelu"),
    ("gelu_tanh", None, "gelu_tanh"),
    ("bias f32 + gelu", "float32", "gelu"),
    ("bias f16 + gelu", "float16", "gelu"),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--json")
    args = p.parse_args()
    import torch

    import tilepy
    from tilepy.ops.gemm_wgmma_ws import WsConfig
    from tilepy.testing.timing import time_cuda

    n = args.n
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)
    bias32 = torch.randn(n, device="cuda", dtype=torch.float32)
    biases = {"float32": bias32, "float16": bias32.half()}
    acts = {None: lambda x: x, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
            "silu": torch.nn.functional.silu}
    flop = 2 * n ** 3
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    time_cuda(lambda: torch.matmul(x, x), warmup=50, repeat=5)  # clocks up first
    prod = torch.matmul(a.float(), b.float())
    rows = []
    gelu = torch.nn.functional.gelu
    for staged in (False, True):
        cfg = WsConfig(dtype="float16", smem_epilogue=staged)
        for name, bdt, act in VARIANTS:
            bias = biases[bdt] if bdt else None
            want = acts[act](prod + (bias.float() if bias is not None else 0))
            peer_ms = time_cuda(lambda: gelu(torch.matmul(a, b) + biases["float16"]),
                                warmup=3, repeat=10)
            label = f"{'staged' if staged else 'register'} {name}"
            try:
                out.fill_(float("nan"))
                tilepy.gemm(a, b, bias=bias, activation=act, out=out, config=cfg)
                torch.cuda.synchronize()
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                if not err < 2e-2:
                    raise AssertionError(f"relative error {err}")
                ms = time_cuda(lambda: tilepy.gemm(a, b, bias=bias, activation=act, out=out,
                                                   config=cfg), warmup=3, repeat=10)
            except Exception as e:  # noqa: BLE001 - recorded; the probe goes on
                print(f"{label}: FAILED {e!r}", flush=True)
                rows.append({"variant": label, "error": repr(e)})
                if "ILLEGAL" in repr(e) or "LAUNCH_FAILED" in repr(e):
                    break
                continue
            row = {"variant": label, "n": n, "ms": ms, "tflops": flop / ms / 1e9,
                   "peer": "torch matmul + bias + gelu (unfused)", "peer_ms": peer_ms,
                   "ratio": peer_ms / ms, "rel_err": err}
            rows.append(row)
            print(f"{label:28s} {ms * 1e3:8.1f} us {row['tflops']:7.1f} TFLOPS "
                  f"{row['ratio']:.3f}x unfused torch ({peer_ms * 1e3:.1f} us)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
