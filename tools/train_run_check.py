#!/usr/bin/env python3
"""A training run as users run one, checked from outside pipec.

  train_run_check.py --pipec build/bin/pipec --work DIR

1. TensorBoard: `pipec run --tensorboard DIR --metrics FILE` on a token
   file, 2 stages, evaluation every 4 steps. TensorBoard's own reader
   (tensorboard.backend.event_processing.EventAccumulator) reads every
   scalar back equal to the metrics line of its step, as float32 holds it.
2. Evaluation: the eval loss after the last step equals an inference run of
   the trained weights (--save-weights, then `compile --mode infer`) on the
   same windows, fed as per-input .npy files, whose loss output is the
   reference.
3. Formats: the same ids as a uint16 .bin, a uint32 .bin, a Megatron-LM
   .bin with its .idx, and a .npy train to the same losses.
4. Bad input: a token outside the vocabulary names its offset, a corpus
   shorter than a window, a --seq-len the plan was not compiled for and an
   evaluation set of another sequence length each give one line and exit 1
   or 2.

Needs numpy and tensorboard (tools/oracles.sh installs both).
"""
import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np

VOCAB, SEQ, BATCH, MICRO = 64, 16, 2, 2


def run(args, expect=0):
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != expect:
        sys.exit("FAIL: %s exited %d, expected %d:\n%s%s" % (" ".join(args), p.returncode, expect,
                                                               p.stdout, p.stderr))
    return p.stdout + p.stderr


def tokens(path, ids, code="H"):
    with open(path, "wb") as f:
        f.write(struct.pack("<%d%s" % (len(ids), code), *ids))


def check_tensorboard(metrics, board):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = [f for f in os.listdir(board) if "tfevents" in f]
    if len(files) != 1:
        sys.exit("FAIL: %s holds %d event files, expected 1" % (board, len(files)))
    acc = EventAccumulator(board, size_guidance={"scalars": 0})
    acc.Reload()
    lines = [json.loads(l) for l in open(metrics)]
    compared = 0
    for tag in acc.Tags()["scalars"]:
        read = {e.step: e.value for e in acc.Scalars(tag)}
        want = {l["step"]: l[tag] for l in lines if tag in l}
        if read.keys() != want.keys():
            sys.exit("FAIL: TensorBoard's %s has steps %s, --metrics %s" %
                     (tag, sorted(read), sorted(want)))
        for step, value in want.items():
            if np.float32(value) != np.float32(read[step]):
                sys.exit("FAIL: step %d %s: TensorBoard reads %r, --metrics says %r" %
                         (step, tag, read[step], value))
            compared += 1
    for tag in ("loss", "eval_loss", "lr", "tokens_per_s", "tflops", "mfu"):
        if tag not in acc.Tags()["scalars"]:
            sys.exit("FAIL: TensorBoard reads no %s scalar" % tag)
    print("tensorboard: %d scalars read back equal to --metrics" % compared)


def check_eval(pipec, work, plan, train_bin, eval_ids, metrics):
    trained = os.path.join(work, "trained.onnx")
    run([pipec, "run", plan, "--data", train_bin, "--steps", "8", "--quiet", "--save-weights",
         trained])
    # Evaluation batch 0: windows 0 .. G-1 of the evaluation file in order.
    G = BATCH * MICRO
    windows = np.array([eval_ids[w * SEQ:w * SEQ + SEQ + 1] for w in range(G)], dtype=np.int64)
    data = os.path.join(work, "eval-data")
    os.makedirs(data, exist_ok=True)
    np.save(os.path.join(data, "input_ids.npy"), windows[:, :SEQ])
    np.save(os.path.join(data, "labels.npy"), windows[:, 1:])
    infer = os.path.join(work, "infer.plan")
    run([pipec, "compile", trained, "-o", infer, "--mode", "infer", "--batch", str(BATCH),
         "--microbatches", "1",
         "--hardware", "cpu"])
    outputs = os.path.join(work, "outputs")
    losses = []
    for m in range(MICRO):
        # One microbatch of the evaluation batch per inference run.
        part = os.path.join(work, "part%d" % m)
        os.makedirs(part, exist_ok=True)
        for name in ("input_ids", "labels"):
            full = np.load(os.path.join(data, name + ".npy"))
            np.save(os.path.join(part, name + ".npy"), full[m * BATCH:(m + 1) * BATCH])
        run([pipec, "run", infer, "--data", part, "--outputs", outputs, "--quiet"])
        losses.append(float(np.load(os.path.join(outputs, "loss.npy"))))
    reference = sum(losses) / len(losses)
    last = [json.loads(l) for l in open(metrics)][-1]
    got = last["eval_loss"]
    if abs(got - reference) > 1e-6 * max(1.0, abs(reference)):
        sys.exit("FAIL: eval loss after step 8 is %r; the inference run of the same weights on "
                 "the same windows gives %r" % (got, reference))
    print("evaluation: eval loss %.7f equals the inference run's %.7f" % (got, reference))


