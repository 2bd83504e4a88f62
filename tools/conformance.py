#!/usr/bin/env python3
"""ONNX's own operator test cases through pipec's CLI, beside onnxruntime.

Every node test case of the installed `onnx` package
(onnx.backend.test.case.node.collect_testcases) runs through

    pipec compile MODEL --stages 1 --microbatches 1 --mode infer -o PLAN
    pipec run PLAN --data INPUTS --outputs OUT

and, on the same inputs, through onnxruntime (CPUExecutionProvider). Both are compared with
the outputs ONNX's case itself expects, at the case's tolerances (NaN equals NaN). Each case is:

  pass     every output matches
  wrong    an output is missing or differs (pipec said nothing was wrong)
  refused  compile stopped with a one-line error (exit 1 or 2): an op, type or form it lacks
  late     compile wrote a plan and run refused it: a check run makes that compile did not
  crash    a signal, another exit code, or no answer within the timeout

The summary prints per status, then per op. With --floor N the script exits 1 when fewer than N
cases pass, when any case crashes or is late, or when any case is wrong (more than
--allow-wrong).

Usage:
  conformance.py --pipec build/bin/pipec [--jobs 2] [--filter REGEX] [--json OUT.json]
                 [--markdown OUT.md] [--floor N] [--allow-wrong 0] [--keep DIR]
"""

import argparse
import collections
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore")

import onnx  # noqa: E402
import onnx.backend.test.case.node as node_cases  # noqa: E402
from onnx import numpy_helper  # noqa: E402

TIMEOUT_S = 60


def safe_file_name(name):
    """The file name pipec uses for a graph input or output."""
    return re.sub(r"[/:\\]", "_", name)


def op_types(model):
    """The ops of a case, as domain:op for non-default domains."""
    ops = []
    for n in model.graph.node:
        op = n.op_type if n.domain in ("", "ai.onnx") else "%s:%s" % (n.domain, n.op_type)
        if op not in ops:
            ops.append(op)
    return ops


def is_tensor(value):
    """A numeric or bool array: what pipec computes on (not strings, sequences, maps)."""
    return isinstance(value, np.ndarray) and value.dtype != object and value.dtype.kind != "U"


def compare(actual, expected, rtol, atol):
    """None when actual matches expected, else why not."""
    if actual is None:
        return "no output"
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return "a sequence against a tensor"
        if len(actual) != len(expected):
            return "sequence of %d, expected %d" % (len(actual), len(expected))
        for a, e in zip(actual, expected):
            why = compare(np.asarray(a), np.asarray(e), rtol, atol)
            if why:
                return why
        return None
    if expected.dtype == object or actual.dtype == object:
        return None if np.array_equal(actual, expected) else "values differ"
    if actual.shape != expected.shape:
        return "shape %s, expected %s" % (actual.shape, expected.shape)
    if actual.dtype != expected.dtype:
        return "type %s, expected %s" % (actual.dtype, expected.dtype)
    if expected.dtype.kind in "fc":
        ok = np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
        if not ok.all():
            bad = np.argwhere(~ok)[0]
            return "element %s: %r, expected %r" % (
                tuple(int(i) for i in bad), actual[tuple(bad)], expected[tuple(bad)])
        return None
    if not np.array_equal(actual, expected):
        return "values differ"
    return None


def run_onnxruntime(model_path, inputs, expected, rtol, atol):
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        feeds = {i.name: inputs[i.name] for i in session.get_inputs() if i.name in inputs}
        results = session.run(None, feeds)
    except Exception:  # onnxruntime refuses: it lacks the op, type or form
        return "refused"
    got = dict(zip(names, results))
    for name, want in expected.items():
        if compare(got.get(name), want, rtol, atol) is not None:
            return "wrong"
    return "pass"


def first_line(text):
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def run_pipec(pipec, case_dir, model_path, inputs, expected, rtol, atol):
    """(status, detail) of one case through the CLI."""
    data = os.path.join(case_dir, "data")
    out = os.path.join(case_dir, "out")
    plan = os.path.join(case_dir, "model.plan")
    os.makedirs(data, exist_ok=True)
    for name, value in inputs.items():
        np.save(os.path.join(data, safe_file_name(name) + ".npy"), value)
    steps = [
        [pipec, "compile", model_path, "-o", plan, "--stages", "1", "--microbatches", "1",
         "--mode", "infer"],
        [pipec, "run", plan, "--data", data, "--outputs", out, "--quiet", "--allow-nonfinite"],
    ]
    for args in steps:
        try:
            result = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "crash", "no answer within %d s: %s" % (TIMEOUT_S, args[1])
        if result.returncode < 0:
            return "crash", "%s: signal %s" % (args[1], signal.Signals(-result.returncode).name)
        if result.returncode in (1, 2):
            return ("refused" if args[1] == "compile" else "late"), first_line(result.stderr)
        if result.returncode != 0:
            return "crash", "%s: exit %d" % (args[1], result.returncode)
    for name, want in expected.items():
        path = os.path.join(out, safe_file_name(name) + ".npy")
        got = np.load(path, allow_pickle=False) if os.path.exists(path) else None
        # NumPy reads a bfloat16 .npy ('<V2', as ml_dtypes writes it) as raw 2-byte voids.
        if got is not None and got.dtype.kind == "V" and got.dtype.itemsize == 2 \
                and want.dtype.name == "bfloat16":
            got = got.view(want.dtype)
        why = compare(got, want, rtol, atol)
        if why is not None:
            return "wrong", "%s: %s" % (name, why)
    return "pass", ""


