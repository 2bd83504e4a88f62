#!/usr/bin/env python3
"""pipec generate against transformers' generate, at real size, on this CPU.

Models, built from configs with random seeded weights (no download):
  gpt2   GPT-2 small, the published shape: 12 layers, width 768, 12 heads,
         vocabulary 50257, 1024 positions (124M parameters)
  llama  a Llama of 246M: 16 layers, width 1024, 16 heads over 4 key/value
         heads, feed-forward 2816, vocabulary 32000
Each is exported with its KV cache as tools/fixtures/torch_generate.py
exports its fixtures (torch.onnx, dynamo, the exporter's default
optimisation; input_ids, attention_mask, position_ids, past_key_values ->
logits, present), weights in an external data file.

The job: 16 prompts of 64 random token ids, 64 new tokens each, greedy, all
16 rows decoded together (transformers' generate with the batch of 16, and
pipec's plan with --slots 16). Rows, each contender in a fresh process per
round, alternating within the round (torch, pipec 1 stage, pipec 2 stages):
  torch           model.generate(do_sample=False, max_new_tokens=64,
                  min_new_tokens=64) with torch.set_num_threads(THREADS),
                  timed with perf_counter after a warm-up call of one token
  pipec 1 stage   compile --mode generate --max-length 128 --prompt-length 64
                  --stages 1 --slots 16 --microbatches 1; `pipec generate`'s
                  own tokens/s (its loop, after the weights are loaded)
  pipec 2 stages  the same with --stages 2 and the groups compile chooses: the
                  two ranks share this machine's cores, so one group of 16
                  that the stages take in turns, each rank on all the cores
  2 stages, 2 groups
                  --stages 2 --microbatches 2: two groups of 8 in flight,
                  each rank on its own core; each stage streams its weights
                  once per group, twice per token
tokens/s = 16 x 64 / the loop's seconds; the table has medians over the
rounds, and whether pipec's tokens equal torch's (rows whose 64 tokens all
agree; random weights make near-ties, where float sums in another order may
pick the other token). onnxruntime-genai (Llama only: its model builder has no
GPT-2) runs the builder's fp32 CPU export of the same weights (a word-level
tokenizer made offline sits beside them) with batch 16, greedy, min and max
length 128, OMP_NUM_THREADS=THREADS, timed after a warm-up of one token; and
pipec runs that same file (GroupQueryAttention, packed QKV) at 1 stage, so
the two runtimes meet on one model.

Usage: tools/bench-peers.sh --generate [--rounds 3] [--models gpt2,llama]
       [--threads 2] [--workdir build/generate-bench] [--write]
       (needs torch, transformers, onnx, onnxscript, numpy; onnxruntime-genai and
       tokenizers for its column)
--write replaces docs/PERFORMANCE.md's "Generation" section.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "PERFORMANCE.md")
PROMPTS, PROMPT_LEN, NEW, MAX_LEN = 16, 64, 64, 128
# pipec's contenders: 1 stage; 2 stages in the groups compile chooses; 2
# stages in 2 groups of 8.
PIPEC_LAYOUTS = {"p1": ["--stages", "1"], "p2": ["--stages", "2"],
                 "p2g2": ["--stages", "2", "--microbatches", "2"]}


def config(name):
    import transformers
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                       n_positions=1024, resid_pdrop=0, embd_pdrop=0,
                                       attn_pdrop=0), transformers.GPT2LMHeadModel
    return transformers.LlamaConfig(num_hidden_layers=16, hidden_size=1024,
                                    intermediate_size=2816, num_attention_heads=16,
                                    num_key_value_heads=4, vocab_size=32000,
                                    max_position_embeddings=2048), \
        transformers.LlamaForCausalLM


def prepare(name, work, pipec):
    """The model saved, exported and compiled; the prompts."""
    import numpy as np
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))
    from torch_generate import export
    folder = os.path.join(work, name)
    onnx_path = os.path.join(folder, "model.onnx")
    if not os.path.exists(onnx_path):
        os.makedirs(folder, exist_ok=True)
        cfg, cls = config(name)
        torch.manual_seed(0)
        model = cls(cfg).eval()
        model.save_pretrained(os.path.join(folder, "hf"))
        export(name, model, cfg, onnx_path, external_data=True)
        prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (PROMPTS, PROMPT_LEN))
        np.save(os.path.join(folder, "prompts.npy"), prompts.astype(np.int64))
    # Compiled afresh: a plan of an older pipec may not load.
    for tag, flags in PIPEC_LAYOUTS.items():
        subprocess.run([pipec, "compile", onnx_path, "--mode", "generate", "--max-length",
                        str(MAX_LEN), "--prompt-length", str(PROMPT_LEN), "--slots", str(PROMPTS),
                        "--hardware", "cpu", "-o", os.path.join(folder, f"{tag}.plan")] + flags,
                       check=True, stdout=subprocess.DEVNULL)
    return folder


def torch_worker(folder, name, threads, out):
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    _, cls = config(name)
    model = cls.from_pretrained(os.path.join(folder, "hf")).eval()
    ids = torch.from_numpy(np.load(os.path.join(folder, "prompts.npy")))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=1,
                       pad_token_id=0)
        start = time.perf_counter()
        tokens = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
        seconds = time.perf_counter() - start
    np.save(out, tokens[:, PROMPT_LEN:].numpy().astype(np.int64))
    print(json.dumps({"tokens_per_s": PROMPTS * NEW / seconds}))


def run_torch(folder, name, threads):
    out = os.path.join(folder, "torch.npy")
    done = subprocess.run([sys.executable, __file__, "--torch-worker", folder, name,
                           str(threads), out], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"], out


def compile_genai_form(pipec, genai):
    """pipec's plan of the builder's own model (1 stage): the file
    onnxruntime-genai runs, GroupQueryAttention and all."""
    plan = os.path.join(genai, "pipec.plan")
    if not os.path.exists(plan):
        subprocess.run([pipec, "compile", os.path.join(genai, "model.onnx"), "--mode", "generate",
                        "--max-length", str(MAX_LEN), "--prompt-length", str(PROMPT_LEN),
                        "--stages", "1", "--microbatches", "1", "--slots", str(PROMPTS),
                        "--hardware", "cpu", "-o", plan], check=True, stdout=subprocess.DEVNULL)
    return plan


def run_pipec(pipec, folder, tag, plan=None):
    out = os.path.join(folder, f"pipec-{tag}.npy")
    plan = plan or os.path.join(folder, f"{tag}.plan")
    done = subprocess.run([pipec, "generate", plan,
                           "--prompts", os.path.join(folder, "prompts.npy"),
                           "--max-new-tokens", str(NEW), "-o", out],
                          check=True, capture_output=True, text=True)
    found = re.search(r"([0-9.]+) tokens/s", done.stdout)
    if not found:
        raise SystemExit("bench-generate: no tokens/s in: " + done.stdout)
    return float(found.group(1)), out


def prepare_genai(folder, name):
    """The model through onnxruntime-genai's builder (fp32, cpu), with a
    word-level tokenizer made offline (the builder saves one beside the
    model); None where the builder does not take the architecture."""
    if name != "llama":
        return None  # the builder has no GPT-2
    out = os.path.join(folder, "genai")
    if os.path.exists(os.path.join(out, "genai_config.json")):
        return out
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    cfg, _ = config(name)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2", pad_token="t0")
    fast.save_pretrained(os.path.join(folder, "hf"))
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i",
                    os.path.join(folder, "hf"), "-o", out, "-p", "fp32", "-e", "cpu", "-c",
                    os.path.join(folder, "genai-cache")], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def genai_worker(folder, out):
    import numpy as np
    import onnxruntime_genai as og
    model = og.Model(os.path.join(folder, "genai"))
    prompts = np.load(os.path.join(folder, "prompts.npy")).astype(np.int32)

    def run(new):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=PROMPT_LEN + new,
                                  min_length=PROMPT_LEN + new, batch_size=PROMPTS)
        generator = og.Generator(model, params)
        generator.append_tokens(prompts)
        while not generator.is_done():
            generator.generate_next_token()
        return np.stack([np.asarray(generator.get_sequence(i))[PROMPT_LEN:]
                         for i in range(PROMPTS)])

    run(1)
    start = time.perf_counter()
    tokens = run(NEW)
    seconds = time.perf_counter() - start
    np.save(out, tokens.astype(np.int64))
    print(json.dumps({"tokens_per_s": PROMPTS * NEW / seconds}))


def run_genai(folder, threads):
    out = os.path.join(folder, "genai.npy")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, __file__, "--genai-worker", folder, out], check=True,
                          capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"], out


def rows_equal(a, b):
    import numpy as np
    x, y = np.load(a), np.load(b)
    return int((x == y).all(axis=1).sum())


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--genai-worker":
        genai_worker(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipec", default=os.path.join(ROOT, "build", "bin", "pipec"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--workdir", default=os.path.join(ROOT, "build", "generate-bench"))
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    lines = []
    for name in a.models.split(","):
        folder = prepare(name, a.workdir, a.pipec)
        genai = None
        try:
            genai = prepare_genai(folder, name)
        except (ImportError, subprocess.CalledProcessError) as e:
            print(f"{name}: onnxruntime-genai not measured: {e}", file=sys.stderr)
        genai_plan = compile_genai_form(a.pipec, genai) if genai else None
        times = {"torch": [], "p1": [], "p2": [], "p2g2": [], "genai": [], "pipecg": []}
        equal = {}
        for r in range(a.rounds):
            t, tout = run_torch(folder, name, a.threads)
            times["torch"].append(t)
            if genai:
                g, gout = run_genai(folder, a.threads)
                times["genai"].append(g)
                equal["genai"] = rows_equal(tout, gout)
                p, pout = run_pipec(a.pipec, folder, "g", genai_plan)
                times["pipecg"].append(p)
                equal["pipecg"] = rows_equal(tout, pout)
            for tag in PIPEC_LAYOUTS:
                p, pout = run_pipec(a.pipec, folder, tag)
                times[tag].append(p)
                equal[tag] = rows_equal(tout, pout)
            print(f"{name} round {r + 1}: torch {t:.1f}, pipec 1 stage "
                  f"{times['p1'][-1]:.1f}, 2 stages {times['p2'][-1]:.1f}, 2 stages in 2 groups "
                  f"{times['p2g2'][-1]:.1f}"
                  + (f", genai {times['genai'][-1]:.1f}, pipec on genai's model "
                     f"{times['pipecg'][-1]:.1f}" if genai else "") + " tokens/s",
                  file=sys.stderr)
        med = {k: statistics.median(v) for k, v in times.items() if v}
        label = {"gpt2": "GPT-2 124M", "llama": "Llama 246M (GQA 16/4)"}[name]
        peer = (f"{med['genai']:.1f} | {med['p1'] / med['genai']:.2f}x | "
                f"{med['pipecg']:.1f} ({med['pipecg'] / med['genai']:.2f}x)"
                if "genai" in med else
                ("- (no GPT-2 in its builder)" if name == "gpt2" else "- (not measured)")
                + " | - | -")
        lines.append(f"| {label} | {med['torch']:.1f} | {med['p1']:.1f} | "
                     f"{med['p1'] / med['torch']:.2f}x | {peer} | {med['p2']:.1f} | "
                     f"{med['p2'] / med['p1']:.2f}x | {med['p2g2']:.1f} "
                     f"({med['p2g2'] / med['p1']:.2f}x) | "
                     + ", ".join(f"{equal[tag]}/16" for tag in PIPEC_LAYOUTS)
                     + (f"; genai {equal['genai']}/16, pipec on genai's model "
                        f"{equal['pipecg']}/16" if "genai" in equal else "") + " |")
    table = "\n".join(
        ["| model | torch generate, tokens/s | pipec 1 stage | pipec / torch | onnxruntime-genai "
         "| pipec / genai | pipec 1 stage on genai's model (/ genai) | pipec 2 stages "
         "| 2 stages / 1 stage | 2 stages in 2 groups of 8 (/ 1 stage) | rows equal to torch's "
         "(pipec 1 stage, 2 stages, 2 groups; genai; pipec on genai's model) |",
         "|---|---|---|---|---|---|---|---|---|---|---|"] + lines)
    print(table)
    if a.write:
        # Only the generated paragraph and table: the section's other text is written by hand.
        from doc_section import write_section
        write_section(DOC, "generate", f"""`tools/bench-peers.sh --generate --rounds {a.rounds} --write` (tools/bench_generate.py says what
each row measures). {PROMPTS} prompts of {PROMPT_LEN} random tokens, {NEW} new tokens each,
greedy, all rows decoded together; medians of {a.rounds} alternated rounds, each contender in a
fresh process; torch with {a.threads} threads, pipec on the same cores. CPU: {cpu_name()}.

{table}
""")


if __name__ == "__main__":
    main()
