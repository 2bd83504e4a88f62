#!/usr/bin/env python3
"""pipec generate against onnxruntime-genai on the builder's tiny Llama, alternated in one run.

The model is tests/fixtures/genai/llama.onnx, onnxruntime-genai's model builder's fp32 CPU export
(GroupQueryAttention, 4 layers, width 64, vocabulary 100; tools/fixtures/genai_generate.py made
it). Its genai_config.json is written from the fixture's MANIFEST.json beside a copy of the model,
as the builder writes one. The job: 64 seeded prompts of 6 tokens, 58 new tokens each, greedy,
4 rows decoded at a time: onnxruntime-genai in 16 batches of 4 (OMP_NUM_THREADS=THREADS), pipec
with a plan of --slots 4 (--max-length 64 --prompt-length 6 --stages 1 --hardware cpu), each
finished row's slot refilled. Each contender runs in a fresh process per round, the two
alternating; tokens/s is the generation loop's own (after the model is loaded: pipec's printed
figure, onnxruntime-genai timed around its loop after a warm-up batch). The rows whose tokens are
equal are counted. Prints a Markdown table of each round and the medians.

  python3 tools/bench_genai_tiny.py --pipec build/bin/pipec [--rounds 5] [--threads 2]
  (numpy and onnxruntime-genai; exit 77 without them)
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "genai")
PROMPTS, PROMPT_LEN, NEW, ROWS = 64, 6, 58, 4


def genai_config(config):
    """onnxruntime-genai's genai_config.json for the builder's Llama of \\p config."""
    return {
        "model": {
            "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
            "context_length": config["max_position_embeddings"], "type": "llama",
            "vocab_size": config["vocab_size"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx", "head_size": config["head_dim"],
                "hidden_size": config["hidden_size"],
                "num_attention_heads": config["num_attention_heads"],
                "num_hidden_layers": config["num_hidden_layers"],
                "num_key_value_heads": config["num_key_value_heads"],
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"}}},
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1,
                   "max_length": config["max_position_embeddings"], "min_length": 0,
                   "past_present_share_buffer": True, "top_k": 1, "top_p": 1.0,
                   "temperature": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "diversity_penalty": 0.0, "early_stopping": True}}


def genai_worker(folder, prompts_path, out):
    import numpy as np
    import onnxruntime_genai as og
    model = og.Model(folder)
    prompts = np.load(prompts_path).astype(np.int32)

    def batch(rows):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=PROMPT_LEN + NEW,
                                  min_length=PROMPT_LEN + NEW, batch_size=len(rows))
        generator = og.Generator(model, params)
        generator.append_tokens(rows)
        while not generator.is_done():
            generator.generate_next_token()
        return [np.asarray(generator.get_sequence(i))[PROMPT_LEN:] for i in range(len(rows))]

    batch(prompts[:ROWS])
    start = time.perf_counter()
    tokens = []
    for first in range(0, len(prompts), ROWS):
        tokens += batch(prompts[first:first + ROWS])
    seconds = time.perf_counter() - start
    np.save(out, np.stack(tokens).astype(np.int64))
    print(json.dumps({"tokens_per_s": len(prompts) * NEW / seconds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipec", default=os.path.join(ROOT, "build", "bin", "pipec"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--genai-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.genai_worker:
        genai_worker(*args.genai_worker)
        return 0
    try:
        import numpy as np
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        print("skipped: %s" % e)
        return 77
    with tempfile.TemporaryDirectory() as work:
        folder = os.path.join(work, "genai")
        os.makedirs(folder)
        shutil.copy(os.path.join(FIXTURE, "llama.onnx"), os.path.join(folder, "model.onnx"))
        with open(os.path.join(FIXTURE, "MANIFEST.json")) as f:
            config = json.load(f)["config"]
        with open(os.path.join(folder, "genai_config.json"), "w") as f:
            json.dump(genai_config(config), f, indent=1)
        prompts = os.path.join(work, "prompts.npy")
        np.save(prompts, np.random.RandomState(2).randint(
            2, config["vocab_size"], size=(PROMPTS, PROMPT_LEN)).astype(np.int64))
        plan = os.path.join(work, "llama.plan")
        subprocess.run([args.pipec, "compile", os.path.join(folder, "model.onnx"), "--mode",
                        "generate", "--max-length", str(PROMPT_LEN + NEW), "--prompt-length",
                        str(PROMPT_LEN), "--stages", "1", "--slots", str(ROWS), "--hardware",
                        "cpu", "-o", plan], check=True, capture_output=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        rows = []
        for r in range(args.rounds):
            genai_out, pipec_out = (os.path.join(work, n) for n in ("genai.npy", "pipec.npy"))
            done = subprocess.run([sys.executable, __file__, "--genai-worker", folder, prompts,
                                   genai_out], check=True, capture_output=True, text=True,
                                  env=env)
            genai = json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]
            done = subprocess.run([args.pipec, "generate", plan, "--prompts", prompts,
                                   "--max-new-tokens", str(NEW), "--threads-per-rank",
                                   str(args.threads), "-o", pipec_out], check=True,
                                  capture_output=True, text=True)
            ours = float(re.search(r"([0-9.]+) tokens/s", done.stdout + done.stderr).group(1))
            equal = int((np.load(genai_out) == np.load(pipec_out)).all(axis=1).sum())
            rows.append((ours, genai, equal))
            print("round %d: pipec %.0f tokens/s, onnxruntime-genai %.0f, %.2fx; rows equal %d/%d"
                  % (r + 1, ours, genai, ours / genai, equal, PROMPTS), flush=True)
    ours = statistics.median(r[0] for r in rows)
    genai = statistics.median(r[1] for r in rows)
    print("\n| contender | tokens/s, median of %d | rounds |" % len(rows))
    print("|---|---:|---|")
    print("| pipec generate | %.0f | %s |" % (ours, ", ".join("%.0f" % r[0] for r in rows)))
    print("| onnxruntime-genai | %.0f | %s |" % (genai, ", ".join("%.0f" % r[1] for r in rows)))
    print("\npipec / onnxruntime-genai: %.2fx; rows equal in every round: %s"
          % (ours / genai, all(r[2] == PROMPTS for r in rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
