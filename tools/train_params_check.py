#!/usr/bin/env python3
"""pipec trains the user's parameters, against torch (CI: no torch needed).

For each fixture of tools/fixtures/torch_param_fixtures.py (tests/fixtures/torch/params/NAME/):
models whose exporter folds parameters (a layer group shared by every layer, a class token
broadcast over the batch, a position table read at an offset, a (1 + w) norm, interleaved rotary
slices, a relative position bias read by every block, an embedding with padding_idx), compiles
model.onnx with --params model.safetensors on each of --stages (default 1, 2, 4) and --schedules
(default 1f1b, zbv, dualpipev), then runs from other.safetensors and saves safetensors:
  - one SGD step (lr 0.1): every parameter equals torch's (sgd.safetensors) within 1e-4 of the
    norm of torch's update over all parameters, or the fixture's float32 spread where larger;
  - 3 AdamW steps (lr 1e-2, weight decay 0.1): within 1e-3 of torch's change (adamw.safetensors);
and each saved file holds every name torch's state_dict has, none missing, each changed where
torch's changed. A layout that does not fit the model (more chunks than layers) is skipped and
counted; every fixture must run on one stage and on two.

Then the same without --params (but NOT_BY_STRUCTURE's), as a user who has only the ONNX file:
pipec writes torch's starting weights into the model (a --params run of no step), compiles that
without --params, and the model it saves after the steps equals what the --params run saves,
initializer by initializer, within the same tolerances (check_structure).

Usage: train_params_check.py --pipec build/bin/pipec [--fixtures DIR] [--work DIR]
                             [--only REGEX] [--stages 1,2,4] [--schedules 1f1b,zbv,dualpipev]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SGD_TOL = 1e-4
ADAMW_TOL = 1e-3
# Fixtures whose training needs the checkpoint: what the graph holds cannot show the parameter.
NOT_BY_STRUCTURE = {
    "gemma_norm": "the graph holds 1 + w, and only the checkpoint says w is the parameter "
                  "(AdamW's decay of 1 + w is not w's)",
}


def run(pipec, args):
    proc = subprocess.run([pipec] + args, capture_output=True, text=True)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def compiled(pipec, args, stages, sched, skipped, failures):
    """Runs `pipec compile`; a layout that does not fit the model (more than two stages) is
    skipped, any other refusal a failure."""
    rc, out = run(pipec, args)
    if rc == 0:
        return True
    last = out.splitlines()[-1] if out else str(rc)
    if re.search(r"fewer layers|more chunks|cannot split|layers into", out) and stages > 2:
        skipped.append("%d stages %s: %s" % (stages, sched, last))
    else:
        failures.append("%d stages %s: compile: %s" % (stages, sched, last))
    return False


def buffers_of(folder):
    """The checkpoint's tensors torch does not train (buffers save_pretrained keeps, as BART's
    final_logits_bias): unchanged by torch's AdamW steps, whose weight decay moves every
    parameter. The graph cannot tell them from weights; the user freezes them."""
    start, after = load_file(os.path.join(folder, "other.safetensors")), \
        load_file(os.path.join(folder, "adamw.safetensors"))
    return sorted(k for k in start if k in after and np.array_equal(start[k], after[k]))


def compare(saved_path, ref_path, start_path, tol, spread, tied):
    """Problems with the saved file against torch's: missing or extra names, shapes, values.
    A tied name (state_dict's second name of one tensor) may be left out where the checkpoint
    leaves it out; a name torch's file lacks may be written only as a copy of one it has (the
    state_dict's name of a tensor the checkpoint holds under an older one)."""
    saved, ref, start = load_file(saved_path), load_file(ref_path), load_file(start_path)
    problems = []
    missing = sorted(k for k in set(ref) - set(saved) if k not in tied or tied[k] not in saved)
    extra = sorted(k for k in set(saved) - set(ref)
                   if not any(np.array_equal(saved[k], saved[j]) for j in ref if j in saved))
    if missing:
        problems.append("missing %s" % missing[:5])
    if extra:
        problems.append("extra %s" % extra[:5])
    err2 = upd2 = 0.0
    worst = (0.0, "")
    for k in sorted(set(ref) & set(saved)):
        r, s = ref[k].astype(np.float64), saved[k].astype(np.float64)
        if r.shape != s.shape:
            problems.append("%s: shape %s, torch %s" % (k, s.shape, r.shape))
            continue
        u = r - start[k].astype(np.float64) if k in start else np.zeros_like(r)
        e = float(((s - r) ** 2).sum())
        err2 += e
        upd2 += float((u ** 2).sum())
        un = float(np.sqrt((u ** 2).sum()))
        if un > 0 and (e ** 0.5) / un > worst[0]:
            worst = ((e ** 0.5) / un, k)
        if un > 1e-6 and k in start and np.array_equal(s, start[k].astype(np.float64)):
            problems.append("%s: unchanged, torch changed it by %.3g" % (k, un))
    rel = (err2 ** 0.5) / (upd2 ** 0.5) if upd2 > 0 else 0.0
    if rel > max(tol, spread):
        problems.append("off torch's update by %.3g of its norm (limit %.3g); worst '%s' at %.3g"
                        % (rel, max(tol, spread), worst[1], worst[0]))
    return rel, problems


def check(pipec, folder, work, stages, schedules):
    ref = json.load(open(os.path.join(folder, "reference.json")))
    name = os.path.basename(folder)
    f = lambda n: os.path.join(folder, n)  # noqa: E731
    failures, skipped, ran = [], [], 0
    tied = ref.get("tied_aliases") or {}
    frozen = buffers_of(folder)
    for p in stages:
        for sched in schedules:
            plan = os.path.join(work, "%s_%d_%s.plan" % (name, p, sched))
            args = ["compile", f("model.onnx"), "--params", f("model.safetensors"), "--stages",
                    str(p), "--schedule", sched, "-o", plan]
            if frozen:
                args += ["--freeze", "(^|[.])(%s)$" % "|".join(re.escape(b) for b in frozen)]
            if not compiled(pipec, args, p, sched, skipped, failures):
                continue
            for opt, steps, lr, decay, refname, tol in (
                    ("sgd", 1, 0.1, 0.0, "sgd.safetensors", SGD_TOL),
                    ("adamw", 3, 1e-2, 0.1, "adamw.safetensors", ADAMW_TOL)):
                saved = os.path.join(work, "%s_%d_%s_%s.safetensors" % (name, p, sched, opt))
                rc, out = run(pipec, ["run", plan, "--data", f("data"), "--init",
                                      f("other.safetensors"), "--steps", str(steps),
                                      "--optimizer", opt, "--lr", str(lr), "--weight-decay",
                                      str(decay), "--save-weights", saved, "--quiet"])
                where = "%d stages %s %s" % (p, sched, opt)
                if rc != 0:
                    failures.append("%s: run: %s" % (where, out.splitlines()[-1] if out else rc))
                    continue
                spread = ref.get("float32_spread", {}).get(opt, 0.0)
                rel, problems = compare(saved, f(refname), f("other.safetensors"), tol, spread,
                                        tied)
                ran += 1
                print("  %s %-28s %.2e of torch's update" % (name, where, rel))
                failures += ["%s: %s" % (where, x) for x in problems]
    return ran, skipped, failures


def initializers(path):
    import onnx
    from onnx import numpy_helper
    return {t.name: numpy_helper.to_array(t).astype(np.float64)
            for t in onnx.load(path).graph.initializer
            if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)}