def check_formats(pipec, work, plan, train_ids):
    """The same ids as uint16 .bin, uint32 .bin (--token-type), a Megatron
    .bin/.idx of int32 and an int64 .npy train alike."""
    def losses(path, *extra):
        metrics = os.path.join(work, "formats.jsonl")
        run([pipec, "run", plan, "--data", path, "--steps", "3", "--quiet", "--metrics", metrics] +
            list(extra))
        return [json.loads(l)["loss"] for l in open(metrics)]
    base = losses(os.path.join(work, "train.bin"))
    wide = os.path.join(work, "wide.bin")
    tokens(wide, train_ids, "I")
    megatron = os.path.join(work, "megatron", "corpus")
    os.makedirs(os.path.dirname(megatron), exist_ok=True)
    tokens(megatron + ".bin", train_ids, "i")
    with open(megatron + ".idx", "wb") as f:
        # Megatron-LM's header: magic, version 1, dtype code 4 (int32).
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([4]))
    npy = os.path.join(work, "ids.npy")
    np.save(npy, np.array(train_ids, dtype=np.int64))
    for name, got in (("uint32 .bin", losses(wide, "--token-type", "uint32")),
                      ("Megatron .bin/.idx", losses(megatron + ".bin")),
                      ("int64 .npy", losses(npy))):
        if got != base:
            sys.exit("FAIL: %s trains to %s, the uint16 .bin to %s" % (name, got, base))
    print("formats: uint16 and uint32 .bin, Megatron .bin/.idx and .npy give the same losses")


def check_errors(pipec, work, plan, train_bin):
    cases = []
    bad = os.path.join(work, "bad.bin")
    ids = [1] * 100
    ids[37] = VOCAB + 5
    tokens(bad, ids)
    cases.append(([pipec, "run", plan, "--data", bad, "--quiet"], 1, "offset 37"))
    short = os.path.join(work, "short.bin")
    tokens(short, [1] * SEQ)
    cases.append(([pipec, "run", plan, "--data", short, "--quiet"], 1, "fewer than one window"))
    cases.append(([pipec, "run", plan, "--data", train_bin, "--seq-len", "32", "--quiet"], 1,
                  "compiled for sequences of 16"))
    other = os.path.join(work, "other-seq")
    os.makedirs(other, exist_ok=True)
    np.save(os.path.join(other, "input_ids.npy"), np.ones((4, 8), dtype=np.int64))
    np.save(os.path.join(other, "labels.npy"), np.ones((4, 8), dtype=np.int64))
    cases.append(([pipec, "run", plan, "--data", train_bin, "--eval-data", other, "--eval-every",
                   "1", "--quiet"], 1, "--eval-data"))
    # A resume over a stream of other windows would not continue its order.
    ckpt = os.path.join(work, "ckpt")
    if os.path.isdir(ckpt):
        import shutil
        shutil.rmtree(ckpt)
    run([pipec, "run", plan, "--data", train_bin, "--steps", "2", "--checkpoint", ckpt,
         "--quiet"])
    other_bin = os.path.join(work, "other.bin")
    tokens(other_bin, [1] * 500)
    cases.append(([pipec, "run", plan, "--data", other_bin, "--steps", "3", "--checkpoint", ckpt,
                   "--resume", "--quiet"], 1, "resuming would not continue its order"))
    for args, code, needle in cases:
        p = subprocess.run(args, capture_output=True, text=True)
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        if p.returncode != code or len(lines) != 1 or needle not in lines[0]:
            sys.exit("FAIL: %s: exit %d, stderr %r; expected exit %d and one line naming %r" %
                     (" ".join(args[2:]), p.returncode, p.stderr, code, needle))
        print("bad input: " + lines[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model = os.path.join(a.work, "gpt.onnx")
    plan = os.path.join(a.work, "gpt.plan")
    run([a.pipec, "model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab",
         str(VOCAB), "--seq", str(SEQ), "--loss", "-o", model])
    run([a.pipec, "compile", model, "-o", plan, "--stages", "2", "--microbatches", str(MICRO),
         "--batch", str(BATCH * MICRO), "--hardware", "cpu"])
    rng = np.random.default_rng(7)
    train_bin = os.path.join(a.work, "train.bin")
    eval_bin = os.path.join(a.work, "eval.bin")
    train_ids = rng.integers(0, VOCAB, 3000).tolist()
    tokens(train_bin, train_ids)
    eval_ids = rng.integers(0, VOCAB, 400).tolist()
    tokens(eval_bin, eval_ids)
    metrics = os.path.join(a.work, "run.jsonl")
    board = os.path.join(a.work, "board")
    if os.path.isdir(board):
        for f in os.listdir(board):
            os.remove(os.path.join(board, f))
    run([a.pipec, "run", plan, "--data", train_bin, "--eval-data", eval_bin, "--eval-every", "4",
         "--eval-steps", "1", "--steps", "8", "--metrics", metrics, "--tensorboard", board,
         "--quiet"])
    check_tensorboard(metrics, board)
    check_eval(a.pipec, a.work, plan, train_bin, eval_ids, metrics)
    check_formats(a.pipec, a.work, plan, train_ids)
    check_errors(a.pipec, a.work, plan, train_bin)
    print("ok")


if __name__ == "__main__":
    main()
