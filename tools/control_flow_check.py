#!/usr/bin/env python3
"""If, Loop and Scan in a pipeline, against onnxruntime.

Builds a small MLP of six blocks (width 16) in which later blocks hold
control flow whose subgraphs read values computed blocks earlier (ONNX's
outer-scope rule):
  - a Loop of three iterations whose body reads the weight W4 and the
    activation h1 of block 1;
  - two Ifs on conditions computed from a weight, whose branches read h2
    and h4;
  - a Scan along each sample's features whose body reads the weight W5s.
compiles it with `pipec compile --mode infer` for 1, 2 and 3 stages and 2
microbatches, runs it, and compares each output with onnxruntime's on the
same model and data (relative 1e-5). Exit 0 on agreement, 1 on a
difference or a failed step, 77 when numpy, onnx or onnxruntime is missing.

  python3 tools/control_flow_check.py --pipec build/bin/pipec
"""
import os
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the repo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle_common as O  # noqa: E402 -- first: exits 77 without numpy, onnx or onnxruntime
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

WIDTH = 16
BATCH = 4


def weight(name, rng, shape=(WIDTH, WIDTH)):
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def build_model():
    rng = np.random.default_rng(7)
    inits = [weight("W%d" % i, rng) for i in (0, 1, 2, 3, 4, 6)]
    inits.append(numpy_helper.from_array(np.array(3, dtype=np.int64), "trips"))
    inits.append(numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"))
    nodes = []

    def block(i, src, dst):
        nodes.append(helper.make_node("MatMul", [src, "W%d" % i], ["m%d" % i], name="/b%d/mm" % i))
        nodes.append(helper.make_node("Tanh", ["m%d" % i], [dst], name="/b%d/act" % i))

    block(0, "x", "h0")
    block(1, "h0", "h1")
    block(2, "h1", "h2")
    block(3, "h2", "h3")
    # Block 4: a Loop whose body reads W4 and h1 from outside:
    # v <- tanh(v W4 + h1), three times; the scan output stacks each v's row sums.
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["v_in", "W4"], ["vw"]),
            helper.make_node("Add", ["vw", "h1"], ["vh"]),
            helper.make_node("Tanh", ["vh"], ["v_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("ReduceSum", ["v_out", "axis1"], ["v_sum"], keepdims=0),
        ],
        "loop_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("v_sum", TensorProto.FLOAT, None),
        ],
    )
    nodes.append(helper.make_node("Loop", ["trips", "", "h3"], ["h4", "sums"], body=body,
                                  name="/b4/loop"))
    # Block 5: two Ifs on conditions computed from the weight W6 (so every
    # microbatch takes the branch the whole batch takes), whose branches
    # read h2 and h4 from outside: h5 = (max W6 > 0 ? h4 + h2 : h4 - h2), then
    # h5b = (min W6 > 0 ? h5 * h2 : h5 - h4).
    nodes.append(helper.make_node("ReduceMax", ["W6"], ["w_max"], keepdims=0, name="/b5/max"))
    nodes.append(helper.make_node("Greater", ["w_max", "zero"], ["positive"], name="/b5/gt"))
    nodes.append(helper.make_node("ReduceMin", ["W6"], ["w_min"], keepdims=0, name="/b5/min"))
    nodes.append(helper.make_node("Greater", ["w_min", "zero"], ["all_positive"],
                                  name="/b5/gt2"))

    def branch(name, op, a, b, out):
        return helper.make_graph([helper.make_node(op, [a, b], [out])], name, [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])

    nodes.append(helper.make_node("If", ["positive"], ["h5a"],
                                  then_branch=branch("then1", "Add", "h4", "h2", "t1"),
                                  else_branch=branch("else1", "Sub", "h4", "h2", "e1"),
                                  name="/b5/if1"))
    nodes.append(helper.make_node("If", ["all_positive"], ["h5"],
                                  then_branch=branch("then2", "Mul", "h5a", "h2", "t2"),
                                  else_branch=branch("else2", "Sub", "h5a", "h4", "e2"),
                                  name="/b5/if2"))
    # Block 6: a Scan along the features of each sample, as 4 rows of 4:
    # state s <- s + row W5[:4, :4], each step's s stacked back along axis 1.
    scan_body = helper.make_graph(
        [
            helper.make_node("MatMul", ["row", "W5s"], ["rw"]),
            helper.make_node("Add", ["s_in", "rw"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["s_step"]),
        ],
        "scan_body",
        [
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("s_step", TensorProto.FLOAT, None),
        ],
    )
    inits.append(weight("W5s", rng, (4, 4)))
    inits.append(numpy_helper.from_array(np.array([0, 4, 4], dtype=np.int64), "rows_shape"))
    inits.append(numpy_helper.from_array(np.array([0, WIDTH], dtype=np.int64), "flat_shape"))
    inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"))
    nodes.append(helper.make_node("Reshape", ["h5", "rows_shape"], ["h5r"], name="/b6/rows"))
    nodes.append(helper.make_node("ReduceSum", ["h5r", "axis1"], ["s0"], keepdims=0,
                                  name="/b6/init"))
    nodes.append(helper.make_node("Scan", ["s0", "h5r"], ["s_final", "steps_r"], body=scan_body,
                                  num_scan_inputs=1, scan_input_axes=[1], scan_output_axes=[1],
                                  name="/b6/scan"))
    nodes.append(helper.make_node("Reshape", ["steps_r", "flat_shape"], ["steps"],
                                  name="/b6/flat"))
    block(6, "steps", "y")
    graph = helper.make_graph(
        nodes, "control_flow_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])],
        inits)
    # Declared shapes for what ONNX cannot infer through the subgraphs, in
    # the batch dimension N that pipec binds per microbatch.
    for name, dims in (("h4", ["N", WIDTH]), ("sums", [3, "N"]), ("h5a", ["N", WIDTH]),
                       ("h5", ["N", WIDTH]), ("s_final", ["N", 4]), ("steps_r", ["N", 4, 4])):
        graph.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main():
    pipec = O.pipec_from_command_line()
    model = build_model()
    x = np.random.default_rng(3).standard_normal((BATCH, WIDTH)).astype(np.float32)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save(model, path)
        want = O.onnxruntime_outputs(path, {"x": x})["y"]
        data = os.path.join(tmp, "data")
        O.save_inputs(data, {"x": x})
        for stages in (1, 2, 3):
            label = "stages=%d" % stages
            out = os.path.join(tmp, "out%d" % stages)
            result = O.compile_and_run(pipec, path, ["--stages", str(stages), "--microbatches",
                                                     "2", "--batch", str(BATCH)],
                                       data=data, plan=os.path.join(tmp, "s%d.plan" % stages),
                                       outputs=out, label=label, timeout=300)
            if not O.ran(result, label):
                failures += 1
                continue
            got = np.load(os.path.join(out, "y.npy"))
            err = float(np.max(np.abs(got - want)) / max(1e-12, np.max(np.abs(want))))
            ok = got.shape == want.shape and err <= 1e-5
            print("%s stages=%d: max relative difference %.2e" %
                  ("ok  " if ok else "FAIL", stages, err))
            failures += 0 if ok else 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
