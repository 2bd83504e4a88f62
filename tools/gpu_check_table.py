#!/usr/bin/env python3
"""The arithmetic of tools/gpu-check.sh's tables.

Usage:
  gpu_check_table.py seconds "12.34 ms"
      the duration in seconds (units s, ms, us)
  pipec report PLAN --format json | gpu_check_table.py flops
      training FLOPs per step: 3 x M x the stages' forward FLOPs per microbatch
  gpu_check_table.py cells N T_N T_1 PREDICTED FLOPS PEAK
      the benchmark row from an N-step and a 1-step run (seconds per step):
      "STEADY ms|PREDICTED ms|TFLOP/s|MFU|STEADY/PREDICTED", the steady step
      being (N T_N - T_1) / (N - 1); FLOPS may be empty or 0, PEAK (TFLOP/s)
      empty
  gpu_check_table.py ratio A B
      A / B with two decimals
  gpu_check_table.py alternated METRICS.jsonl,... TORCH_MS,...
      rounds of pipec and torch run one after the other: pipec's step per round
      (the median of a run's steps after its first, from `pipec run --metrics`),
      torch's (TORCH_STEP_MS), and "PIPEC ms|TORCH ms|PIPEC/TORCH" of their medians
  gpu_check_table.py profile FILE
      one line of a `pipec run --profile` file (rank 0): the step, the nodes'
      share of it, launches, host synchronisations, bytes back to the host,
      allocations, and the three op classes that took the most time
"""
import json
import sys


def seconds(text):
    v, u = text.split()
    print(float(v) * {"s": 1, "ms": 1e-3, "us": 1e-6}[u])


def flops():
    d = json.load(sys.stdin)
    print(3 * d["schedule"]["microbatches"] * sum(s["flops_fwd"] for s in d["stages"]))


def cells(n, tN, t1, pred, flops, peak):
    n, tN, t1, pred = int(n), float(tN), float(t1), float(pred)
    steady = (n * tN - t1) / (n - 1) if n > 1 and n * tN > t1 else tN
    tf = float(flops) / steady / 1e12 if flops else 0
    mfu = "%.1f%%" % (100 * tf / float(peak)) if peak and tf else "n/a"
    print("%.2f ms|%.2f ms|%.2f|%s|%.2f" % (steady * 1e3, pred * 1e3, tf, mfu, steady / pred))


def ratio(a, b):
    print("%.2f" % (float(a) / float(b)))


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def alternated(metrics, torch_ms):
    pipec = []
    for path in metrics.split(","):
        with open(path) as f:
            steps = [json.loads(line)["seconds"] for line in f if line.strip()]
        pipec.append(1e3 * median(steps[1:] or steps))
    torch = [float(ms) for ms in torch_ms.split(",")]
    p, t = median(pipec), median(torch)
    print("%.2f ms|%.2f ms|%.2f" % (p, t, p / t))


def profile(path):
    with open(path) as f:
        r = json.load(f)["ranks"][0]
    top = ", ".join("%s %.0f%%" % (c["op"], 100 * c["share_of_step"]) for c in r["classes"][:3])
    print("step %.2f ms, nodes %.0f%% of it; %d launches, %d host syncs, %d bytes to the host, "
          "%d allocations; %s" % (1e3 * r["step_s"], 100 * r["nodes_s"] / max(r["step_s"], 1e-12),
                                  r["launches"], r["host_syncs"], r["d2h_bytes"],
                                  r["allocations"], top))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"seconds": seconds, "flops": flops, "cells": cells, "ratio": ratio,
     "profile": profile, "alternated": alternated}[command](*args)
