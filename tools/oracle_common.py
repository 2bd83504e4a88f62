"""What the checks of pipec against onnxruntime share (tools/control_flow_check.py,
gqa_check.py, shape_arith_check.py): their command line, onnxruntime's outputs, and a model
compiled and run through pipec's CLI.

Importing it exits 77, ctest's skip code, when numpy, onnx or onnxruntime is missing, so a
check imports it before them.
"""
import argparse
import os
import subprocess
import sys

try:
    import numpy as np
    import onnx  # noqa: F401 -- only checked here; the checks import it themselves
    import onnxruntime as ort
except ImportError as e:
    print("skipped: %s" % e)
    sys.exit(77)


def pipec_from_command_line():
    """The pipec binary named by --pipec PATH, the one option of every check."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipec", required=True)
    return parser.parse_args().pipec


def onnxruntime_outputs(path, feeds):
    """{output name: value} of the model at path on feeds, from onnxruntime's CPU kernels."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def save_inputs(folder, arrays):
    """Makes folder, a `pipec run --data` folder: NAME.npy per array of {NAME: array}."""
    os.makedirs(folder)
    for name, array in arrays.items():
        np.save(os.path.join(folder, name + ".npy"), array)


def compile_and_run(pipec, model, options, data, plan, outputs, label, timeout):
    """`pipec compile MODEL -o PLAN --mode infer OPTIONS`, then `pipec run PLAN --data DATA
    --outputs OUTPUTS --quiet`, each given timeout seconds. Returns the run's completed process
    whatever its exit code (a check may expect a refusal; ran() tells the others), or None
    when compile fails, printed as "FAIL LABEL: compile: its errors"."""
    built = subprocess.run([pipec, "compile", model, "-o", plan, "--mode", "infer", *options],
                           capture_output=True, text=True, timeout=timeout)
    if built.returncode != 0:
        print("FAIL %s: compile: %s" % (label, built.stderr.strip()))
        return None
    return subprocess.run([pipec, "run", plan, "--data", data, "--outputs", outputs, "--quiet"],
                          capture_output=True, text=True, timeout=timeout)


def ran(result, label):
    """Whether compile_and_run's result is a run that exited 0. A run that failed is printed as
    "FAIL LABEL: run: its errors" (a failed compile was printed already)."""
    if result is not None and result.returncode != 0:
        print("FAIL %s: run: %s" % (label, result.stderr.strip()))
    return result is not None and result.returncode == 0
