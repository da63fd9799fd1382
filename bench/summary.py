"""Print a short table from a gpu_check.sh output directory (bench JSON + demo JSON)."""

import json
import pathlib
import sys


def main(outdir):
    out = pathlib.Path(outdir)
    rows = []
    for path in sorted(out.glob("bench*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            print(f"{path.name}: not valid JSON (the benchmark run failed early)")
            continue
        for b in data.get("benchmarks", []):
            info = b.get("extra_info", {})
            unit = "TFLOPS" if "tflops" in info else "GB/s"
            key = "tflops" if unit == "TFLOPS" else "gbps"
            # the slower of GPU-only and as-called time, as the ratios are (bench/measure.py)
            thr = min(v for v in (info.get(key), info.get(f"{key}_as_called")) if v) \
                if info.get(key) else None
            others = ", ".join(f"{k} {v:.2f}x" for k, v in info.get("ratios", {}).items()
                               if v is not None and k != info.get("peer"))
            rows.append((b["name"], f"{thr:.1f} {unit}" if thr else "-",
                         f"{info['ratio']:.3f}x" if "ratio" in info else "-",
                         info.get("peer", "-"), others or "-"))
    demo = out / "demo.json"
    if demo.exists():
        for r in json.loads(demo.read_text())["rows"]:
            rows.append(("demo: " + r["what"], r.get("throughput") or "-",
                         f"{r['ratio']:.3f}x" if r.get("ratio") else "-",
                         "ok" if r["ok"] else "FAIL", "-"))
    if not rows:
        print("no results found in", out)
        return 1
    head = ("what", "throughput", "ratio", "peer / check", "ratios to other peers")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
