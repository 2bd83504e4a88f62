#!/usr/bin/env python3
"""pipec beside PyTorch: the committed torch fixtures through pipec compile and run.

tests/fixtures/torch/ holds what PyTorch itself computed (tools/fixtures/torch_reference.py and
torch_exports.py made them; torch is not needed here):

  train/NAME.onnx, NAME_legacy.onnx  a model with its loss, exported by torch.onnx (dynamo and
                                     the legacy exporter)
  train/NAME.data/                   the batch: token ids, labels padded with -100, images
  train/NAME.npz                     init/P, grad/P, sgd1/P (one SGD step, lr 0.1) and adamw3/P
                                     (three AdamW steps on the batch: lr 1e-2, betas 0.9/0.999,
                                     eps 1e-8, weight decay 0.1) per torch parameter P
  train/NAME.json                    torch's loss, and which initializer holds each parameter
  export/NAME.onnx, .data/, .torch/  an inference export and torch's eager outputs

Each training model runs in every configuration of CONFIGS (stages, schedule, microbatches,
data parallelism): `pipec compile --mode train`, then `pipec run --steps 1 --optimizer sgd
--lr 0.1 --save-weights`, and in the AdamW configurations `--steps 3 --optimizer adamw`. It
compares with torch's full-batch step:

  loss        |pipec - torch| <= 1e-5 * |torch|
  sgd1        per parameter, |w_pipec - w_torch| <= 1e-4 * |torch's whole update|
              (norms over all elements); this checks each gradient, scaled by lr
  adamw3      over all parameters, |w_pipec - w_torch| <= 1e-3 * |torch's whole change|
              (Adam normalises each element's gradient, so float noise in a near-zero
              gradient moves that element by up to lr in either framework); every parameter
              torch changes must change
              Rows torch never trains (nn.Embedding's padding_idx, which the exported Gather
              does not carry: NAME.json's padding_rows) are named by --pad-row for the user
              exports, and compared like any other; elsewhere left out of sgd1 and adamw3.
  padded      the language models once more on NAME.padded.data, 16 samples whose padding
              (-100 labels) differs per microbatch, one microbatch of a causal model counting
              no label at all, against torch's SGD step on all 16 at once
              (tools/fixtures/torch_padded_batch.py): the mean over counted labels, not the
              mean of microbatch means
  trained     every parameter torch changes, pipec trains; every buffer stays as it was but
              BatchNorm's running mean and variance, which after one SGD step equal torch's
              (1e-5 relative, 1e-6 absolute)
  reloaded    after one SGD step the model pipec saved runs in onnxruntime, and its loss equals
              that of the original model holding torch's weights after the step (1e-5)
  autocast    --precision bf16 --autocast (bf16 activations, float32 weights), 50 AdamW steps
              (lr 1e-3) on the batch: every step's loss within 1% of torch's own run under
              torch.autocast(bfloat16), the last within 1% of torch's float32 run
              (train/autocast.json, tools/fixtures/torch_autocast.py; GPT-2, Llama, BERT, ViT)

The tensor-parallel configurations (--tp 2) split each stage's products over two ranks
(shard-tensors) and hold them to the same torch step.

Each inference export runs at 1, 2 and 4 stages (as many microbatches, each the export's fixed
batch): outputs within 1e-4 (absolute, plus 1e-4 relative) of torch's eager outputs.

A case is pass, wrong (ran, numbers differ), refused (pipec stopped with a one-line error,
exit 1), or known (a difference listed in KNOWN, with its reason). With --floor N the script exits
1 when fewer than N cases pass, any is wrong, or a known difference has gone.

The user exports compile with --params: torch's parameters (the fixture's init/ tensors) written
as a .safetensors checkpoint, which pipec maps onto the folded initializers, so that decoupled weight
decay acts on each parameter (w of a 1 + w norm scale), as torch's.

Usage:
  torch_parity.py --pipec build/bin/pipec [--filter REGEX] [--floor N] [--verbose]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from safetensors.numpy import save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                    "torch"))

# (label, compile flags, microbatches M, replicas, optimizer). The exports have a fixed batch B
# (4 for training), so a microbatch holds B samples and a step M x replicas x B: the batch
# repeats in every microbatch, and the step's mean equals torch's step on the batch.
CONFIGS = [
    ("P1", ["--stages", "1"], 1, 1, "sgd"),
    ("P2-1f1b", ["--stages", "2", "--schedule", "1f1b"], 4, 1, "sgd"),
    ("P4-1f1b", ["--stages", "4", "--schedule", "1f1b"], 4, 1, "sgd"),
    ("P2-zb-h1", ["--stages", "2", "--schedule", "zb-h1"], 4, 1, "sgd"),
    ("P2V2-interleaved", ["--stages", "2", "--virtual-stages", "2", "--schedule", "interleaved"],
     4, 1, "sgd"),
    ("P2-zbv", ["--stages", "2", "--virtual-stages", "2", "--schedule", "zbv"], 4, 1, "sgd"),
    ("P2-dualpipev", ["--stages", "2", "--virtual-stages", "2", "--schedule", "dualpipev"], 4,
     1, "sgd"),
    ("P2-dp2", ["--stages", "2", "--schedule", "1f1b"], 2, 2, "sgd"),
    ("P2-1f1b-adamw", ["--stages", "2", "--schedule", "1f1b"], 4, 1, "adamw"),
    # The optimizer state sharded over 2 replicas (ZeRO-1): torch's AdamW all the same.
    ("P2-dp2-adamw-sharded", ["--stages", "2", "--schedule", "1f1b", "--shard-optimizer"], 2, 2,
     "adamw"),
    # 16 samples whose padding differs per microbatch (NAME.padded.*, language models).
    ("P2-1f1b-padded", ["--stages", "2", "--schedule", "1f1b"], 4, 1, "padded"),
    ("P4-zbv-dp2-padded", ["--stages", "2", "--virtual-stages", "2", "--schedule", "zbv"], 2, 2,
     "padded"),
    # Tensor parallelism (shard-tensors): each stage's products split over 2 ranks.
    ("P1-tp2", ["--stages", "1", "--tp", "2"], 2, 1, "sgd"),
    ("P2-tp2-1f1b", ["--stages", "2", "--schedule", "1f1b", "--tp", "2"], 4, 1, "sgd"),
    ("P2-tp2-dp2-adamw-sharded", ["--stages", "2", "--schedule", "1f1b", "--tp", "2",
                                  "--shard-optimizer"], 2, 2, "adamw"),
    ("P2-tp2-padded", ["--stages", "2", "--schedule", "1f1b", "--tp", "2"], 4, 1, "padded"),
    # Sequence parallelism: norms and residuals split on the tokens over the same 2 ranks.
    ("P2-tp2-sp-1f1b", ["--stages", "2", "--schedule", "1f1b", "--tp", "2",
                        "--sequence-parallel"], 4, 1, "sgd"),
    ("P2-tp2-sp-dp2-adamw-sharded", ["--stages", "2", "--schedule", "1f1b", "--tp", "2",
                                     "--sequence-parallel", "--shard-optimizer"], 2, 2, "adamw"),
    # bf16 activations (--autocast), 50 AdamW steps against torch's own autocast run
    # (train/autocast.json, the models it names).
    ("P1-autocast", ["--stages", "1"], 1, 1, "autocast"),
    ("P2-1f1b-autocast", ["--stages", "2", "--schedule", "1f1b"], 2, 1, "autocast"),
]
INFER_STAGES = [1, 2, 4]

# Known differences, by ONNX file or (ONNX file, configuration): a case here that differs is
# "known", not "wrong"; one that matches fails the run until it is taken off the list.
KNOWN = {}


# The AdamW differences above are the graph's, whatever the optimizer state's layout.
for (file, label), why in list(KNOWN.items()):
    if isinstance(file, str) and label == "P2-1f1b-adamw":
        KNOWN[(file, "P2-dp2-adamw-sharded")] = why


class Refused(Exception):
    pass


def pipec(args, cwd):
    r = subprocess.run([PIPEC] + args, cwd=cwd, capture_output=True, text=True, timeout=300)
    if r.returncode == 1 or r.returncode == 2:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise Refused(lines[-1] if lines else "exit %d" % r.returncode)
    if r.returncode != 0:
        raise RuntimeError("pipec %s: exit %d\n%s" % (args[0], r.returncode, r.stderr))
    return r.stdout


def initializers(path):
    m = onnx.load(path)
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def apply_transform(v, steps):
    """torch's tensor v as an initializer holds it: the steps of a fixture's "transform" in order
    (tools/fixtures/torch_user_exports.py): {"transpose": PERM}, {"slice": [AXIS, START, STOP]},
    {"unsqueeze": AXIS}, {"add": C} (C + v) and {"take": {"indices", "shape"}} (v's flat
    elements by constant positions)."""
    v = np.asarray(v)
    for step in steps:
        (op, arg), = step.items()
        if op == "transpose":
            v = np.transpose(v, arg)
        elif op == "slice":
            axis, start, stop = arg
            v = v[(slice(None),) * axis + (slice(start, stop),)]
        elif op == "unsqueeze":
            v = np.expand_dims(v, arg)
        elif op == "add":
            v = v + np.asarray(arg, v.dtype)
        elif op == "take":
            v = v.ravel()[arg["indices"]].reshape(arg["shape"])
        else:
            raise ValueError("unknown transform %r" % op)
    return v


def transform_of(where):
    """The steps from torch's tensor to the initializer: "transform", or the older
    "transposed"."""
    if "transform" in where:
        return where["transform"]
    return [{"transpose": [1, 0]}] if where.get("transposed") else []


def expected_value(npz, key, where):
    return apply_transform(npz[key], transform_of(where))


def batch_of(manifest_entry):
    return manifest_entry["inputs"][0]["shape"][0]


def check_autocast(onnx_path, base, flags, work):
    """--precision bf16 --autocast: each of the 50 AdamW steps' losses within 1% of torch's
    own autocast run, the last within 1% of torch's float32 run."""
    ref = json.load(open(os.path.join(ROOT, "train", "autocast.json")))
    want = ref["models"][base]
    plan = os.path.join(work, "model.plan")
    metrics = os.path.join(work, "metrics.jsonl")
    pipec(["compile", onnx_path, "-o", plan, "--mode", "train", "--optimizer", "adamw",
           "--precision", "bf16", "--autocast"] + flags, work)
    pipec(["run", plan, "--model", onnx_path, "--data", os.path.join(ROOT, "train", base + ".data"),
           "--steps", str(ref["steps"]), "--optimizer", "adamw", "--lr", str(ref["lr"]),
           "--weight-decay", "0.1", "--metrics", metrics, "--quiet"], work)
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    problems = []
    if len(losses) != ref["steps"]:
        return ["%d losses for %d steps" % (len(losses), ref["steps"])], ""
    steps = [abs(a - b) / abs(b) for a, b in zip(losses, want["bf16"])]
    worst = int(np.argmax(steps))
    if steps[worst] > 1e-2:
        problems.append("step %d: loss %.6g, torch's autocast %.6g (relative %.2e)"
                        % (worst + 1, losses[worst], want["bf16"][worst], steps[worst]))
    last = abs(losses[-1] - want["fp32"][-1]) / abs(want["fp32"][-1])
    if last > 1e-2:
        problems.append("last loss %.6g, torch's float32 %.6g (relative %.2e)"
                        % (losses[-1], want["fp32"][-1], last))
    return problems, ("loss %.4f -> %.4f; worst step %.1e from torch bf16, last %.1e from fp32"
                      % (losses[0], losses[-1], steps[worst], last))


