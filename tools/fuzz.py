#!/usr/bin/env python3
"""A bounded mutation fuzzer over pipec's inputs.

Generates three models (GPT, MLP, ResNet) and two plans (GPT binary, MLP
text), then mutates them (byte flips, truncations, inserted bytes, and in
text plans numbers replaced by extreme values and lines removed) and runs
inspect and compile on each model mutant, report, simulate and run on each
plan mutant. Every command runs under a time limit; the fuzzer fails on any
signal, hang, exit code other than 0, 1 or 2, peak RSS over the limit, or a
failure whose message is not one "pipec: error: ..." line.

  tools/fuzz.py --pipec build/bin/pipec --mutants 300 --seed 1   # CI
  tools/fuzz.py --pipec build/bin/pipec --mutants 20000 --seed $RANDOM  # long run
"""
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

EXTREMES = ["-1", "0", "2147483647", "-2147483648", "1099511627776", "9223372036854775807",
            "4294967296", "1000"]


def run(cmd, timeout, rss_limit_kb):
    """(returncode, output, peak RSS in KiB, timed out)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    out = b""
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        chunk = proc.stdout.read()
        if chunk:
            out += chunk[:65536]
        if pid:
            code = os.waitstatus_to_exitcode(status)
            rest = proc.stdout.read()
            if rest:
                out += rest[:65536]
            return code, out.decode(errors="replace"), usage.ru_maxrss, False
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            return None, out.decode(errors="replace"), usage.ru_maxrss, True
        time.sleep(0.005)


def mutate_bytes(data, rng):
    data = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0 or not data:  # flip bytes
        for _ in range(1 + rng.randrange(8)):
            if data:
                data[rng.randrange(len(data))] ^= 1 + rng.randrange(255)
    elif kind == 1:  # truncate
        data = data[:rng.randrange(len(data))]
    elif kind == 2:  # insert random bytes
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.randrange(256) for _ in range(1 + rng.randrange(16)))
    else:  # overwrite a varint-like run with 0xff (huge lengths and counts)
        at = rng.randrange(len(data))
        data[at:at + 1 + rng.randrange(9)] = b"\xff" * (1 + rng.randrange(9))
    return bytes(data)


def mutate_text(text, rng):
    lines = text.split("\n")
    for _ in range(1 + rng.randrange(3)):
        i = rng.randrange(len(lines))
        if rng.random() < 0.25:
            del lines[i]
        else:
            lines[i] = re.sub(r"-?\d+", lambda m: rng.choice(EXTREMES), lines[i], count=1)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--mutants", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=20, help="seconds per command")
    ap.add_argument("--rss-limit-mb", type=int, default=2048)
    ap.add_argument("--keep", help="copy failing inputs into this folder")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pipec = os.path.abspath(args.pipec)
    work = tempfile.mkdtemp(prefix="pipec-fuzz-")
    rss_limit = args.rss_limit_mb * 1024
    failures = []

    def check(cmd, what):
        code, out, rss, hung = run(cmd, args.timeout, rss_limit)
        line = out.strip().split("\n")[-1] if out.strip() else ""
        why = None
        if hung:
            why = "hung past %gs" % args.timeout
        elif code < 0:
            why = "killed by signal %d" % -code
        elif code not in (0, 1, 2):
            why = "exit %d" % code
        elif rss > rss_limit:
            why = "peak RSS %d MiB" % (rss // 1024)
        elif code != 0 and not (out.startswith("pipec: error: ") and out.count("\n") == 1):
            why = "not one 'pipec: error:' line"
        if why:
            failures.append((what, " ".join(cmd), why, line[:200]))
        return code

    try:
        seeds = {}
        for name, gen in [("gpt", "gpt --layers 2 --hidden 16 --vocab 50 --seq 8 --loss"),
                          ("mlp", "mlp --layers 2 --hidden 16 --vocab 8 --loss"),
                          ("resnet", "resnet --layers 1 --hidden 8 --seq 16 --vocab 10")]:
            path = os.path.join(work, name + ".onnx")
            subprocess.run([pipec, "model"] + gen.split() + ["-o", path], check=True,
                           stdout=subprocess.DEVNULL)
            seeds[name] = path
        plans = {}
        for name, emit in [("gpt", "binary"), ("mlp", "text")]:
            path = os.path.join(work, name + ".plan")
            subprocess.run([pipec, "compile", seeds[name], "-o", path, "--stages", "2",
                            "--microbatches", "2", "--hardware", "cpu", "--emit", emit],
                           check=True, stdout=subprocess.DEVNULL)
            plans[name] = path
        started = time.monotonic()
        for i in range(args.mutants):
            if rng.random() < 0.5:
                name = rng.choice(sorted(seeds))
                data = mutate_bytes(open(seeds[name], "rb").read(), rng)
                mutant = os.path.join(work, "mutant-%s.onnx" % name)
                open(mutant, "wb").write(data)
                what = "model %s mutant %d" % (name, i)
                check([pipec, "inspect", mutant], what)
                out_plan = os.path.join(work, "out.plan")
                if check([pipec, "compile", mutant, "-o", out_plan, "--stages", "2",
                          "--microbatches", "2", "--hardware", "cpu"], what) == 0:
                    check([pipec, "run", out_plan, "--quiet", "--model", mutant,
                           "--timeout", "10"], what)
            else:
                name = rng.choice(sorted(plans))
                raw = open(plans[name], "rb").read()
                mutant = os.path.join(work, "mutant-%s.plan" % name)
                if name == "mlp":
                    data = mutate_text(raw.decode(), rng).encode()
                else:
                    data = mutate_bytes(raw, rng)
                open(mutant, "wb").write(data)
                what = "plan %s mutant %d" % (name, i)
                check([pipec, "report", mutant], what)
                if check([pipec, "simulate", mutant], what) == 0:
                    check([pipec, "run", mutant, "--quiet", "--model", seeds[name],
                           "--timeout", "10"], what)
            if args.keep and failures and failures[-1][0].endswith(" %d" % i):
                os.makedirs(args.keep, exist_ok=True)
                shutil.copy(mutant, os.path.join(args.keep, "%d-%s" % (i, os.path.basename(mutant))))
        elapsed = time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("fuzz: %d mutants (seed %d) in %.0f s, %d failure(s)" %
          (args.mutants, args.seed, elapsed, len(failures)))
    for what, cmd, why, line in failures[:50]:
        print("  %s: %s\n    %s\n    %s" % (what, why, cmd, line))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
