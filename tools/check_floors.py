#!/usr/bin/env python3
"""Checks that the floors point one way: a library cannot include a floor above it.

Each library compiles with an include path that links only the source folders it may use
(pipec_floor in the top CMakeLists.txt). For each case below this script takes the exact
compile command of one of the library's own sources from compile_commands.json, compiles a
one-line file with it (-fsyntax-only), and expects:

  - an allowed header to compile, so that the check is not passing for another reason;
  - a forbidden header to fail with "No such file or directory" for that header.

Usage: check_floors.py BUILD_DIR
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile

# (library, a source of it, an allowed header, a forbidden header, why it is forbidden)
CASES = [
    ("pipec_ir", "compiler/ir/Graph.cpp", "support/DType.h", "passes/Differentiate.h",
     "the compiler libraries never include passes/"),
    ("pipec_cost", "compiler/cost/CostModel.cpp", "compiler/ir/LayerGraph.h", "driver/Compile.h",
     "the compiler libraries never include driver/"),
    ("pipec_cost", "compiler/cost/CpuCalibration.cpp", "runtime/core/Tensor.h",
     "runtime/cpu/Kernels.h", "the cost model times the CPU kernels through the driver's wiring"),
    ("pipec_passes", "passes/Differentiate.cpp", "compiler/cost/CostModel.h",
     "driver/PassPipeline.h", "passes never include driver/"),
    ("pipec_passes", "passes/fold/MathFolds.cpp", "math/ElementMath.h", "runtime/core/Tensor.h",
     "the compiler half never includes the runtime"),
    ("pipec_plan", "plan/PlanFile.cpp", "support/DType.h", "runtime/core/Tensor.h",
     "the plan format is below both halves"),
    ("pipec_cpu", "runtime/cpu/Kernels.cpp", "math/ElementMath.h",
     "runtime/cuda/CudaOps.h", "the CPU kernels never include the CUDA backend"),
    ("pipec_cuda", "runtime/cuda/CudaBackend.cpp", "runtime/core/OpContext.h",
     "runtime/cpu/Kernels.h", "the CUDA backend never includes the CPU kernels"),
    ("pipec_core", "runtime/core/Tensor.cpp", "ops/OpRegistry.h", "runtime/exec/Executor.h",
     "runtime/core is below the executor"),
    ("pipec_runtime", "runtime/exec/Executor.cpp", "runtime/cpu/Kernels.h",
     "compiler/ir/Graph.h", "the runtime never includes the compiler"),
    ("pipec_ops", "ops/OpRegistry.cpp", "support/DType.h", "runtime/core/Tensor.h",
     "the registry is below the runtime"),
]


def command_for(entries, source):
    for entry in entries:
        if entry["file"].endswith("/" + source):
            args = entry.get("arguments") or shlex.split(entry["command"])
            return args, entry["directory"]
    return None, None


def compile_with(args, directory, header):
    """Compiles a file holding `#include "header"` with the library's flags."""
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write('#include "%s"\n' % header)
        path = f.name
    try:
        out = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a in ("-o", "-MF", "-MT", "-MQ"):
                skip = True
                continue
            if a in ("-c", "-MD", "-MMD") or a.endswith((".cpp", ".cu", ".cc")):
                continue
            out.append(a)
        # ccache as the launcher is not needed for a syntax check.
        if os.path.basename(out[0]) == "ccache":
            out = out[1:]
        out += ["-fsyntax-only", path]
        result = subprocess.run(out, cwd=directory, capture_output=True, text=True)
        return result.returncode, result.stderr
    finally:
        os.unlink(path)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    with open(os.path.join(sys.argv[1], "compile_commands.json")) as f:
        entries = json.load(f)
    failures = 0
    # A build configured without CUDA (-DPIPEC_CUDA=OFF, or no toolkit) has
    # no commands for the CUDA backend's sources: nothing there to check.
    cuda_built = any(e["file"].endswith(".cu") for e in entries)
    for library, source, allowed, forbidden, why in CASES:
        args, directory = command_for(entries, source)
        if args is None and source.startswith("runtime/cuda/") and not cuda_built:
            print("%s: not built here (no CUDA), not checked" % library)
            continue
        if args is None:
            print("%s: no compile command for %s" % (library, source))
            failures += 1
            continue
        rc, err = compile_with(args, directory, allowed)
        if rc != 0:
            print("%s: the allowed %s does not compile:\n%s" % (library, allowed, err[:2000]))
            failures += 1
            continue
        rc, err = compile_with(args, directory, forbidden)
        if rc == 0 or "No such file or directory" not in err or forbidden not in err:
            print("%s: %s is not refused (%s)" % (library, forbidden, why))
            failures += 1
            continue
        print("%s: %s refused, %s allowed" % (library, forbidden, allowed))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