def check_train(onnx_path, base, flags, optimizer, work):
    if optimizer == "autocast":
        return check_autocast(onnx_path, base, flags, work)
    meta = json.load(open(os.path.join(ROOT, "train", base + ".json")))
    npz = np.load(os.path.join(ROOT, "train", base + ".npz"))
    where = meta["onnx"][os.path.basename(onnx_path)]
    data = os.path.join(ROOT, "train", base + ".data")
    torch_loss = meta["torch_loss"]
    if optimizer == "padded":
        padded = np.load(os.path.join(ROOT, "train", base + ".padded.npz"))
        npz = {**{k: npz[k] for k in npz.files if k.startswith("init/")},
               **{k: padded[k] for k in padded.files}}
        data = os.path.join(ROOT, "train", base + ".padded.data")
        torch_loss = float(padded["loss"])
        optimizer = "sgd"
    plan = os.path.join(work, "model.plan")
    if base.startswith("user_"):
        params = os.path.join(work, "params.safetensors")
        save_file({k[len("init/"):]: np.ascontiguousarray(npz[k]) for k in npz.keys()
                   if k.startswith("init/")}, params, metadata={"format": "pt"})
        flags = flags + ["--params", params]
        # nn.Embedding's padding_idx, which the exported Gather does not carry: the user
        # names the rows (the config's pad_token_id does the same beside a checkpoint).
        for p, rows in meta.get("padding_rows", {}).items():
            flags += sum((["--pad-row", "%s=%d" % (p, r)] for r in rows), [])
    pipec(["compile", onnx_path, "-o", plan, "--mode", "train", "--optimizer", optimizer]
          + flags, work)
    steps = 3 if optimizer == "adamw" else 1
    run = ["run", plan, "--model", onnx_path, "--data", data, "--steps", str(steps),
           "--save-weights",
           os.path.join(work, "out.onnx"), "--metrics", os.path.join(work, "metrics.jsonl"),
           "--quiet"]
    if optimizer == "adamw":
        run += ["--optimizer", "adamw", "--lr", "1e-2", "--weight-decay", "0.1"]
    else:
        run += ["--optimizer", "sgd", "--lr", "0.1"]
    pipec(run, work)
    losses = [json.loads(line)["loss"] for line in open(os.path.join(work, "metrics.jsonl"))]
    after = initializers(os.path.join(work, "out.onnx"))
    problems = []
    loss_err = abs(losses[0] - torch_loss) / abs(torch_loss)
    if loss_err > 1e-5:
        problems.append("loss %.8g, torch %.8g (relative %.2e)" % (losses[0], torch_loss,
                                                                   loss_err))
    key = "adamw3/" if optimizer == "adamw" else "sgd1/"
    tol = 1e-3 if optimizer == "adamw" else 1e-4
    params = where["params"]
    padding = {} if "--pad-row" in flags else padding_rows(meta, params)
    update = np.sqrt(sum(float(np.sum((npz[key + p].astype(np.float64)
                                       - npz["init/" + p]) ** 2)) for p in params))
    worst, total = 0.0, 0.0
    for p, w in params.items():
        if w is None:
            continue
        got = after.get(w["initializer"])
        if got is None:
            problems.append("parameter %s: initializer %s missing from the saved model"
                            % (p, w["initializer"]))
            continue
        want = expected_value(npz, key + p, w)
        init = expected_value(npz, "init/" + p, w)
        if p in padding:
            got = got.copy()
            got[padding[p]] = want[padding[p]]
        err = float(np.linalg.norm((got.astype(np.float64) - want).ravel()))
        worst = max(worst, err / update)
        total += err * err
        if optimizer == "adamw" and not np.array_equal(got, init):
            continue  # judged as a whole below
        if err > tol * update:
            moved = float(np.abs(want - init).max())
            if np.array_equal(got, init) and moved > 0:
                problems.append("parameter %s (%s) not trained; torch moves it by %.3g"
                                % (p, w["initializer"], moved))
            else:
                problems.append("parameter %s: |pipec - torch| %.3g > %g x torch's update %.3g"
                                % (p, err, tol, update))
    # Adam divides each gradient by its own root mean square: elements whose
    # gradient is float noise (|g| near eps, such as attention keys' directions
    # the softmax ignores) move by up to lr either way in both frameworks, so
    # AdamW is judged over all parameters together.
    if optimizer == "adamw" and np.sqrt(total) > tol * update:
        problems.append("all parameters: |pipec - torch| %.3g > %g x torch's change %.3g"
                        % (np.sqrt(total), tol, update))
    if key == "sgd1/" and not problems:
        problems += reload_in_onnxruntime(onnx_path, os.path.join(work, "out.onnx"), where, npz,
                                          data, tied=bool(meta.get("tied_aliases")),
                                          padding=padding)
    before = initializers(onnx_path)
    running = {b for b in meta.get("buffers", {}) if "sgd1_buffers/" + b in npz
               and not b.endswith("num_batches_tracked")}
    problems += check_running_stats(onnx_path, base, meta, npz, before, after, running,
                                    key == "sgd1/")
    for b, w in where.get("buffers", {}).items():
        if w is None or w["initializer"] not in after or b in running:
            continue
        if not np.array_equal(after[w["initializer"]], before[w["initializer"]]):
            problems.append("buffer %s (%s) changed; torch does not train it"
                            % (b, w["initializer"]))
    return problems, "loss rel %.1e, worst param %.1e, all %.1e of update" % (
        loss_err, worst, np.sqrt(total) / update)


