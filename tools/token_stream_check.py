#!/usr/bin/env python3
"""pipec's token-stream training against torch (CI: no torch needed).

The fixture of tools/fixtures/torch_token_stream.py (tests/fixtures/torch/stream/): a tiny GPT-2
exported with its loss, train.bin and eval.bin (uint16 token files of real English text), and
reference.json, torch's 200 AdamW steps on the windows `pipec run --data` draws (seed 1, global
batch 8 of 2 samples per microbatch) with the eval loss every 50 steps. This script:

  1. checks the fixture against itself: the token files are the ones torch read, and the
     seeded window order written out below (splitmix64, one Fisher-Yates shuffle per epoch,
     as docs/USER_GUIDE.md gives it) draws the windows and tokens that torch's first step read;
  2. compiles the model for 2 stages, 1F1B, 4 microbatches and trains it 200 steps:
       pipec run PLAN --data train.bin --eval-data eval.bin --eval-every 50 --eval-steps 4
                      --steps 200 --optimizer adamw --lr 6e-4 --weight-decay 0.01 --seed 1
                      --metrics run.jsonl --save-weights full.onnx --quiet
     and compares each step's "loss" and each eval step's "eval_loss" with torch's;
  3. the same on 2 stages x 2 data-parallel replicas of 2 microbatches (--dp 2, the same global
     batch of 8 windows, the same samples in each microbatch);
  4. resumes: 120 steps with --checkpoint DIR --checkpoint-every 40, then --steps 200
     --checkpoint DIR --resume: the 120 steps' losses and the resumed steps 121..200's (eval
     losses included) must equal the uninterrupted run's of step 2 exactly, and the weights the
     resumed run saves must equal the uninterrupted run's bit for bit: every initializer of the
     two .onnx files, read with the onnx package when it is installed, else the files' bytes.

Tolerance: relative, per step, max(--rtol, --spread-factor x the fixture's float32 spread so
far). The spread is how far torch's own runs with the rounding in other places (one batch
instead of microbatches, the replicas' gradient sum, AdamW's update in float64 per element, the
whole run in float64) land from the reference, the largest up to that step. At GPT-2's learning
rate, 6e-4, it stays below 4e-6 for all 200 steps, so every step is held to --rtol (1e-4). (At
1e-3 it does not: after some 55 steps the trajectories of any two implementations part, to a few
1e-3 by step 200, as Adam turns gradients that are rounding noise, such as the attention key
bias's, into steps of the learning rate's size; the spread term exists for such runs.) The eval
losses are held to the tolerance of their step. A wrong
window, epoch, eval batch, mean or optimizer setting moves the losses by percents (a wrong
learning rate, weight decay or epsilon fails within the first 25 steps; epoch 1 drawn in
epoch 0's order fails at its first step, the 138th).

Usage: token_stream_check.py --pipec build/bin/pipec [--fixtures DIR] [--work DIR]
                             [--rtol 1e-4] [--spread-factor 4] [--self-test]
--self-test runs step 1 alone (no pipec). Exit status: 0 all agree, 1 a check failed (the first
failing step is named), 2 bad usage.
"""

import argparse
import array
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "torch", "stream")
MASK = (1 << 64) - 1
RESUME_AT, CHECKPOINT_EVERY = 120, 40


class CheckFailed(Exception):
    pass


# ---------------------------------------------------------------------------
# The window order of `pipec run --data FILE`.

def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def permutation(windows, seed, epoch):
    """Epoch `epoch`'s order of `windows` windows: Fisher-Yates from the last position down,
    position i swapping with splitmix64(key + i) mod (i + 1), key = splitmix64(splitmix64(seed)
    + epoch)."""
    key = splitmix64((splitmix64(seed) + epoch) & MASK)
    perm = list(range(windows))
    for i in range(windows - 1, 0, -1):
        j = splitmix64((key + i) & MASK) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def window_of(n, windows, seed, cache):
    """The window global sample n reads: perm_e[n % N] of epoch e = n // N."""
    e, p = divmod(n, windows)
    if e not in cache:
        cache[e] = permutation(windows, seed, e)
    return cache[e][p]


