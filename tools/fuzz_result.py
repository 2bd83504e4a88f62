#!/usr/bin/env python3
"""A mutation fuzzer for silent changes of result.

tools/fuzz.py looks for crashes, hangs and runaway memory. This one looks for the worse failure:
a mutated plan or model that runs, exits 0, and trains to other numbers without a word.

It generates a small GPT with its loss and its weights in external data, compiles it for 2 CPU
ranks (a binary and a text plan), and trains 2 steps on a fixed dataset: the reference losses.
Then, seeded and bounded, it mutates
  - the binary plan's bytes (flips, truncations, inserted bytes),
  - the text plan's values (one number or string of one field replaced),
  - the model's .onnx bytes and its .data bytes,
and runs each mutant the same way. Each must be refused with one "pipec: error: ..." line (exit
1 or 2), or train to exactly the reference losses. A text-plan mutant may change the losses only
where the field it changed is one a user sets to change training (HYPERPARAMETERS: the fields of
`training`, which the plan's seal leaves out); any other mutant that exits 0 with other losses
fails the test (an attribute's value or an inline constant edited is refused by the plan's
content_xxh3), and so does a crash, a hang or a runaway of memory.

  tools/fuzz_result.py --pipec build/bin/pipec --mutants 200 --seed 1   # CI
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz import mutate_bytes, run  # noqa: E402

# Text-plan fields whose value is the user's choice of how to train (the plan's `training`, which
# its content hash leaves out): a mutant that changes one may train differently.
HYPERPARAMETERS = {"optimizer", "precision", "recompute"}
TIMEOUT = 30
RSS_LIMIT_KB = 2 << 20


def write_npy(path, shape, values):
    """An int64 .npy file, as numpy writes it."""
    import struct
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (%s), }" % (
        "".join("%d, " % d for d in shape).rstrip(" ") if len(shape) > 1 else "%d," % shape[0])
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%dq" % len(values), *values))


def losses(path):
    try:
        return [json.loads(line)["loss"] for line in open(path)]
    except (OSError, ValueError, KeyError):
        return None


def mutate_field(text, rng):
    """The text plan with one field's value replaced; the field's name."""
    fields = list(re.finditer(r"^( *)([a-z_]+): (\"[^\"\n]*\"|-?[0-9][0-9.e+-]*|[A-Z_]+|true|false)$",
                              text, re.M))
    m = rng.choice(fields)
    value = m.group(3)
    if value.startswith('"'):
        choices = ['""', '"x"', value[:-2] + '"' if len(value) > 2 else '"0"', '"0"', '"-1"']
    elif value in ("true", "false"):
        choices = ["false" if value == "true" else "true"]
    elif re.match(r"^-?[0-9]", value):
        number = float(value)
        choices = ["0", "1", "-1", str(int(number) + 1) if number.is_integer() else "0.5",
                   str(int(number) - 1) if number.is_integer() else "2.5", "2147483647"]
    else:
        choices = ["FORWARD", "BACKWARD", "SEND", "RECV", "OPTIMIZER_STEP", "FREE"]
    new = rng.choice([c for c in choices if c != value] or ["0"])
    return text[:m.start(3)] + new + text[m.end(3):], m.group(2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--mutants", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", default=None, help="copy failing mutants here")
    args = ap.parse_args()
    pipec = os.path.abspath(args.pipec)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="pipec-fuzz-result-")
    model = os.path.join(work, "m", "g.onnx")
    os.makedirs(os.path.dirname(model))
    subprocess.run([pipec, "model", "gpt", "--layers", "2", "--hidden", "16", "--vocab", "50",
                    "--seq", "8", "--loss", "--external-data", "-o", model], check=True,
                   capture_output=True)
    plans = {}
    for emit in ("binary", "text"):
        plans[emit] = os.path.join(work, "m", "g." + emit + ".plan")
        subprocess.run([pipec, "compile", model, "-o", plans[emit], "--stages", "2",
                        "--microbatches", "2", "--hardware", "cpu", "--emit", emit],
                       check=True, capture_output=True)
    # A fixed dataset, so that only the plan and the model decide the numbers.
    data = os.path.join(work, "data")
    os.makedirs(data)
    data_rng = random.Random(7)
    for name in ("input_ids", "labels"):
        write_npy(os.path.join(data, name + ".npy"), (8, 8),
                  [data_rng.randrange(50) for _ in range(64)])
    reference_run = [pipec, "run", plans["text"], "--steps", "2", "--seed", "3", "--quiet",
                     "--optimizer", "adamw", "--lr", "0.01", "--data", data]
    metrics = os.path.join(work, "reference.jsonl")
    subprocess.run(reference_run + ["--metrics", metrics], check=True, capture_output=True)
    reference = losses(metrics)
    text = open(plans["text"]).read()
    originals = {"binary": open(plans["binary"], "rb").read(), "onnx": open(model, "rb").read(),
                 "data": open(model + ".data", "rb").read()}
    failures, counts = [], {"refused": 0, "same": 0, "changed by a hyperparameter": 0}
    for i in range(args.mutants):
        kind = rng.choice(["binary", "text", "text", "onnx", "data"])
        field = None
        plan = plans["binary"] if kind == "binary" else plans["text"]
        mutant_plan = os.path.join(work, "m", "mutant.plan")
        shutil.copy(plan, mutant_plan)
        if kind == "binary":
            open(mutant_plan, "wb").write(mutate_bytes(originals["binary"], rng))
        elif kind == "text":
            mutated, field = mutate_field(text, rng)
            open(mutant_plan, "w").write(mutated)
        elif kind == "onnx":
            open(model, "wb").write(mutate_bytes(originals["onnx"], rng))
        else:
            open(model + ".data", "wb").write(mutate_bytes(originals["data"], rng))
        out_metrics = os.path.join(work, "mutant.jsonl")
        if os.path.exists(out_metrics):
            os.remove(out_metrics)
        cmd = [pipec, "run", mutant_plan] + reference_run[3:] + ["--metrics", out_metrics]
        code, out, rss, timed_out = run(cmd, TIMEOUT, RSS_LIMIT_KB)
        problem = None
        if timed_out:
            problem = "hung"
        elif code not in (0, 1, 2):
            problem = "exit %s" % code
        elif rss > RSS_LIMIT_KB:
            problem = "peak RSS %d KiB" % rss
        elif code != 0:
            if not out.startswith("pipec: error: ") or out.count("\n") != 1:
                problem = "refused without one error line: %r" % out[:300]
            else:
                counts["refused"] += 1
        else:
            got = losses(out_metrics)
            if got == reference:
                counts["same"] += 1
            elif kind == "text" and field in HYPERPARAMETERS:
                counts["changed by a hyperparameter"] += 1
            else:
                problem = "ran silently to losses %s, not %s%s" % (
                    got, reference, " (text field %s)" % field if field else "")
        if problem:
            failures.append("mutant %d (%s): %s" % (i, kind, problem))
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                shutil.copy(mutant_plan, os.path.join(args.keep, "mutant-%d.plan" % i))
        # Restore the model for the next mutant.
        open(model, "wb").write(originals["onnx"])
        open(model + ".data", "wb").write(originals["data"])
    print("fuzz_result: %d mutants (seed %d): %s; %d failed"
          % (args.mutants, args.seed, ", ".join("%d %s" % (v, k) for k, v in counts.items()),
             len(failures)))
    for f in failures:
        print("  " + f)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
