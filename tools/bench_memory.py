#!/usr/bin/env python3
"""Memory at cluster scale, in the simulator: recomputation and sharded optimizer state.

An 8B-shaped Llama (32 layers, width 4096, 32 heads with 8 key/value heads,
feed-forward 14,336, vocabulary 128,256, sequence 8,192; `pipec model --light`:
the structure without the weights' bytes) compiled for H100 80 GB ranks, 8
pipeline stages times 8 data-parallel replicas (64 ranks), 1F1B with 16
microbatches of one sequence per replica, AdamW in bf16. For --recompute none,
all and auto, with and without --shard-optimizer: the predicted step, the
largest rank's peak memory, its optimizer state, how many layers each stage
recomputes, and whether the plan fits the 80 GB. A configuration that does not
fit is compiled again without a memory limit, for the step and the memory it
would need.

Usage: tools/bench_memory.py [--pipec build/bin/pipec] [--write]
  --write  puts the table into docs/PERFORMANCE.md (the "memory" section)
Exits non-zero when auto with sharding does not fit, predicts a slower step than
none without sharding where that fits, or less than 10% faster than all without
sharding.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_section import write_section  # noqa: E402

MODEL = ["llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
         "--ffn", "14336", "--vocab", "128256", "--seq", "8192", "--loss", "--light"]
SHAPE = ["--stages", "8", "--dp", "8", "--microbatches", "16", "--batch", "128",
         "--hardware", "h100", "--precision", "bf16", "--optimizer", "adamw"]


def compile_plan(pipec, model, out, recompute, shard, limit=None):
    """The plan's JSON, or (None, error) when compile refuses it."""
    cmd = [pipec, "compile", model, "--emit", "json", "-o", out, *SHAPE, "--recompute", recompute]
    if shard:
        cmd.append("--shard-optimizer")
    if limit:
        cmd += ["--memory-limit", limit]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None, run.stderr.strip().splitlines()[-1]
    with open(out) as f:
        return json.load(f), None


def gb(value):
    return f"{int(value) / 1e9:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipec", default="build/bin/pipec")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama8b.onnx")
        subprocess.run([args.pipec, "model", *MODEL, "-o", model], check=True,
                       capture_output=True)
        out = os.path.join(tmp, "plan.json")
        for recompute in ["none", "all", "auto"]:
            for shard in [False, True]:
                plan, _ = compile_plan(args.pipec, model, out, recompute, shard)
                fits = plan is not None
                if not fits:
                    plan, error2 = compile_plan(args.pipec, model, out, recompute, shard, "none")
                    if plan is None:
                        sys.exit(f"bench_memory: {recompute} {shard}: {error2}")
                ranks = plan["ranks"]
                peak = max(int(r["peak_memory_bytes"]) for r in ranks)
                state = max(int(r.get("optimizer_bytes", 0)) for r in ranks)
                layers = [int(s.get("recomputed_layers", 0)) for s in plan["stages"]]
                total = [int(s.get("last_layer", 0)) - int(s.get("first_layer", 0)) + 1 for s in plan["stages"]]
                step = float(plan["predicted"]["step_time_s"])
                results[(recompute, shard)] = (step, fits)
                rows.append(
                    f"| {recompute} | {'1/8 per replica' if shard else 'whole'} | {step:.3f} s | "
                    f"{gb(peak)} GB | {gb(state)} GB | "
                    f"{' '.join(f'{a}/{b}' for a, b in zip(layers, total))} | "
                    f"{'yes' if fits else 'no'} |")
    table = [
        "| recompute | optimizer state | predicted step | peak per rank (largest) | "
        "optimizer state per rank (largest) | recomputed layers per stage | fits 80 GB |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    auto, whole_all = results[("auto", True)], results[("all", False)]
    speedup = whole_all[0] / auto[0]
    verdict = [
        "",
        f"auto with sharding fits: {'yes' if auto[1] else 'NO'}; none without sharding fits: "
        f"{'yes' if results[('none', False)][1] else 'no'}; auto with sharding predicts "
        f"{speedup:.3f}x the speed of all without sharding ({(1 - auto[0] / whole_all[0]) * 100:.1f}% "
        "less step time).",
    ]
    text = "\n".join(table + verdict)
    print(text)
    if args.write:
        here = os.path.dirname(os.path.abspath(__file__))
        write_section(os.path.join(here, "..", "docs", "PERFORMANCE.md"), "memory", text)
    none = results[("none", False)]
    ok = auto[1] and (not none[1] or auto[0] <= none[0]) and auto[0] <= 0.9 * whole_all[0]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