def read_tokens(path):
    """A raw uint16 little-endian token file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) % 2:
        raise CheckFailed("%s: %d bytes, not whole uint16 tokens" % (path, len(data)))
    tokens = array.array("H")
    tokens.frombytes(data)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens, hashlib.sha256(data).hexdigest()


def self_test(ref, fixtures):
    """Step 1: the fixture agrees with itself and with the order written out above. Returns a
    one-line summary."""
    # SplitMix64's published first output from state 0.
    if splitmix64(0) != 0xE220A8397B1DCDAF:
        raise CheckFailed("splitmix64(0) is %#x, not 0xe220a8397b1dcdaf" % splitmix64(0))
    S, G, seed = ref["S"], ref["G"], ref["seed"]
    if ref["B"] * ref["M"] != G:
        raise CheckFailed("reference.json: B %d x M %d is not G %d" % (ref["B"], ref["M"], G))
    files = {}
    for part in ("train", "eval"):
        d = ref["data"][part]
        tokens, sha = read_tokens(os.path.join(fixtures, d["file"]))
        if sha != d["sha256"]:
            raise CheckFailed("%s is not the file torch read (sha256 %s, reference %s)"
                              % (d["file"], sha, d["sha256"]))
        windows = (len(tokens) - 1) // S
        if len(tokens) != d["tokens"] or windows != d["windows"]:
            raise CheckFailed("%s: %d tokens, %d windows; reference %d, %d"
                              % (d["file"], len(tokens), windows, d["tokens"], d["windows"]))
        if max(tokens) >= 256:
            raise CheckFailed("%s holds token %d, over the vocabulary" % (d["file"], max(tokens)))
        files[part] = (tokens, windows)
    tokens, windows = files["train"]
    for e in (0, 1):
        if sorted(permutation(windows, seed, e)) != list(range(windows)):
            raise CheckFailed("epoch %d's order is not a permutation" % e)
    cache = {}
    step0 = [window_of(n, windows, seed, cache) for n in range(G)]
    if step0 != ref["step0_windows"]:
        raise CheckFailed("step 1 draws windows %s, torch read %s" % (step0, ref["step0_windows"]))
    for w in ref["first_windows"]:
        got = window_of(w["sample"], windows, seed, cache)
        ids = list(tokens[got * S: got * S + S + 1])
        if got != w["window"] or ids != w["tokens"]:
            raise CheckFailed("sample %d: window %d %s, torch's %d %s"
                              % (w["sample"], got, ids, w["window"], w["tokens"]))
    if permutation(windows, seed, 1) == cache[0]:
        raise CheckFailed("epoch 1 repeats epoch 0's order")
    steps, every = ref["steps"], ref["eval_every"]
    if len(ref["losses"]) != steps or len(ref["float32_spread"]["losses"]) != steps:
        raise CheckFailed("reference.json: %d losses for %d steps"
                          % (len(ref["losses"]), steps))
    if sorted(ref["eval_losses"], key=int) != [str(s) for s in range(every, steps + 1, every)]:
        raise CheckFailed("reference.json: eval steps %s" % sorted(ref["eval_losses"], key=int))
    crossing = windows // G + 1
    return ("fixture: train.bin %d windows, eval.bin %d, step 1 reads %s; the run enters its "
            "second epoch at step %d" % (windows, files["eval"][1], step0, crossing))


# ---------------------------------------------------------------------------
# Tolerances, metrics and the comparisons.

def tolerances(ref, rtol, factor):
    """Per 1-based step: max(rtol, factor x the largest float32 spread up to that step)."""
    spread = ref["float32_spread"]
    eval_spread = {int(k): v for k, v in spread["eval_losses"].items()}
    out, so_far = {}, 0.0
    for t, s in enumerate(spread["losses"], start=1):
        so_far = max(so_far, s, eval_spread.get(t, 0.0))
        out[t] = max(rtol, factor * so_far)
    return out


_NONFINITE = re.compile(r"(?<![\w\"])([+-]?)(nan|inf(?:inity)?)(?![\w\"])", re.I)


def read_metrics(path):
    """{step: {"loss": .., "eval_loss": ..}} of a --metrics file; bare nan/inf read as floats."""
    if not os.path.isfile(path):
        raise CheckFailed("%s was not written" % path)
    out = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                try:
                    entry = json.loads(_NONFINITE.sub(
                        lambda m: '"%s%s"' % (m.group(1), m.group(2)), line))
                except json.JSONDecodeError as err:
                    raise CheckFailed("%s:%d: %s" % (path, number, err))
            step = entry.get("step")
            if not isinstance(step, int):
                raise CheckFailed("%s:%d: no whole-number step" % (path, number))
            if step in out:
                raise CheckFailed("%s:%d: step %d again" % (path, number, step))
            out[step] = {k: float(entry[k]) for k in ("loss", "eval_loss")
                         if entry.get(k) is not None}
    return out


def compare(name, metrics, ref, tols):
    """Every step's loss and every eval loss against torch's; returns a summary line, raises
    CheckFailed naming the first step that fails."""
    steps = ref["steps"]
    evals = {int(k): v for k, v in ref["eval_losses"].items()}
    if sorted(metrics) != list(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(metrics))
        extra = sorted(set(metrics) - set(range(1, steps + 1)))
        raise CheckFailed("%s: steps missing %s, unexpected %s" % (name, missing[:10], extra[:10]))
    worst = (0.0, 0)           # relative error, step
    worst_ratio = (0.0, 0)     # relative error / tolerance, step
    worst_eval = (0.0, 0)
    first_fail = None
    for t in range(1, steps + 1):
        checks = [("loss", ref["losses"][t - 1])]
        if t in evals:
            checks.append(("eval_loss", evals[t]))
        elif "eval_loss" in metrics[t]:
            first_fail = first_fail or "step %d: an eval loss, torch evaluates at %s" % (
                t, sorted(evals))
        for key, want in checks:
            got = metrics[t].get(key)
            if got is None:
                first_fail = first_fail or "step %d: no %s" % (t, key)
                continue
            rel = abs(got - want) / abs(want) if math.isfinite(got) else math.inf
            if key == "loss":
                worst = max(worst, (rel, t))
            else:
                worst_eval = max(worst_eval, (rel, t))
            worst_ratio = max(worst_ratio, (rel / tols[t], t))
            if not rel <= tols[t] and first_fail is None:
                first_fail = ("step %d: %s %.9g, torch %.9g: relative error %.2e over the "
                              "tolerance %.2e" % (t, key, got, want, rel, tols[t]))
    line = ("%s: worst relative error %.2e (step %d), eval %.2e (step %d); worst against the "
            "tolerance %.2f of it (step %d)" % (name, worst[0], worst[1], worst_eval[0],
                                                worst_eval[1], worst_ratio[0], worst_ratio[1]))
    if first_fail:
        raise CheckFailed("%s\n%s: first failure at %s" % (line, name, first_fail))
    return line


def same_weights(a, b):
    """The initializers of two .onnx files bit for bit (the onnx package), or else the files'
    bytes. Returns how it compared; raises CheckFailed naming what differs."""
    with open(a, "rb") as f:
        bytes_a = f.read()
    with open(b, "rb") as f:
        bytes_b = f.read()
    try:
        import onnx
    except ImportError:
        onnx = None
    if onnx is None:
        if bytes_a != bytes_b:
            at = next((i for i, (x, y) in enumerate(zip(bytes_a, bytes_b)) if x != y),
                      min(len(bytes_a), len(bytes_b)))
            raise CheckFailed("%s and %s differ from byte %d (sizes %d, %d)"
                              % (a, b, at, len(bytes_a), len(bytes_b)))
        return "the files byte for byte (no onnx package)"
    from onnx import numpy_helper

    def inits(data):
        model = onnx.load_model_from_string(data)
        return {t.name: (t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes())
                for t in model.graph.initializer}

    ia, ib = inits(bytes_a), inits(bytes_b)
    if set(ia) != set(ib):
        raise CheckFailed("the saved models' initializers differ in names: %s"
                          % sorted(set(ia) ^ set(ib))[:10])
    differ = [n for n in ia if ia[n] != ib[n]]
    if differ:
        raise CheckFailed("%d initializer(s) differ after the resume, first %s"
                          % (len(differ), differ[:5]))
    return "%d initializers bit for bit (the files %s byte for byte)" % (
        len(ia), "also equal" if bytes_a == bytes_b else "NOT equal")


# ---------------------------------------------------------------------------
# pipec.

def fresh(*paths):
    """Removes what an earlier run left at \p paths, so that only this run's files are read."""
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def pipec(exe, args, log):
    cmd = [exe] + args
    log.append(" ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise CheckFailed("exit %d: %s\n%s" % (proc.returncode, " ".join(cmd),
                                               (proc.stderr or proc.stdout).strip()[-2000:]))
    return proc.stdout


