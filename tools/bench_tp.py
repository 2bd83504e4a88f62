#!/usr/bin/env python3
"""Tensor parallelism at cluster scale, in the cost model: T against memory and step.

An 8B-shaped Llama (32 layers, width 4096, 32 heads with 8 key/value heads, feed-forward
14,336, vocabulary 128,256, sequence 4,096; `pipec model --light`: the structure without the
weights' bytes) compiled for H100 80 GB ranks: 64 GPUs as 4 pipeline stages times T
tensor-parallel ranks times 16 / T data-parallel replicas, 1F1B over a global batch of 128
sequences (128 / dp microbatches of one sequence per replica), AdamW in bf16 with --recompute
auto and --shard-optimizer. For T = 1, 2,
4 and 8: the parameters a rank holds, the predicted step, the largest rank's peak memory and its
weights with their optimizer state, the share of the step the group's sums take, and whether the
plan fits. A configuration that does not fit is compiled again without a memory limit, for the
step and the memory it would need.

Usage: tools/bench_tp.py [--pipec build/bin/pipec] [--write]
  --write  puts the table into docs/PERFORMANCE.md (the "tensor-parallel" section)
Exits non-zero when a larger T does not hold less weight memory per rank.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory import gb  # noqa: E402
from doc_section import write_section  # noqa: E402

MODEL = ["llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
         "--ffn", "14336", "--vocab", "128256", "--seq", "4096", "--loss", "--light"]
GPUS = 64
STAGES = 4
BATCH = 128


def compile_plan(pipec, model, out, tp, limit=None):
    """The plan's JSON and the seconds compile took, or (None, error)."""
    dp = GPUS // (STAGES * tp)
    cmd = [pipec, "compile", model, "--emit", "json", "-o", out, "--stages", str(STAGES),
           "--tp", str(tp), "--dp", str(dp), "--microbatches", str(BATCH // dp),
           "--batch", str(BATCH),
           "--hardware", "h100", "--precision", "bf16", "--optimizer", "adamw",
           "--recompute", "auto", "--shard-optimizer"]
    if limit:
        cmd += ["--memory-limit", limit]
    started = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None, run.stderr.strip().splitlines()[-1]
    with open(out) as f:
        return json.load(f), time.time() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipec", default="build/bin/pipec")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows, weights = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama8b.onnx")
        subprocess.run([args.pipec, "model", *MODEL, "-o", model], check=True,
                       capture_output=True)
        out = os.path.join(tmp, "plan.json")
        for tp in [1, 2, 4, 8]:
            plan, seconds = compile_plan(args.pipec, model, out, tp)
            fits = plan is not None
            if not fits:
                plan, seconds = compile_plan(args.pipec, model, out, tp, "none")
                if plan is None:
                    sys.exit(f"bench_tp: --tp {tp}: {seconds}")
            ranks = plan["ranks"]
            peak = max(int(r["peak_memory_bytes"]) for r in ranks)
            held = max(int(r["weight_bytes"]) for r in ranks)
            weights.append(held)
            step = float(plan["predicted"]["step_time_s"])
            layers = plan.get("layers", [])
            comm = sum(float(l.get("tp_comm_s", l.get("tpCommS", 0))) for l in layers)
            busy = sum(float(l.get("time_f_s", 0)) + float(l.get("time_i_s", 0)) +
                       float(l.get("time_w_s", 0)) for l in layers)
            params = max(int(s["params"]) for s in plan["stages"])
            rows.append(
                f"| {tp} | {GPUS // (STAGES * tp)} | {params / 1e9:.2f} B | {step:.3f} s | {gb(peak)} GB | "
                f"{gb(held)} GB | {100 * comm / busy if busy else 0:.1f}% | "
                f"{'yes' if fits else 'no'} | {seconds:.1f} s |")
    table = [
        "| T | dp | parameters per rank (largest stage) | predicted step | peak per rank (largest) | weights and "
        "optimizer state per rank (largest) | the group's sums, share of compute | fits 80 GB | "
        "compile |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(table)
    print(text)
    if args.write:
        here = os.path.dirname(os.path.abspath(__file__))
        write_section(os.path.join(here, "..", "docs", "PERFORMANCE.md"), "tensor-parallel", text)
    ok = all(later < earlier for earlier, later in zip(weights, weights[1:]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