def momenta(onnx_path):
    """Running buffer -> the momentum of the BatchNormalization that reads it."""
    out = {}
    for n in onnx.load(onnx_path, load_external_data=False).graph.node:
        if n.op_type == "BatchNormalization":
            m = next((a.f for a in n.attribute if a.name == "momentum"), 0.9)
            for name in n.input[3:5]:
                out[name] = m
    return out


def check_running_stats(onnx_path, base, meta, npz, before, after, running, one_sgd_step):
    """BatchNorm's running mean and variance after one step against torch's (sgd1_buffers/).
    torch's update is buffer = momentum * buffer + (1 - momentum) * batch statistic. A file
    whose buffers start elsewhere (the legacy exporter runs the model in training mode while it
    exports, moving them once) is judged by the same statistic: torch's step minus momentum
    times torch's starting value, which the dynamo export of the model holds."""
    problems = []
    where = meta["onnx"][os.path.basename(onnx_path)]
    dynamo = meta["onnx"].get(base + ".onnx", {}).get("buffers", {})
    dynamo_init = initializers(os.path.join(ROOT, "train", base + ".onnx")) if running else {}
    moms = momenta(onnx_path) if running else {}
    for b in sorted(running):
        w = where.get("buffers", {}).get(b)
        name = w["initializer"] if w else meta.get("wrapper_prefix_in_onnx_names", "") + b
        if name not in after or name not in moms:
            problems.append("running statistic %s (%s) is not in the saved model" % (b, name))
            continue
        if not one_sgd_step:
            continue  # torch's reference is for one step
        if dynamo.get(b) is None:
            problems.append("running statistic %s: no torch starting value" % b)
            continue
        m = moms[name]
        start = dynamo_init[dynamo[b]["initializer"]].astype(np.float64)
        want = m * before[name].astype(np.float64) + (npz["sgd1_buffers/" + b] - m * start)
        err = float(np.abs(after[name] - want).max())
        if not np.allclose(after[name], want, rtol=1e-5, atol=1e-6):
            problems.append("running statistic %s differs from torch's by %.3g" % (b, err))
    return problems


