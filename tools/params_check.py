#!/usr/bin/env python3
"""pipec's weights in and out as safetensors, against torch (CI: no torch needed).

For each fixture of tools/fixtures/torch_checkpoints.py (tests/fixtures/torch/checkpoints/NAME/),
runs the two pipec commands of the user guide's "Train a Hugging Face model" walk-through (the
lines between its hf-walkthrough markers, read from docs/USER_GUIDE.md), with the guide's flags and
the fixture's files: compile --params model.safetensors, then run --init other.safetensors (a
checkpoint whose values differ from the ONNX file's) for 3 AdamW steps on 2 stages, saving
trained.safetensors. Then checks:
  - each step's loss equals torch's on the same weights within 1e-5 relative, or, from the
    second step on, within the fixture's float32_spread (below) of the loss's change since the
    first step where that is larger: the weights those losses are computed on are only that
    close to torch's in torch's own float32;
  - the saved file, read with the safetensors package, holds exactly the names of torch's
    state_dict (trained.safetensors: the checkpoint's names and the tied ones), each with
    torch's shape and dtype, and format "pt" metadata (from_pretrained needs it);
  - the weights equal torch's after its 3 steps within 1e-4 of torch's update (norms over every
    element of every parameter), or within torch's own float32 error where that is larger: the
    fixture's "float32_spread", how far torch's float32 steps land from the same steps in
    float64 (GPT-2: 4e-4; Adam's steps of elements whose gradient is near its epsilon turn on
    the gradient's last digits, and the trajectories part from there);
  - the walk-through's last step: the saved weights, loaded back with --init, give the loss torch
    computes for its trained weights ("loss_after") within 1e-5.

Usage: params_check.py --pipec build/bin/pipec [--fixtures DIR] [--guide docs/USER_GUIDE.md]
                       [--work DIR] [--only REGEX]
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-4


def guide_commands(guide):
    """The `pipec compile` and `pipec run` commands of the walk-through, as argument lists."""
    text = open(guide).read()
    block = re.search(r"<!-- BEGIN hf-walkthrough -->(.*?)<!-- END hf-walkthrough -->", text,
                      re.S)
    if not block:
        sys.exit("params_check: %s has no hf-walkthrough section" % guide)
    lines = block.group(1).replace("\\\n", " ").splitlines()
    commands = {}
    for line in lines:
        if not line.strip().startswith("pipec "):
            continue
        words = shlex.split(line.strip())
        if len(words) > 1 and words[0] == "pipec" and words[1] in ("compile", "run"):
            commands[words[1]] = words[2:]
    if set(commands) != {"compile", "run"}:
        sys.exit("params_check: the walk-through lacks a pipec compile or pipec run command")
    return commands


def with_files(args, positional, files):
    """\\p args with its positional argument and the values of the flags in \\p files replaced."""
    out, i, seen = [], 0, set()
    while i < len(args):
        a = args[i]
        if a in files:
            out += [a, files[a]]
            seen.add(a)
            i += 2
            continue
        if a.startswith("-"):
            out.append(a)
            if i + 1 < len(args) and not args[i + 1].startswith("-"):
                out.append(args[i + 1])
                i += 1
        else:
            out.append(positional)
        i += 1
    missing = set(files) - seen
    if missing:
        sys.exit("params_check: the walk-through's command has no %s" % ", ".join(sorted(missing)))
    return out


def run(pipec, args):
    proc = subprocess.run([pipec] + args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError("pipec %s: exit %d: %s" % (" ".join(args[:2]), proc.returncode,
                                                     (proc.stderr or proc.stdout).strip()))
    return proc.stdout


def losses_of(path):
    return [json.loads(line)["loss"] for line in open(path)]


def check(pipec, commands, folder, work):
    ref = json.load(open(os.path.join(folder, "reference.json")))
    f = lambda name: os.path.join(folder, name)  # noqa: E731
    w = lambda name: os.path.join(work, name)  # noqa: E731
    problems = []
    compile_args = with_files(commands["compile"], f("model.onnx"),
                              {"--params": f("model.safetensors"), "-o": w("model.plan")})
    printed = run(pipec, ["compile"] + compile_args).splitlines()
    summary = next((x for x in printed if x.startswith("params:")), printed[0] if printed else "")
    run_args = with_files(commands["run"], w("model.plan"),
                          {"--data": f("data"), "--init": f("other.safetensors"),
                           "--save-weights": w("out.safetensors"),
                           "--metrics": w("losses.jsonl")})
    run(pipec, ["run"] + run_args + ["--quiet"])

    losses = losses_of(w("losses.jsonl"))
    # Step k's loss is computed on the weights of k - 1 steps, which torch's own float32 steps
    # place only within float32_spread of their update: to first order the loss is then
    # uncertain by that fraction of its change since step 1 (a BLAS's other kernels, another
    # summation order, move it that far).
    spread = ref.get("float32_spread", 0.0)
    first = ref["losses"][0] if ref["losses"] else 0.0
    errs = [abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])]
    tols = [max(LOSS_TOL, spread * abs(b - first) / abs(b)) for b in ref["losses"]]
    loss_err = max(errs, default=float("inf"))
    if len(losses) != len(ref["losses"]) or any(e > t for e, t in zip(errs, tols)):
        problems.append("losses %s, torch %s (relative %s, allowed %s)"
                        % (losses, ref["losses"], ", ".join("%.1e" % e for e in errs),
                           ", ".join("%.1e" % t for t in tols)))

    got = load_file(w("out.safetensors"))
    want = load_file(f("trained.safetensors"))
    start = load_file(f("other.safetensors"))
    tied = ref["tied_aliases"]
    with safe_open(w("out.safetensors"), "np") as handle:
        if (handle.metadata() or {}).get("format") != "pt":
            problems.append("metadata %r has no format 'pt'" % handle.metadata())
    if set(got) != set(want):
        problems.append("names: missing %s, extra %s" % (sorted(set(want) - set(got)),
                                                         sorted(set(got) - set(want))))
    err2 = upd2 = 0.0
    worst = 0
    worst_name = ""
    for name in sorted(set(got) & set(want)):
        g, t = got[name], want[name]
        if g.shape != t.shape or g.dtype != t.dtype:
            problems.append("%s: %s %s, torch %s %s" % (name, g.dtype, g.shape, t.dtype, t.shape))
            continue
        base = tied.get(name, name)
        d = g.astype(np.float64) - t
        u = t.astype(np.float64) - start[base]
        err2 += float(np.sum(d * d))
        upd2 += float(np.sum(u * u))
        ratio = np.linalg.norm(d) / max(np.linalg.norm(u), 1e-30)
        if ratio > worst:
            worst, worst_name = ratio, name
    ratio = np.sqrt(err2 / upd2) if upd2 > 0 else float("inf")
    limit = max(WEIGHT_TOL, ref["float32_spread"])
    if not ratio <= limit:
        problems.append("weights: |pipec - torch| is %.2e of torch's update (limit %.2e)"
                        % (ratio, limit))

    after_args = ["run", w("model.plan"), "--data", f("data"), "--init", w("out.safetensors"),
                  "--steps", "1", "--optimizer", "sgd", "--lr", "0", "--metrics",
                  w("after.jsonl"), "--quiet"]
    run(pipec, after_args)
    after = (losses_of(w("after.jsonl")) or [float("nan")])[0]
    after_err = abs(after - ref["loss_after"]) / abs(ref["loss_after"])
    if not after_err <= LOSS_TOL:
        problems.append("the saved weights give loss %.8g, torch's trained ones %.8g"
                        % (after, ref["loss_after"]))
    line = ("%s; losses within %.1e; weights %.1e of the update (torch float32 vs float64 "
            "%.1e; worst tensor %s %.1e); reloaded loss within %.1e" % (
                summary, loss_err, ratio, ref["float32_spread"], worst_name, worst, after_err))
    return problems, line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--fixtures", default=os.path.join(ROOT, "tests", "fixtures", "torch",
                                                       "checkpoints"))
    ap.add_argument("--guide", default=os.path.join(ROOT, "docs", "USER_GUIDE.md"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    commands = guide_commands(args.guide)
    work_root = args.work or tempfile.mkdtemp(prefix="pipec-params-")
    failed = 0
    names = sorted(n for n in os.listdir(args.fixtures)
                   if os.path.isfile(os.path.join(args.fixtures, n, "reference.json")))
    if not names:
        sys.exit("params_check: no fixtures in %s" % args.fixtures)
    names = [n for n in names if not args.only or re.search(args.only, n)]
    for name in names:
        work = os.path.join(work_root, name)
        os.makedirs(work, exist_ok=True)
        try:
            problems, line = check(args.pipec, commands, os.path.join(args.fixtures, name), work)
        except Exception as e:  # noqa: BLE001
            # pipec failed (its stderr), or left a file missing or unreadable
            problems, line = ["%s: %s" % (type(e).__name__, e)], "did not run"
        print("%-9s %s %s" % ("pass" if not problems else "FAIL", name, line))
        for p in problems:
            print("          " + p)
        failed += bool(problems)
    print("%d fixtures, %d failed" % (len(names), failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