def run_case(case, pipec, root, keep):
    case_dir = os.path.join(root, case.name)
    os.makedirs(case_dir, exist_ok=True)
    model_path = os.path.join(case_dir, "model.onnx")
    onnx.save(case.model, model_path)
    inputs_list, outputs_list = case.data_sets[0]
    graph_inputs = [i.name for i in case.model.graph.input]
    graph_outputs = [o.name for o in case.model.graph.output]
    # Scalars arrive as numpy scalars; they are 0-d tensors.
    as_array = lambda v: np.asarray(v) if isinstance(v, np.generic) else v  # noqa: E731
    inputs = {n: as_array(v) for n, v in zip(graph_inputs, inputs_list)}
    expected = {n: as_array(v) for n, v in zip(graph_outputs, outputs_list)}
    rtol, atol = case.rtol, case.atol
    ort = run_onnxruntime(model_path, inputs, expected, rtol, atol)
    if not all(is_tensor(v) for v in list(inputs.values()) + list(expected.values())):
        status, detail = "refused", "strings, sequences and optionals are not tensors pipec runs"
    else:
        status, detail = run_pipec(pipec, case_dir, model_path, inputs, expected, rtol, atol)
    if not keep:
        shutil.rmtree(case_dir, ignore_errors=True)
    return {"case": case.name, "ops": op_types(case.model), "status": status, "detail": detail,
            "onnxruntime": ort}


def summarize(results):
    statuses = ["pass", "wrong", "refused", "late", "crash"]
    counts = collections.Counter(r["status"] for r in results)
    ort = collections.Counter(r["onnxruntime"] for r in results)
    by_op = collections.defaultdict(collections.Counter)
    for r in results:
        for op in r["ops"][:1]:
            by_op[op][r["status"]] += 1
    return statuses, counts, ort, by_op


def print_table(results, out):
    statuses, counts, ort, by_op = summarize(results)
    out.write("| | %s | total |\n|---|%s---|\n" % (" | ".join(statuses), "---|" * len(statuses)))
    out.write("| pipec | %s | %d |\n" % (" | ".join(str(counts[s]) for s in statuses), len(results)))
    out.write("| onnxruntime | %s | %d |\n\n" % (
        " | ".join(str(ort[s]) if s not in ("late", "crash") else "" for s in statuses), len(results)))
    out.write("| op | %s |\n|---|%s\n" % (" | ".join(statuses), "---|" * len(statuses)))
    for op in sorted(by_op):
        c = by_op[op]
        out.write("| %s | %s |\n" % (op, " | ".join(str(c[s]) if c[s] else "" for s in statuses)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipec", required=True)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--filter", default="")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--floor", type=int)
    parser.add_argument("--allow-wrong", type=int, default=0)
    parser.add_argument("--keep")
    args = parser.parse_args()

    cases = [c for c in node_cases.collect_testcases(None) if c.kind == "node"]
    if args.filter:
        cases = [c for c in cases if re.search(args.filter, c.name)]
    pipec = os.path.abspath(args.pipec)
    root = args.keep or tempfile.mkdtemp(prefix="pipec-conformance-")
    start = time.time()
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_case, c, pipec, root, bool(args.keep)) for c in cases]
        for f in concurrent.futures.as_completed(futures):
            results.append(f.result())
    results.sort(key=lambda r: r["case"])
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)

    print("onnx %s, %d node cases, %.0f s" % (onnx.__version__, len(results), time.time() - start))
    print_table(results, sys.stdout)
    for r in results:
        if r["status"] in ("wrong", "late", "crash"):
            print("%s %s: %s" % (r["status"].upper(), r["case"], r["detail"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"onnx": onnx.__version__, "results": results}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            print_table(results, f)

    counts = collections.Counter(r["status"] for r in results)
    failed = []
    if counts["crash"]:
        failed.append("%d crashed" % counts["crash"])
    if counts["late"]:
        failed.append("%d compiled and then refused to run" % counts["late"])
    if counts["wrong"] > args.allow_wrong:
        failed.append("%d wrong" % counts["wrong"])
    if args.floor is not None and counts["pass"] < args.floor:
        failed.append("%d passed, the floor is %d" % (counts["pass"], args.floor))
    if failed:
        print("conformance: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