def ort_loss(model, data):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.load(os.path.join(data, i.name.replace("/", "_").replace(":", "_")
                                          + ".npy"))[:i.shape[0]]
             for i in sess.get_inputs()}
    return float(sess.run(None, feeds)[0])


def folded_aliases(model, where, npz):
    """The initializers an exporter folded from a tied parameter: torch's tied alias (GPT-2's
    lm_head.weight is wte) written as its own initializer holding the parameter's transpose.
    Returns {initializer: (param, where)}; torch's trained model holds the trained parameter's
    transpose there."""
    out = {}
    for t in model.graph.initializer:
        x = numpy_helper.to_array(t)
        if x.ndim != 2 or x.size < 2 or np.all(x == x.flat[0]):
            continue
        for p, w in where["params"].items():
            if w is None or w["initializer"] == t.name:
                continue
            init = expected_value(npz, "init/" + p, w)
            if init.shape == x.T.shape and np.array_equal(init.T, x):
                out[t.name] = (p, w)
    return out


def padding_rows(meta, params):
    """torch parameter -> the rows torch never trains: nn.Embedding(padding_idx=i) keeps row i's
    gradient from the lookup at zero, and the exported Gather carries no padding_idx, so an
    ONNX trainer (pipec, onnxruntime's) trains the row as the graph says. Those rows are left
    out of the comparison; only parameters the initializer holds as they are (no transform)."""
    out = {}
    for p, rows in meta.get("padding_rows", {}).items():
        w = params.get(p)
        if w is not None and not transform_of(w):
            out[p] = rows
    return out


