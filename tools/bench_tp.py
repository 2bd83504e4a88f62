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
plan fits; for T > 1 also the step and peak with --sequence-parallel. A configuration that does
not fit is compiled again without a memory limit, for the step and the memory it would need.

With --measure it also runs a GPT-2-medium-shaped model (24 blocks of width 1,024, 16 heads,
vocabulary 50,257, sequence 128: 355 M parameters, real weights) for 2 AdamW steps in fp32 on this
machine's CPU, 1 stage, 2 microbatches of 2 sequences: at --tp 1 as one process, and at --tp 2
as 2 MPI processes, and sets each rank's measured peak resident set (what `pipec run` prints)
beside the plan's prediction for that rank.

Usage: tools/bench_tp.py [--pipec build/bin/pipec] [--write] [--measure]
  --write    puts the tables into docs/PERFORMANCE.md (the "tensor-parallel" section, and with
             --measure the "tensor-parallel-memory" section)
Exits non-zero when a larger T does not hold less weight memory per rank, or when a measured
peak is more than 15% from its prediction.
"""
import argparse
import json
import os
import re
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


def compile_plan(pipec, model, out, tp, limit=None, sequence=False):
    """The plan's JSON and the seconds compile took, or (None, error)."""
    dp = GPUS // (STAGES * tp)
    cmd = [pipec, "compile", model, "--emit", "json", "-o", out, "--stages", str(STAGES),
           "--tp", str(tp), "--dp", str(dp), "--microbatches", str(BATCH // dp),
           "--batch", str(BATCH),
           "--hardware", "h100", "--precision", "bf16", "--optimizer", "adamw",
           "--recompute", "auto", "--shard-optimizer"]
    if limit:
        cmd += ["--memory-limit", limit]
    if sequence:
        cmd.append("--sequence-parallel")
    started = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        return None, run.stderr.strip().splitlines()[-1]
    with open(out) as f:
        return json.load(f), time.time() - started


MEASURED = ["gpt", "--layers", "24", "--hidden", "1024", "--heads", "16", "--vocab", "50257",
            "--seq", "128", "--loss"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
GIB = r"([0-9.]+) GiB"


def measure(pipec, tmp):
    """Rows of measured against predicted peak memory per rank at --tp 1 and 2, and whether
    every rank is within 15%."""
    model = os.path.join(tmp, "gpt-medium.onnx")
    subprocess.run([pipec, "model", *MEASURED, "-o", model], check=True, capture_output=True)
    rows, ok = [], True
    for tp in [1, 2]:
        plan = os.path.join(tmp, f"gpt-tp{tp}.plan")
        subprocess.run([pipec, "compile", model, "-o", plan, "--tp", str(tp), "--stages", "1",
                        "--batch", "4", "--microbatches", "2", "--hardware", "cpu",
                        "--optimizer", "adamw", "--precision", "fp32"],
                       check=True, capture_output=True)
        cmd = [pipec, "run", plan, "--steps", "2"]
        if tp > 1:
            cmd = ["mpirun", "-np", str(tp), "--oversubscribe", *cmd, "--comm", "mpi"]
        run = subprocess.run(cmd, capture_output=True, text=True,
                             env={**os.environ, **MPI_ENV})
        if run.returncode != 0:
            sys.exit(f"bench_tp: --tp {tp}: {run.stderr.strip()[-400:]}")
        line = next(l for l in run.stdout.splitlines() if l.startswith("memory:"))
        if tp == 1:
            measured, predicted = [re.search(r"peak resident " + GIB, line).group(1)], \
                [re.search(r"plan predicted " + GIB, line).group(1)]
        else:
            per = re.search(r"per rank (.*?) in the steps, plan predicted (.*?) for", line)
            measured = re.findall(GIB, per.group(1))
            predicted = re.findall(GIB, per.group(2))
        for rank, (m, p) in enumerate(zip(measured, predicted)):
            off = float(m) / float(p) - 1
            ok = ok and abs(off) <= 0.15
            how = "one process" if tp == 1 else f"{tp} MPI processes"
            rows.append(f"| {tp} | {how} | {rank} | {m} GiB | {p} GiB | {100 * off:+.1f}% |")
    table = ["| T | run | rank | measured peak resident (steps) | predicted peak | measured / "
             "predicted - 1 |", "|---|---|---|---|---|---|", *rows]
    return "\n".join(table), ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipec", default="build/bin/pipec")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--measure", action="store_true")
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
            sequence = "-"
            if tp > 1:
                split, _ = compile_plan(args.pipec, model, out, tp, sequence=True)
                if split is None:
                    split, _ = compile_plan(args.pipec, model, out, tp, "none", True)
                if split is None:
                    sys.exit(f"bench_tp: --tp {tp} --sequence-parallel: {_}")
                sequence = (f"{float(split['predicted']['step_time_s']):.3f} s, "
                            f"{gb(max(int(r['peak_memory_bytes']) for r in split['ranks']))} GB")
            rows.append(
                f"| {tp} | {GPUS // (STAGES * tp)} | {params / 1e9:.2f} B | {step:.3f} s | {gb(peak)} GB | "
                f"{gb(held)} GB | {100 * comm / busy if busy else 0:.1f}% | "
                f"{'yes' if fits else 'no'} | {seconds:.1f} s | {sequence} |")
    table = [
        "| T | dp | parameters per rank (largest stage) | predicted step | peak per rank (largest) | weights and "
        "optimizer state per rank (largest) | the group's sums, share of compute | fits 80 GB | "
        "compile | with --sequence-parallel: step, peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(table)
    print(text)
    here = os.path.dirname(os.path.abspath(__file__))
    if args.write:
        write_section(os.path.join(here, "..", "docs", "PERFORMANCE.md"), "tensor-parallel", text)
    ok = all(later < earlier for earlier, later in zip(weights, weights[1:]))
    if args.measure:
        with tempfile.TemporaryDirectory() as tmp:
            measured, within = measure(args.pipec, tmp)
        print(measured)
        ok = ok and within
        if args.write:
            write_section(os.path.join(here, "..", "docs", "PERFORMANCE.md"),
                          "tensor-parallel-memory", measured)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
