#!/usr/bin/env python3
"""Attention in training, fused (fuse-attention) against the exporter's nodes (--attention unfused).

A GPT from `pipec model gpt` (4 blocks, width 256, 8 heads, vocabulary 2,000; GPT-2's causal
Where) trained on CPU ranks with SGD, one rank, one microbatch of B sequences, at sequence
lengths where the scores grow past the rest of a block's activations. Per length and mode, R
rounds of `pipec run --steps N+1` in a fresh process each, fused and unfused alternating; the
first step of each run is dropped. Per row: the median step (time-stamped progress lines), the
peak resident set size in the steps (what `pipec run` reports), and the plan's prediction of
the step and of the activations the backward keeps.

Usage: tools/bench_attention.py [--pipec build/bin/pipec] [--seqs 256,1024,2048] [--batch 2]
                                [--rounds 3] [--steps 3] [--write]
  --write  puts the table into docs/PERFORMANCE.md (the "attention-training" section)
Exits non-zero when a fused run keeps no less than the unfused one at the longest sequence, or
its loss differs from the unfused run's by more than 1e-4 relative.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_section import write_section  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
STEP = re.compile(r"^step (\d+)/(\d+)\s+loss (\S+)")
PREDICTED = re.compile(r"per step, predicted ([0-9.]+) (s|ms|us)$")
RESIDENT = re.compile(r"^memory: peak resident ([0-9.]+) (KiB|MiB|GiB) in the steps")
MIB = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
UNIT_MS = {"s": 1e3, "ms": 1.0, "us": 1e-3}
LAYERS, HIDDEN, HEADS, VOCAB = 4, 256, 8, 2000


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("bench_attention: %s failed: %s" % (" ".join(cmd), (out.stderr or out.stdout)[-400:]))
    return out.stdout


def compile_plan(pipec, model, plan, batch, unfused):
    """Compiles the plan (and its JSON twin); returns the MiB its rank keeps for the backward."""
    flags = ["--stages", "1", "--microbatches", "1", "--batch", str(batch), "--hardware", "cpu"]
    flags += ["--attention", "unfused"] if unfused else []
    run([pipec, "compile", model, "-o", plan] + flags)
    run([pipec, "compile", model, "-o", plan + ".json", "--emit", "json"] + flags)
    with open(plan + ".json") as f:
        return int(json.load(f)["ranks"][0]["activation_bytes"]) / 2**20


def timed_run(pipec, plan, steps):
    cmd = [pipec, "run", plan, "--steps", str(steps + 1), "--optimizer", "sgd", "--lr", "0.01"]
    stamps, losses, lines = [], [], []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    for line in proc.stdout:
        now = time.perf_counter()
        lines.append(line.rstrip())
        m = STEP.match(line)
        if m:
            stamps.append(now)
            losses.append(float(m.group(3)))
    if proc.wait() != 0 or len(stamps) != steps + 1:
        sys.exit("bench_attention: pipec run %s failed: %s" % (plan, "\n".join(lines[-5:])))
    predicted = [float(m.group(1)) * UNIT_MS[m.group(2)]
                 for m in (PREDICTED.search(l) for l in lines) if m]
    resident = [float(m.group(1)) * MIB[m.group(2)] for m in (RESIDENT.match(l) for l in lines) if m]
    return {"times": [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])], "losses": losses,
            "predicted_ms": predicted[-1], "resident_mib": resident[-1] if resident else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipec", default=os.path.join(ROOT, "build", "bin", "pipec"))
    ap.add_argument("--seqs", default="256,1024,2048")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    seqs = [int(s) for s in a.seqs.split(",")]
    rows, failures = [], []
    started = time.time()
    with tempfile.TemporaryDirectory() as work:
        for seq in seqs:
            model = os.path.join(work, "gpt-%d.onnx" % seq)
            run([a.pipec, "model", "gpt", "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                 "--heads", str(HEADS), "--vocab", str(VOCAB), "--seq", str(seq), "--loss", "-o",
                 model])
            result = {}
            for unfused in (False, True):
                plan = os.path.join(work, "gpt-%d-%s.plan" % (seq, "unfused" if unfused else "fused"))
                result[unfused] = {"plan": plan, "runs": [],
                                   "kept_mib": compile_plan(a.pipec, model, plan, a.batch, unfused)}
            for _ in range(a.rounds):
                for unfused in (False, True):
                    r = result[unfused]
                    r["runs"].append(timed_run(a.pipec, r["plan"], a.steps))
            for unfused in (False, True):
                r = result[unfused]
                times = [t for run_ in r["runs"] for t in run_["times"][1:]]
                r["step_ms"] = statistics.median(times)
                r["resident_mib"] = statistics.median(x["resident_mib"] for x in r["runs"])
                r["predicted_ms"] = r["runs"][-1]["predicted_ms"]
                r["loss"] = r["runs"][0]["losses"][0]
            f, u = result[False], result[True]
            if abs(f["loss"] - u["loss"]) > 1e-4 * abs(u["loss"]):
                failures.append("sequence %d: fused loss %.6f, unfused %.6f" % (seq, f["loss"], u["loss"]))
            rows.append((seq, f, u))
    if rows[-1][1]["kept_mib"] >= rows[-1][2]["kept_mib"]:
        failures.append("sequence %d: fused keeps %.1f MiB, unfused %.1f" %
                        (rows[-1][0], rows[-1][1]["kept_mib"], rows[-1][2]["kept_mib"]))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(l.split(":", 1)[1].strip() for l in info if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = ["Command: `tools/bench_attention.py --seqs %s --batch %d --rounds %d --steps %d` (%d s)."
           % (a.seqs, a.batch, a.rounds, a.steps, time.time() - started),
           "Machine: %s, %d cores, date %s. Model: `pipec model gpt --layers %d --hidden %d "
           "--heads %d --vocab %d --loss` at each sequence, one rank, one microbatch of %d "
           "sequences, SGD, fp32." % (cpu, os.cpu_count(), time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       LAYERS, HIDDEN, HEADS, VOCAB, a.batch),
           "",
           "| sequence | step fused / unfused (ms) | speed-up | predicted fused / unfused (ms) "
           "| kept for the backward, plan (MiB) | peak resident in the steps (MiB) | loss (step 1) |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for seq, f, u in rows:
        out.append("| %d | %.1f / %.1f | %.2f× | %.1f / %.1f | %.1f / %.1f | %.0f / %.0f | %.4f / %.4f |"
                   % (seq, f["step_ms"], u["step_ms"], u["step_ms"] / f["step_ms"],
                      f["predicted_ms"], u["predicted_ms"], f["kept_mib"], u["kept_mib"],
                      f["resident_mib"], u["resident_mib"], f["loss"], u["loss"]))
    text = "\n".join(out)
    print(text)
    if a.write:
        write_section(os.path.join(ROOT, "docs", "PERFORMANCE.md"), "attention-training", text)
    if failures:
        sys.exit("bench_attention: " + "; ".join(failures))


if __name__ == "__main__":
    main()
