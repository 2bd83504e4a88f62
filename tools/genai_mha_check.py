#!/usr/bin/env python3
"""Greedy generation of a real onnxruntime-genai export, `pipec generate` against onnxruntime.

The tiny Llama of ../shared/models/real/llama_tiny_genai_fp16 (onnxruntime-genai's test model:
fp16, external data, two decoder layers) keeps its KV cache in com.microsoft MultiHeadAttention
nodes: past_key_values.N.key/value in, present.N.key/value out, the new keys and values appended
along the sequence axis. This compiles it with `pipec compile --mode generate` on 1 and 2
stages, generates after seeded prompts, and decodes the same prompts greedily with onnxruntime,
one row at a time (prompt, then one token a step with the growing past, attention_mask and
position_ids, as onnxruntime-genai feeds it). The tokens must agree at every step up to the
first where onnxruntime's two best logits are within 0.02 of each other: the model is random
and fp16, so a near tie may go either way, and the rows part from there. Exit 0 on agreement,
1 on a difference, 77 when the model, numpy or onnxruntime is missing.

  python3 tools/genai_mha_check.py --pipec build/bin/pipec [--model PATH]
"""
import argparse
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import onnxruntime as ort
except ImportError as e:
    print("skipped: %s" % e)
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "..", "shared", "models", "real", "llama_tiny_genai_fp16",
                     "model.onnx")
NEW_TOKENS = 12
NEAR_TIE = 0.004


def ort_greedy(model, prompts):
    """Each row's greedy tokens and, per step, the margin of the best logit over the second."""
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    pasts = {}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            heads, size = i.shape[1], i.shape[3]
            pasts[i.name] = (heads, size)
    outputs = [o.name for o in session.get_outputs()]
    tokens, margins = [], []
    for row in prompts:
        ids = row[None, :].astype(np.int64)
        length = ids.shape[1]
        past = {n: np.zeros((1, h, 0, s), np.float16) for n, (h, s) in pasts.items()}
        positions = np.arange(length, dtype=np.int64)[None]
        row_tokens, row_margins = [], []
        for _ in range(NEW_TOKENS):
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, length), np.int64),
                     "position_ids": positions, **past}
            result = dict(zip(outputs, session.run(None, feeds)))
            logits = result["logits"][0, -1].astype(np.float32)
            best = np.sort(logits)[-2:]
            token = int(np.argmax(logits))
            row_tokens.append(token)
            row_margins.append(float(best[1] - best[0]))
            past = {n.replace("present", "past_key_values"): v for n, v in result.items()
                    if n.startswith("present")}
            ids = np.array([[token]], np.int64)
            positions = np.array([[length]], np.int64)
            length += 1
        tokens.append(row_tokens)
        margins.append(row_margins)
    return np.array(tokens), np.array(margins)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipec", required=True)
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args()
    if not os.path.exists(args.model):
        print("skipped: %s is absent" % args.model)
        return 77
    prompts = np.random.RandomState(3).randint(1, 32000, size=(8, 7)).astype(np.int64)
    expected, margins = ort_greedy(args.model, prompts)
    failures, compared = 0, 0
    with tempfile.TemporaryDirectory() as work:
        prompts_path = os.path.join(work, "prompts.npy")
        np.save(prompts_path, prompts)
        for stages in (1, 2):
            plan = os.path.join(work, "llama-%d.plan" % stages)
            out = os.path.join(work, "out-%d.npy" % stages)
            for command in (
                    [args.pipec, "compile", args.model, "--mode", "generate", "--max-length", "32",
                     "--stages", str(stages), "--hardware", "cpu", "-o", plan],
                    [args.pipec, "generate", plan, "--prompts", prompts_path,
                     "--max-new-tokens", str(NEW_TOKENS), "-o", out]):
                run = subprocess.run(command, capture_output=True, text=True)
                if run.returncode != 0:
                    print("FAIL %d stage(s): %s\n%s" % (stages, " ".join(command[:2]),
                                                        run.stdout + run.stderr))
                    return 1
            got = np.load(out)
            for r in range(len(prompts)):
                for t in range(NEW_TOKENS):
                    compared += 1
                    if got[r, t] != expected[r, t]:
                        failures += 1
                        print("FAIL %d stage(s), row %d, token %d: pipec %d, onnxruntime %d "
                              "(margin %.4f)" % (stages, r, t, got[r, t], expected[r, t],
                                                 margins[r, t]))
                        break
                    if margins[r, t] < NEAR_TIE:
                        break  # a near tie: the rows may part from here
            print("%d stage(s): %s" % (stages, "ok" if not failures else "differs"))
    print("compared %d tokens" % compared)
    if compared < 2 * len(prompts) * 2:
        print("FAIL too few tokens compared before a near tie: choose other prompts")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
