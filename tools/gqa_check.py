#!/usr/bin/env python3
"""com.microsoft GroupQueryAttention through pipec's CLI, against onnxruntime's CPU kernel.

onnxruntime-genai's model builder writes its decoders' attention as one GroupQueryAttention
node: N query heads over Nkv key and value heads, the KV cache a buffer each row fills from
position 0 (seqlens_k[b] is row b's length less one), rotary embeddings inside (do_rotary).
This builds one-node models (onnx.helper) for the forms a decoder meets:
  - a decode step: 3 rows at different lengths in one past buffer;
  - a first prompt with a right-padded row, without a past;
  - a prompt continued after a past (one row, as onnxruntime allows);
  - packed QKV, rotary halves and interleaved pairs, a partial rotary dimension;
  - local_window_size, softcap and smooth_softmax; 8 query heads over 2 and over 1;
compiles each with `pipec compile --mode infer --stages 1`, runs it, and compares the output
and both presents with onnxruntime's (absolute 2e-5 on values of order 1); a seqlens_k past the
buffer must be refused in one line naming the node and the row. Exit 0 on
agreement, 1 on a difference or a failed step, 77 when numpy, onnx or onnxruntime is missing.

  python3 tools/gqa_check.py --pipec build/bin/pipec
"""
import os
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the repo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle_common as O  # noqa: E402 -- first: exits 77 without numpy, onnx or onnxruntime
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

# name: (batch, queries, past buffer, heads, kv heads, head size, seqlens_k, attributes,
#        packed, rotary dim or 0)
CASES = {
    "decode": (3, 1, 7, 4, 2, 16, [7, 3, 0], {}, False, 0),
    "first-prompt-padded": (2, 6, 0, 4, 2, 16, [5, 3], {}, False, 0),
    "continued-prompt": (1, 3, 5, 4, 2, 16, [7], {}, False, 0),
    "decode-rotary": (3, 1, 9, 4, 2, 32, [9, 4, 0], {"do_rotary": 1}, False, 32),
    "prompt-rotary-interleaved": (2, 5, 0, 8, 2, 32, [4, 2],
                                  {"do_rotary": 1, "rotary_interleaved": 1}, False, 32),
    "decode-packed-partial-rotary": (2, 1, 6, 4, 1, 32, [6, 2], {"do_rotary": 1}, True, 16),
    "decode-window-softcap": (2, 1, 9, 4, 2, 16, [9, 5],
                              {"local_window_size": 3, "softcap": 2.0, "scale": 0.5}, False, 0),
    "decode-smooth-softmax": (2, 1, 5, 8, 1, 16, [5, 1], {"smooth_softmax": 1}, False, 0),
}


def build(case):
    b, s, past, n, nkv, h, _, attrs, packed, rotary = case
    total = past + s
    f = TensorProto.FLOAT
    inputs, names = [], []
    if packed:
        inputs.append(helper.make_tensor_value_info("qkv", f, [b, s, (n + 2 * nkv) * h]))
        names += ["qkv", "", ""]
    else:
        inputs += [helper.make_tensor_value_info("query", f, [b, s, n * h]),
                   helper.make_tensor_value_info("key", f, [b, s, nkv * h]),
                   helper.make_tensor_value_info("value", f, [b, s, nkv * h])]
        names += ["query", "key", "value"]
    if past:
        inputs += [helper.make_tensor_value_info("past_key", f, [b, nkv, past, h]),
                   helper.make_tensor_value_info("past_value", f, [b, nkv, past, h])]
        names += ["past_key", "past_value"]
    else:
        names += ["", ""]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
               helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    names += ["seqlens_k", "total_sequence_length"]
    inits = []
    if rotary:
        positions = np.arange(64, dtype=np.float64)[:, None]
        freq = 1.0 / (10000 ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary))
        inits += [helper.make_tensor("cos_cache", f, [64, rotary // 2],
                                     np.cos(positions * freq).astype(np.float32).ravel()),
                  helper.make_tensor("sin_cache", f, [64, rotary // 2],
                                     np.sin(positions * freq).astype(np.float32).ravel())]
        names += ["cos_cache", "sin_cache"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", name="gqa", num_heads=n, kv_num_heads=nkv,
                            **attrs)
    outputs = [helper.make_tensor_value_info("output", f, [b, s, n * h]),
               helper.make_tensor_value_info("present_key", f, [b, nkv, total, h]),
               helper.make_tensor_value_info("present_value", f, [b, nkv, total, h])]
    graph = helper.make_graph([node], "gqa", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def feeds(case, seed):
    b, s, past, n, nkv, h, seqlens, _, packed, _ = case
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    data = {}
    if packed:
        data["qkv"] = rand(b, s, (n + 2 * nkv) * h)
    else:
        data.update(query=rand(b, s, n * h), key=rand(b, s, nkv * h), value=rand(b, s, nkv * h))
    if past:
        data.update(past_key=rand(b, nkv, past, h), past_value=rand(b, nkv, past, h))
    data["seqlens_k"] = np.array(seqlens, dtype=np.int32)
    data["total_sequence_length"] = np.array(past + s, dtype=np.int32)
    return data


def compile_and_run(pipec, path, data, tmp, tag):
    """Saves data as the run's inputs, compiles path (1 stage, inference) and runs it; the
    completed run (its exit code and stderr), or None with the failed compile printed."""
    folder = os.path.join(tmp, "data-" + tag)
    O.save_inputs(folder, data)
    return O.compile_and_run(pipec, path, ["--stages", "1", "--microbatches", "1"], data=folder,
                             plan=os.path.join(tmp, tag + ".plan"),
                             outputs=os.path.join(tmp, "out-" + tag), label=tag, timeout=120)


def check(pipec, name, case, tmp):
    path = os.path.join(tmp, name + ".onnx")
    onnx.save(build(case), path)
    data = feeds(case, 7)
    want = O.onnxruntime_outputs(path, data)
    if not O.ran(compile_and_run(pipec, path, data, tmp, name), name):
        return False
    ok = True
    for key, ref in want.items():
        got = np.load(os.path.join(tmp, "out-" + name, key + ".npy"))
        err = float(np.max(np.abs(got - ref))) if got.shape == ref.shape else float("inf")
        good = err <= 2e-5
        print("%s %s %s %s: max difference %.2e" % ("ok  " if good else "FAIL", name, key,
                                                    ref.shape, err))
        ok &= good
    return ok


def check_bad_length(pipec, tmp):
    """A seqlens_k past the buffer: run refuses it in one line naming the node and the row."""
    case = CASES["decode"]
    path = os.path.join(tmp, "bad.onnx")
    onnx.save(build(case), path)
    data = feeds(case, 7)
    data["seqlens_k"] = np.array([20, 3, 0], dtype=np.int32)
    result = compile_and_run(pipec, path, data, tmp, "bad")
    if result is None:
        return False
    lines = result.stderr.strip().splitlines()
    good = (result.returncode == 1 and len(lines) == 1 and "'gqa'" in lines[0]
            and "row 0: seqlens_k 20 does not fit 1 queries, a past of 7" in lines[0])
    print("%s bad seqlens_k: exit %d: %s" % ("ok  " if good else "FAIL", result.returncode,
                                              result.stderr.strip()))
    return good


def main():
    pipec = O.pipec_from_command_line()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            failures += 0 if check(pipec, name, case, tmp) else 1
        print("%d of %d cases equal onnxruntime" % (len(CASES) - failures, len(CASES)))
        failures += 0 if check_bad_length(pipec, tmp) else 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
