#!/usr/bin/env python3
"""A plan that compiles, runs: every model of the repository's fixtures, compiled and run one step.

For every .onnx under tests/fixtures/ and models/bundled/, this compiles the model for 1 and 2 stages
(train mode where the model trains: it has a float scalar output that depends on its weights;
inference otherwise) and runs one step on synthetic data, or on the fixture's own batch where
one sits beside it (NAME.data/). A model is:

  ok        both stages counts compiled and ran
  refused   compile stopped with a one-line error (exit 1 or 2): the model is not for pipec
            yet, and compile said so (a model compile cannot train is tried for inference)
  late      compile wrote a plan, and run refused it: exactly what compile's checks are there
            to prevent
  crash     a signal, another exit code, or no answer within the timeout

The script exits 1 when any model is late or crashed, or when fewer than --floor models are ok.

  python3 tools/compile_run_sweep.py --pipec build/bin/pipec [--floor N] [--filter REGEX]
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TIMEOUT_S = 300


def fixture_models():
    found = []
    for base in ("tests/fixtures", "models/bundled"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for f in sorted(files):
                if f.endswith(".onnx"):
                    found.append(os.path.join(dirpath, f))
    return sorted(found)


def data_dir(model):
    """The fixture's own batch: NAME.data/ beside NAME.onnx (NAME_legacy.onnx shares NAME's)."""
    stem = model[:-len(".onnx")]
    for candidate in (stem + ".data", re.sub(r"_legacy$", "", stem) + ".data"):
        if os.path.isdir(candidate) and any(f.endswith(".npy") for f in os.listdir(candidate)):
            return candidate
    return None


def fixed_batch(model):
    """The batch an export fixes: its first input's first dimension, when static."""
    import onnx
    graph = onnx.load(model, load_external_data=False).graph
    inits = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name in inits:
            continue
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return dims[0].dim_value
        return None
    return None


def first_line(text):
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def call(args):
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, "no answer within %d s" % TIMEOUT_S
    return r.returncode, (r.stderr or "") + (r.stdout or "")


def sweep_one(pipec, model, work):
    data = data_dir(model)
    batch = fixed_batch(model)
    for stages in (1, 2):
        plan = os.path.join(work, "s%d.plan" % stages)
        compile_args = [pipec, "compile", model, "-o", plan, "--stages", str(stages),
                        "--microbatches", str(stages), "--hardware", "cpu", "--optimizer",
                        "sgd"]
        if batch:
            compile_args += ["--batch", str(batch * stages)]
        rc, out = call(compile_args)
        mode = "train"
        if rc == 1 and "the plan cannot train: " in out:
            # Nothing to train against (an inference export) or an op without a gradient:
            # compile said so; the same model for inference.
            mode = "infer"
            rc, out = call(compile_args + ["--mode", "infer"])
        if rc is None or rc < 0 or rc not in (0, 1, 2):
            return "crash", "compile: %s" % (out if rc is None else "exit %d" % rc)
        if rc != 0:
            return "refused", "compile --mode %s: %s" % (mode, first_line(out))
        run_args = [pipec, "run", plan, "--steps", "1", "--quiet", "--allow-nonfinite"]
        if mode == "train":
            run_args += ["--optimizer", "sgd", "--lr", "0.01"]
        if data:
            run_args += ["--data", data]
        rc, out = call(run_args)
        if rc is None or rc < 0 or rc not in (0, 1, 2):
            return "crash", "run: %s" % (out if rc is None else "exit %d" % rc)
        if rc != 0:
            return "late", "run %s %d stages: %s" % (mode, stages, first_line(out))
    return "ok", mode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipec", required=True)
    parser.add_argument("--floor", type=int, default=0)
    parser.add_argument("--filter", default="")
    args = parser.parse_args()
    models = [m for m in fixture_models() if re.search(args.filter, m)]
    counts = {"ok": 0, "refused": 0, "late": 0, "crash": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for i, model in enumerate(models):
            work = os.path.join(tmp, str(i))
            os.makedirs(work)
            status, detail = sweep_one(args.pipec, model, work)
            counts[status] += 1
            print("%-8s %s  %s" % (status, os.path.relpath(model, ROOT), detail), flush=True)
    print("sweep: %d ok, %d refused, %d late, %d crash of %d models" % (
        counts["ok"], counts["refused"], counts["late"], counts["crash"], len(models)))
    if counts["late"] or counts["crash"] or counts["ok"] < args.floor:
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(main())