def reload_in_onnxruntime(onnx_path, saved_path, where, npz, data, tied=False, padding={}):
    """The model pipec saved runs in onnxruntime, and its loss on the batch equals the loss of
    the original model holding torch's weights after the same step (with tied, the
    initializers an exporter folded from a tied parameter hold its trained transpose too; the
    padding rows torch never trains, where not named by --pad-row, hold what pipec saved)."""
    saved = onnx.load(saved_path)
    reference = onnx.load(onnx_path)
    by_name = {t.name: t for t in reference.graph.initializer}
    mapped = {w["initializer"] for w in where["params"].values() if w is not None}
    folded = folded_aliases(reference, where, npz) if tied else {}
    saved_values = {t.name: t for t in saved.graph.initializer}
    for p, w in where["params"].items():
        if w is not None and w["initializer"] in by_name:
            value = np.array(expected_value(npz, "sgd1/" + p, w))
            if p in padding:
                rows = padding[p]
                value[rows] = numpy_helper.to_array(saved_values[w["initializer"]])[rows]
            by_name[w["initializer"]].CopyFrom(numpy_helper.from_array(
                np.ascontiguousarray(value), w["initializer"]))
    for name, (p, w) in folded.items():
        if name not in mapped:
            by_name[name].CopyFrom(numpy_helper.from_array(
                np.ascontiguousarray(expected_value(npz, "sgd1/" + p, w).T), name))
    # Initializers no torch parameter or buffer explains: tensors torch computes as constants
    # in its forward (T5's zero position bias of cross attention) that the exporter folded into
    # initializers. ONNX cannot say they are not parameters; pipec trains those the loss depends
    # on (its warnings name them), so they hold what pipec saved.
    explained = mapped | set(folded) | {a["initializer"] for w in where["params"].values()
                                        if w is not None for a in w.get("also", [])}
    explained |= {w["initializer"] for w in where.get("buffers", {}).values() if w is not None}
    for name, t in by_name.items():
        if name not in explained and name in saved_values:
            t.CopyFrom(saved_values[name])
    # Constant nodes likewise (the legacy exporter writes T5's zero bias so).
    saved_constants = {n.name: n for n in saved.graph.node if n.op_type == "Constant"}
    for n in reference.graph.node:
        if n.op_type == "Constant" and n.name in saved_constants:
            n.CopyFrom(saved_constants[n.name])
    got, want = ort_loss(saved, data), ort_loss(reference, data)
    if abs(got - want) > 1e-5 * abs(want):
        return ["the saved model's loss in onnxruntime %.8g, torch's trained weights give %.8g"
                % (got, want)]
    return []


