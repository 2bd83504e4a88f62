#!/usr/bin/env python3
"""Candidate BLAS libraries side by side, each in a process of its own, alternating.

Runs build/bin/blas_compare once per candidate per pass (a library's idle pool threads
spin after each call, so two libraries in one process slow each other down), for PASSES
passes in which the candidates take turns, and prints one markdown table per thread count:
the median GFLOP/s of the passes per GEMM shape, and over all shapes (each once).

Usage: bench_blas.py [--passes N] [--rounds N] [--threads T,T] NAME=LIB[:PREFIX] ...
"""
import argparse
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="build/bin/blas_compare")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5, help="rounds inside each process")
    ap.add_argument("--threads", default="1", help="thread counts, comma-separated")
    ap.add_argument("candidates", nargs="+")
    args = ap.parse_args()
    names = [c.split("=", 1)[0] for c in args.candidates]
    for threads in [int(t) for t in args.threads.split(",")]:
        rates = {}  # (name, shape) -> [GFLOP/s per pass]
        shapes, configs = [], {}
        for p in range(args.passes):
            order = args.candidates[p % len(args.candidates):] + args.candidates[:p % len(args.candidates)]
            for cand in order:
                out = subprocess.run([args.binary, "--rounds", str(args.rounds),
                                      "--threads", str(threads), cand],
                                     check=True, capture_output=True, text=True).stdout
                for line in out.splitlines():
                    name, shape, rate, config = line.split(",", 3)
                    if shape not in shapes:
                        shapes.append(shape)
                    rates.setdefault((name, shape), []).append(float(rate))
                    if config:
                        configs[name] = config
        print(f"\n{threads} thread(s): GFLOP/s, median of {args.passes} passes (each candidate in its "
              f"own process, taking turns; {args.rounds} rounds per process).\n")
        for name in names:
            if name in configs:
                print(f"- {name}: {configs[name]}")
        print()
        print("| shape (m x n x k) | " + " | ".join(f"{n} GFLOP/s" for n in names) + " |")
        print("|---|" + "---:|" * len(names))
        totals = {n: 0.0 for n in names}
        flops_all = 0.0
        for shape in shapes:
            m, n, k = (int(x) for x in shape.split(" ", 2)[2].split(" x "))
            flops = 2.0 * m * n * k
            flops_all += flops
            cells = []
            for name in names:
                rate = statistics.median(rates[(name, shape)])
                totals[name] += flops / (rate * 1e9)
                cells.append(f"{rate:.1f}")
            print(f"| {shape} | " + " | ".join(cells) + " |")
        print("| **all shapes, one each** | " +
              " | ".join(f"**{flops_all / totals[n] / 1e9:.1f}**" for n in names) + " |")


if __name__ == "__main__":
    sys.exit(main())
