#!/usr/bin/env python3
"""Turns Google Benchmark JSON from bench_compile into the table in PERFORMANCE.md."""
import json
import platform
import sys

results, doc = sys.argv[1], sys.argv[2]
data = json.load(open(results))
rows = {b["name"].split("/iterations:")[0]: b for b in data["benchmarks"]}


def ms(name):
    b = rows.get(name)
    return b["real_time"] if b else None


lines = []
lines.append("| benchmark | time (ms) | notes |")
lines.append("|---|---:|---|")
for name, b in rows.items():
    notes = ", ".join(
        (f"{k}={v:.4f}" if k == "imbalance" else f"{k}={v:,.0f}") if isinstance(v, (int, float)) else f"{k}={v}"
        for k, v in b.items()
        if k in ("nodes", "layers", "file_MB", "skeleton_MB", "imbalance", "instructions")
    )
    lines.append(f"| {name} | {b['real_time']:.2f} | {notes} |")
ratios = []
parse, full = ms("gpt1024/protobuf_parse"), ms("gpt1024/import_passes_group")
if parse and full:
    ratios.append(f"- 1,024-layer GPT: import + passes + group-layers takes {full:.0f} ms, "
                  f"{full / parse:.1f}x a bare protobuf parse of the same file ({parse:.0f} ms).")
inline, external = ms("gpt1.5GB/pipec_import_inline"), ms("gpt1.5GB/pipec_import_external")
pinline = ms("gpt1.5GB/protobuf_parse_inline")
if inline and external:
    ratios.append(f"- 1.5 GB of inline weights: pipec imports in {inline:.1f} ms against "
                  f"{external:.1f} ms with external data ({inline / external:.2f}x); "
                  f"a bare protobuf parse copies the weights and takes {pinline:.0f} ms.")
bal = ms("gpt1024/balance_time_64_stages")
if bal:
    ratios.append(f"- balance-stages (time, exact) of the 1,026-layer chain onto 64 stages: "
                  f"{bal:.0f} ms.")
comp = ms("gpt1024/compile_p64_m256")
if comp:
    ratios.append(f"- `pipec compile` of the 1,024-layer GPT for P = 64, M = 256 (balance x3, schedule, "
                  f"lower, verify and simulate each): {comp / 1000:.2f} s.")
ctx = data["context"]
machine = (f"{ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz, "
           f"{platform.system()} {platform.release()}, date {ctx.get('date')}")
section = "\n".join(
    ["<!-- BEGIN import -->",
     "Command: `tools/bench.sh` (runs `build/bin/bench_compile --benchmark_min_time=0.5`).",
     f"Machine: {machine}.", ""] + lines + [""] + ratios + ["<!-- END import -->"])
text = open(doc).read()
begin, end = text.index("<!-- BEGIN import -->"), text.index("<!-- END import -->")
text = text[:begin] + section + text[end + len("<!-- END import -->"):]
open(doc, "w").write(text)
print(section)