def check_infer(onnx_path, base, stages, batch, work):
    plan = os.path.join(work, "model.plan")
    pipec(["compile", onnx_path, "-o", plan, "--mode", "infer", "--stages", str(stages),
           "--microbatches", str(stages), "--batch", str(batch * stages)], work)
    out = os.path.join(work, "outputs")
    pipec(["run", plan, "--model", onnx_path, "--data", os.path.join(ROOT, "export",
           base + ".data"), "--outputs", out, "--quiet"], work)
    problems, worst = [], 0.0
    torch_dir = os.path.join(ROOT, "export", base + ".torch")
    for f in sorted(os.listdir(torch_dir)):
        # The batch repeats in every microbatch (the export's batch is fixed).
        want = np.load(os.path.join(torch_dir, f))
        want = np.concatenate([want] * stages, axis=0) if want.ndim else want
        got_path = os.path.join(out, f)
        if not os.path.exists(got_path):
            problems.append("output %s missing" % f[:-4])
            continue
        got = np.load(got_path)
        if got.shape != want.shape:
            problems.append("output %s shape %s, torch %s" % (f[:-4], got.shape, want.shape))
            continue
        err = float(np.abs(got.astype(np.float64) - want).max())
        worst = max(worst, err)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
            problems.append("output %s differs from torch by %.3g" % (f[:-4], err))
    return problems, "max |pipec - torch| %.1e" % worst