def run_args(ref, fixtures, plan, steps, metrics, extra):
    f = lambda name: os.path.join(fixtures, name)  # noqa: E731
    o = ref["optimizer"]
    return (["run", plan, "--data", f(ref["data"]["train"]["file"]),
             "--eval-data", f(ref["data"]["eval"]["file"]),
             "--eval-every", str(ref["eval_every"]), "--eval-steps", str(ref["eval_steps"]),
             "--steps", str(steps), "--optimizer", o["name"], "--lr", repr(o["lr"]),
             "--weight-decay", repr(o["weight_decay"]), "--seed", str(ref["seed"]),
             "--metrics", metrics, "--quiet"] + extra)


def compile_plan(exe, ref, fixtures, plan, layout, log):
    stages, dp, micro = layout
    args = ["compile", os.path.join(fixtures, "model.onnx"), "-o", plan, "--stages", str(stages),
            "--schedule", "1f1b", "--microbatches", str(micro), "--hardware", "cpu",
            "--precision", "fp32", "--optimizer", ref["optimizer"]["name"]]
    if dp > 1:
        args += ["--dp", str(dp)]
    pipec(exe, args, log)


def check_resume(exe, ref, fixtures, work, plan, full, log):
    """Step 4. Returns a summary line."""
    ck = os.path.join(work, "ck")
    first = os.path.join(work, "first.jsonl")
    resumed = os.path.join(work, "resumed.jsonl")
    weights = os.path.join(work, "resumed.onnx")
    fresh(ck, first, resumed, weights)
    pipec(exe, run_args(ref, fixtures, plan, RESUME_AT, first,
                        ["--checkpoint", ck, "--checkpoint-every", str(CHECKPOINT_EVERY)]), log)
    pipec(exe, run_args(ref, fixtures, plan, ref["steps"], resumed,
                        ["--checkpoint", ck, "--resume", "--save-weights", weights]), log)
    whole = read_metrics(full)
    for what, path, steps in (("the first %d steps" % RESUME_AT, first, range(1, RESUME_AT + 1)),
                              ("the resumed steps", resumed,
                               range(RESUME_AT + 1, ref["steps"] + 1))):
        got = read_metrics(path)
        if sorted(got) != list(steps):
            raise CheckFailed("%s: %s hold steps %s..%s, expected %d..%d"
                              % (what, path, min(got, default=None), max(got, default=None),
                                 steps[0], steps[-1]))
        for t in steps:
            if got[t] != whole[t]:
                raise CheckFailed("%s: step %d is %s, the uninterrupted run's %s"
                                  % (what, t, got[t], whole[t]))
    how = same_weights(os.path.join(work, "full.onnx"), weights)
    return ("resume at step %d: steps 1..%d and %d..%d equal the uninterrupted run's exactly; "
            "weights: %s" % (RESUME_AT, RESUME_AT, RESUME_AT + 1, ref["steps"], how))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipec", help="the pipec binary")
    ap.add_argument("--fixtures", default=FIXTURES, help="default %(default)s")
    ap.add_argument("--work", default=None, help="folder for plans, metrics and checkpoints "
                    "(default: a temporary one, removed)")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--spread-factor", type=float, default=4.0)
    ap.add_argument("--self-test", action="store_true", help="check the fixture alone, no pipec")
    args = ap.parse_args()
    if not args.self_test and not args.pipec:
        ap.error("--pipec is required (or --self-test)")
    ref_path = os.path.join(args.fixtures, "reference.json")
    if not os.path.isfile(ref_path):
        print("token_stream_check: no %s" % ref_path)
        return 1
    with open(ref_path) as f:
        ref = json.load(f)
    try:
        print(self_test(ref, args.fixtures))
    except CheckFailed as err:
        print("token_stream_check: FAIL: %s" % err)
        return 1
    if args.self_test:
        return 0

    work = args.work or tempfile.mkdtemp(prefix="pipec-token-stream-")
    os.makedirs(work, exist_ok=True)
    tols = tolerances(ref, args.rtol, args.spread_factor)
    print("tolerance: %.1e for steps 1..%d, %.1e by step %d"
          % (args.rtol, max([t for t in tols if tols[t] <= args.rtol] or [0]),
             tols[ref["steps"]], ref["steps"]))
    log, failed = [], 0
    full = os.path.join(work, "run.jsonl")
    plan1 = os.path.join(work, "p.plan")
    full_weights = os.path.join(work, "full.onnx")
    # (name, (stages, replicas, microbatches), plan, metrics, more run flags)
    cases = [
        ("2 stages, 1F1B, 4 microbatches", (2, 1, 4), plan1, full,
         ["--save-weights", full_weights]),
        ("2 stages x 2 replicas, 1F1B, 2 microbatches", (2, 2, 2),
         os.path.join(work, "p_dp2.plan"), os.path.join(work, "run_dp2.jsonl"), []),
    ]
    fresh(full_weights)
    for name, layout, plan, metrics, extra in cases:
        try:
            fresh(plan, metrics)
            compile_plan(args.pipec, ref, args.fixtures, plan, layout, log)
            pipec(args.pipec, run_args(ref, args.fixtures, plan, ref["steps"], metrics, extra),
                  log)
            print(compare(name, read_metrics(metrics), ref, tols))
        except (CheckFailed, subprocess.TimeoutExpired) as err:
            print("token_stream_check: FAIL: %s: %s" % (name, err))
            failed += 1
    try:
        if not os.path.isfile(full_weights):
            raise CheckFailed("no uninterrupted run to resume against")
        print(check_resume(args.pipec, ref, args.fixtures, work, plan1, full, log))
    except (CheckFailed, subprocess.TimeoutExpired) as err:
        print("token_stream_check: FAIL: resume: %s" % err)
        failed += 1
    if failed:
        print("token_stream_check: %d check(s) failed; commands:\n  %s" % (failed,
                                                                          "\n  ".join(log)))
    if not args.work and not failed:
        shutil.rmtree(work, ignore_errors=True)
    elif failed:
        print("token_stream_check: files kept in %s" % work)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
