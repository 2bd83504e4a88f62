#!/usr/bin/env python3
"""Sizes computed from the input's shape, as paddle2onnx writes them, against onnxruntime.

paddle2onnx exports a detector's FPN upsampling as a Resize whose `sizes` are computed at run
time from the input: Shape of the coarse map, Slice of its batch and channels, Shape of the fine
map, Slice of its height and width, Cast, Concat. The input's height and width are dynamic in the
file; the user binds them (`--input-shape x=1,3,64,64`), and then every such size is known at
compile time. This builds a small FPN of that form (onnx.helper, symbolic height and width) in
which the same shape arithmetic also feeds:
  - Resize `sizes` (nearest, as paddle2onnx's upsampling) and Resize `scales` (bilinear);
  - Reshape (a flatten to [N, C, H*W] from Mul of two sliced dims);
  - Expand and Tile (a per-channel bias broadcast to the map's shape, repeats from Div);
  - ConstantOfShape (a mask of the map's shape);
compiles it with `pipec compile --mode infer --input-shape x=...` for 1 and 2 stages, runs it,
and compares every output with onnxruntime's (relative 1e-5). Exit 0 on agreement, 1 on a
difference or a failed step, 77 when numpy, onnx or onnxruntime is missing.

  python3 tools/shape_arith_check.py --pipec build/bin/pipec
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

SHAPES = [(1, 3, 64, 64), (2, 3, 48, 80)]


def build_model():
    rng = np.random.default_rng(11)
    inits = []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def conv_weight(name, cout, cin):
        return const(name, (rng.standard_normal((cout, cin, 3, 3)) * 0.2).astype(np.float32))

    nodes = []

    def node(op, inputs, output, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], name=name, **attrs))
        return output

    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    c1 = node("Conv", ["x", conv_weight("w1", 8, 3)], "c1", "backbone/conv1", **conv)
    r1 = node("Relu", [c1], "r1", "backbone/relu1")
    c2 = node("Conv", [r1, conv_weight("w2", 8, 8)], "c2", "backbone/conv2", **conv)
    r2 = node("Relu", [c2], "r2", "backbone/relu2")
    # sizes = Concat(Shape(r2)[0:2], Cast(Shape(r1)[2:4])): the coarse map up to the fine one.
    s2 = node("Shape", [r2], "fpn/shape_coarse", "fpn/shape_coarse")
    s1 = node("Shape", [r1], "fpn/shape_fine", "fpn/shape_fine")
    nc = node("Slice", [s2, const("zero", np.array([0], np.int64)),
                        const("two", np.array([2], np.int64)),
                        const("axes0", np.array([0], np.int64))], "fpn/nc", "fpn/slice_nc")
    hw = node("Slice", [s1, "two", const("four", np.array([4], np.int64)), "axes0"], "fpn/hw",
              "fpn/slice_hw")
    hw32 = node("Cast", [hw], "fpn/hw32", "fpn/cast_hw", to=TensorProto.INT32)
    hw64 = node("Cast", [hw32], "fpn/hw64", "fpn/cast_back", to=TensorProto.INT64)
    sizes = node("Concat", [nc, hw64], "fpn/sizes", "fpn/concat_sizes", axis=0)
    up = node("Resize", [r2, "", "", sizes], "fpn/up", "fpn/resize_nearest", mode="nearest",
              coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    merged = node("Add", [up, r1], "fpn/merged", "fpn/add")
    # A second upsampling by scales computed from the shapes: Div(Cast(fine), Cast(coarse)).
    s_merged = node("Shape", [merged], "head/shape", "head/shape")
    fine = node("Cast", [node("Slice", [s_merged, "two", "four", "axes0"], "head/hw", "head/slice")],
                "head/hwf", "head/cast", to=TensorProto.FLOAT)
    scales = node("Concat", [const("ones2", np.array([1.0, 1.0], np.float32)),
                             node("Mul", [const("twos", np.array([2.0, 2.0], np.float32)),
                                          node("Div", [fine, fine], "head/one", "head/div")],
                                  "head/two", "head/mul")], "head/scales", "head/concat_scales",
                    axis=0)
    up2 = node("Resize", ["fpn/merged", "", scales], "head/up", "head/resize_linear",
               mode="linear", coordinate_transformation_mode="half_pixel")
    # Reshape to [N, C, H*W] from the shape's pieces.
    s_up = node("Shape", [up2], "head/shape_up", "head/shape_up")
    h = node("Slice", [s_up, "two", const("three", np.array([3], np.int64)), "axes0"], "head/h",
             "head/slice_h")
    w = node("Slice", [s_up, "three", "four", "axes0"], "head/w", "head/slice_w")
    flat_shape = node("Concat", [node("Slice", [s_up, "zero", "two", "axes0"], "head/nc",
                                      "head/slice_nc"),
                                 node("Mul", [h, w], "head/hw_prod", "head/mul_hw")],
                      "head/flat_shape", "head/concat_flat", axis=0)
    flat = node("Reshape", [up2, flat_shape], "head/flat", "head/reshape")
    # A per-channel bias expanded to the map's shape; Tile repeats from Div of the shapes.
    bias = const("bias", (rng.standard_normal((1, 8, 1, 1)) * 0.1).astype(np.float32))
    ones4 = const("ones4", np.array([1, 1], np.int64))
    expand_shape = node("Concat", [ones4, node("Slice", [s_up, "two", "four", "axes0"],
                                               "head/hw2", "head/slice_hw2")],
                        "head/expand_shape", "head/concat_expand", axis=0)
    expanded = node("Expand", [bias, expand_shape], "head/bias_map", "head/expand")
    s_r2 = node("Shape", [r2], "head/shape_coarse", "head/shape_coarse")
    repeats_hw = node("Div", [node("Slice", [s_up, "two", "four", "axes0"], "head/hw3",
                                   "head/slice_hw3"),
                              node("Slice", [s_r2, "two", "four", "axes0"], "head/hw_coarse",
                                   "head/slice_hw_coarse")], "head/repeats_hw", "head/div_hw")
    repeats = node("Concat", [ones4, repeats_hw], "head/repeats", "head/concat_repeats", axis=0)
    tiled = node("Tile", [r2, repeats], "head/tiled", "head/tile")
    mask = node("ConstantOfShape", [s_up], "head/mask", "head/mask",
                value=numpy_helper.from_array(np.array([0.5], np.float32)))
    y = node("Add", [node("Mul", [node("Add", [up2, expanded], "head/biased", "head/add_bias"),
                                  mask], "head/masked", "head/mul_mask"), tiled], "y", "head/out")
    nodes_out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, "h", "w"]),
                 helper.make_tensor_value_info(flat, TensorProto.FLOAT, ["n", 8, "hw"])]
    graph = helper.make_graph(
        nodes, "fpn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                       ["p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1",
                                        "p2o.DynamicDimension.2"])],
        nodes_out, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                              producer_name="paddle2onnx-pattern")
    onnx.checker.check_model(model)
    return model


def check(pipec, path, shape, stages, tmp):
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    want = O.onnxruntime_outputs(path, {"x": x})
    tag = "x%s-s%d" % ("x".join(map(str, shape)), stages)
    data = os.path.join(tmp, "data-" + tag)
    O.save_inputs(data, {"x": x})
    out = os.path.join(tmp, "out-" + tag)
    options = ["--stages", str(stages), "--microbatches", "1",
               "--input-shape", "x=" + ",".join(map(str, shape))]
    result = O.compile_and_run(pipec, path, options, data=data,
                               plan=os.path.join(tmp, tag + ".plan"), outputs=out, label=tag,
                               timeout=300)
    if not O.ran(result, tag):
        return False
    ok = True
    for name, ref in want.items():
        got = np.load(os.path.join(out, name.replace("/", "_") + ".npy"))
        err = float(np.max(np.abs(got - ref)) / max(1e-12, np.max(np.abs(ref)))) \
            if got.shape == ref.shape else float("inf")
        good = err <= 1e-5
        print("%s %s %s %s: max relative difference %.2e" %
              ("ok  " if good else "FAIL", tag, name, got.shape, err))
        ok &= good
    return ok


def main():
    pipec = O.pipec_from_command_line()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fpn.onnx")
        onnx.save(build_model(), path)
        for shape in SHAPES:
            for stages in (1, 2):
                failures += 0 if check(pipec, path, shape, stages, tmp) else 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