# The user exports (tools/fixtures/torch_user_exports.py: the loss output named "out" or left
# unnamed, the exporter's default optimisation) in these configurations.
USER_CONFIGS = {"P1", "P2-1f1b", "P4-1f1b", "P2-zbv", "P2-dualpipev", "P2-1f1b-adamw",
                "P2-dp2-adamw-sharded"}
MANIFESTS = [("MANIFEST.json", None), ("MANIFEST.user_exports.json", USER_CONFIGS)]


def cases():
    autocast = json.load(open(os.path.join(ROOT, "train", "autocast.json")))["models"]
    for manifest_file, labels in MANIFESTS:
        manifest = json.load(open(os.path.join(ROOT, "train", manifest_file)))
        for name in sorted(manifest["models"]):
            base = name[:-len("_legacy")] if name.endswith("_legacy") else name
            path = os.path.join(ROOT, "train", manifest["models"][name]["file"])
            batch = batch_of(manifest["models"][name])
            padded = os.path.exists(os.path.join(ROOT, "train", base + ".padded.npz"))
            for label, flags, microbatches, replicas, optimizer in CONFIGS:
                if optimizer == "padded" and not padded or labels and label not in labels:
                    continue
                if optimizer == "autocast" and base not in autocast:
                    continue
                flags = flags + ["--microbatches", str(microbatches), "--dp", str(replicas),
                                 "--batch", str(batch * microbatches * replicas)]
                file = os.path.basename(path)
                yield ("train %s %s" % (name, label),
                       lambda w, p=path, b=base, f=flags, o=optimizer: check_train(p, b, f, o, w),
                       KNOWN.get((file, label), KNOWN.get(file)))
    for manifest_file, _ in MANIFESTS:
        manifest = json.load(open(os.path.join(ROOT, "export", manifest_file)))
        for name in sorted(manifest["models"]):
            path = os.path.join(ROOT, "export", manifest["models"][name]["file"])
            batch = batch_of(manifest["models"][name])
            for stages in INFER_STAGES:
                yield ("infer %s P%d" % (name, stages),
                       lambda w, p=path, b=name, s=stages, n=batch: check_infer(p, b, s, n, w),
                       None)


def main():
    global PIPEC
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--filter", default="")
    ap.add_argument("--floor", type=int, default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    PIPEC = os.path.abspath(args.pipec)
    counts = {"pass": 0, "wrong": 0, "refused": 0, "known": 0, "unexpected pass": 0}
    refusals = {}
    for name, check, known in cases():
        if args.filter and not re.search(args.filter, name):
            continue
        with tempfile.TemporaryDirectory() as work:
            try:
                problems, summary = check(work)
            except Refused as e:
                counts["refused"] += 1
                refusals.setdefault(str(e), []).append(name)
                if args.verbose:
                    print("refused  %-40s %s" % (name, e))
                continue
        status = "wrong" if problems else "pass"
        if known:
            status = "known" if problems else "unexpected pass"
            if problems:
                problems = ["known: " + known] + problems[:1]
            else:
                problems = ["matches torch now: take it off KNOWN (%s)" % known]
        counts[status] += 1
        if problems or args.verbose:
            print("%-8s %-40s %s" % (status.split()[0], name, summary))
        for p in problems[:8]:
            print("           " + p)
    print("\nrefusals:")
    for why, names in sorted(refusals.items(), key=lambda kv: -len(kv[1])):
        print("  %3d  %s" % (len(names), why[:150]))
    total = sum(counts.values())
    print("\n%d cases: %d pass, %d wrong, %d refused, %d known differences"
          % (total, counts["pass"], counts["wrong"], counts["refused"], counts["known"]))
    bad = counts["wrong"] + counts["unexpected pass"]
    if bad or (args.floor is not None and counts["pass"] < args.floor):
        print("FAILED: %s" % ("%d wrong or unexpectedly passing" % bad if bad else
                              "%d pass, floor %d" % (counts["pass"], args.floor)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