def check_structure(pipec, folder, work, stages, schedules):
    """Without --params: the model as the user has it (torch's weights of other.safetensors
    written into model.onnx by pipec) trains as the checkpoint's map trains it, which check()
    holds to torch: after one SGD step and after 3 AdamW steps every initializer of the saved
    model equals the --params run's within the same tolerances of the update's norm."""
    name = os.path.basename(folder)
    f = lambda n: os.path.join(folder, n)  # noqa: E731
    w = lambda n: os.path.join(work, "%s_structure_%s" % (name, n))  # noqa: E731
    ref = json.load(open(f("reference.json")))
    frozen = buffers_of(folder)
    freeze = ["--freeze", "(^|[.])(%s)$" % "|".join(re.escape(b) for b in frozen)] \
        if frozen else []
    # torch's padding_idx, which the graph cannot carry: the user names the table's row.
    pad_rows = []
    for p, rows in (ref.get("padding_rows") or {}).items():
        pad_rows += ["--pad-row", "%s=%d" % (ref["folded"][p]["initializer"], rows[0])]
    failures, skipped, ran = [], [], 0
    rc, out = run(pipec, ["compile", f("model.onnx"), "--params", f("model.safetensors"),
                          "-o", w("params.plan")] + freeze)
    if rc != 0:
        return 0, [], ["compile --params: %s" % out.splitlines()[-1]]
    runs = {"start": ("sgd", 1, 0.0, 0.0, None), "sgd": ("sgd", 1, 0.1, 0.0, SGD_TOL),
            "adamw": ("adamw", 3, 1e-2, 0.1, ADAMW_TOL)}
    for key, (opt, steps, lr, decay, _) in runs.items():
        rc, out = run(pipec, ["run", w("params.plan"), "--data", f("data"), "--init",
                              f("other.safetensors"), "--steps", str(steps), "--optimizer", opt,
                              "--lr", str(lr), "--weight-decay", str(decay), "--save-weights",
                              w(key + ".onnx"), "--quiet"])
        if rc != 0:
            return 0, [], ["run --params %s: %s" % (key, out.splitlines()[-1] if out else rc)]
    start = initializers(w("start.onnx"))
    for p in stages:
        for sched in schedules:
            plan = w("%d_%s.plan" % (p, sched))
            if not compiled(pipec, ["compile", w("start.onnx"), "--stages", str(p),
                                    "--schedule", sched, "-o", plan] + freeze + pad_rows,
                            p, sched, skipped, failures):
                continue
            for key in ("sgd", "adamw"):
                opt, steps, lr, decay, tol = runs[key]
                saved = w("%d_%s_%s.onnx" % (p, sched, key))
                where = "%d stages %s %s, no --params" % (p, sched, opt)
                rc, out = run(pipec, ["run", plan, "--data", f("data"), "--steps", str(steps),
                                      "--optimizer", opt, "--lr", str(lr), "--weight-decay",
                                      str(decay), "--save-weights", saved, "--quiet"])
                if rc != 0:
                    failures.append("%s: run: %s" % (where, out.splitlines()[-1] if out else rc))
                    continue
                ref, got = initializers(w(key + ".onnx")), initializers(saved)
                err2 = upd2 = 0.0
                for k, r in ref.items():
                    if k not in got or got[k].shape != r.shape:
                        failures.append("%s: initializer %s missing or reshaped" % (where, k))
                        continue
                    err2 += float(((got[k] - r) ** 2).sum())
                    upd2 += float(((r - start[k]) ** 2).sum())
                rel = (err2 ** 0.5) / (upd2 ** 0.5) if upd2 > 0 else 0.0
                ran += 1
                print("  %s %-40s %.2e of the --params run's update" % (name, where, rel))
                if rel > tol:
                    failures.append("%s: off the --params run's update by %.3g of its norm "
                                    "(limit %.3g)" % (where, rel, tol))
    return ran, skipped, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--fixtures", default=os.path.join(ROOT, "tests", "fixtures", "torch",
                                                       "params"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--schedules", default="1f1b,zbv,dualpipev")
    args = ap.parse_args()
    stages = [int(x) for x in args.stages.split(",")]
    schedules = args.schedules.split(",")
    names = sorted(n for n in os.listdir(args.fixtures)
                   if os.path.isfile(os.path.join(args.fixtures, n, "reference.json")))
    if args.only:
        names = [n for n in names if re.search(args.only, n)]
    if not names:
        sys.exit("train_params_check: no fixtures in %s" % args.fixtures)
    work = args.work or tempfile.mkdtemp(prefix="train-params-")
    os.makedirs(work, exist_ok=True)
    passed = failed = 0
    for n in names:
        ran, skipped, failures = check(args.pipec, os.path.join(args.fixtures, n), work, stages,
                                       schedules)
        if n in NOT_BY_STRUCTURE:
            print("  %s without --params: not checked, %s" % (n, NOT_BY_STRUCTURE[n]))
        else:
            more = check_structure(args.pipec, os.path.join(args.fixtures, n), work, stages,
                                   schedules)
            ran, skipped, failures = ran + more[0], skipped + more[1], failures + more[2]
        for s in skipped:
            print("  %s skipped %s" % (n, s))
        if failures or ran == 0:
            failed += 1
            print("FAIL %s" % n)
            for x in failures or ["nothing ran"]:
                print("    " + x)
        else:
            passed += 1
            print("ok   %s: %d runs" % (n, ran))
    print("%d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
