#!/usr/bin/env python3
"""--parallel auto at cluster scale: the (T, P, D) pipec chooses beside the published ones.

Llama-3-shaped 8B, 70B and 405B models (`pipec model llama --light`: the structure without
the weights' bytes; vocabulary 128,256, sequence 8,192) compiled with `--parallel auto` for
8, 64, 1,024 and 8,192 H100 80 GB devices in nodes of 8, AdamW in bf16 with --recompute
auto, --shard-optimizer and --sequence-parallel (as Megatron's recipes train), a global batch
of max(128, N / 4) sequences (Megatron's recipes train 8B and 70B on 128; Llama 3 405B
trained on 2,048 at 8,192 GPUs). Per answer: the layout,
schedule and microbatches chosen, the predicted step and MFU, the largest rank's peak memory,
and the seconds the whole compile took (search and the chosen plan). Where no layout fits the
error says which came closest.

Usage: tools/bench_parallel.py [--pipec build/bin/pipec] [--write] [--only 8b|70b|405b]
  --write  puts the table into docs/PERFORMANCE.md (the "parallel-search" section)
Exits non-zero when an answer takes 10 s or more, when 405B on 8,192 devices does not choose
T = 8, or when its predicted MFU falls outside 35-60%.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory import gb  # noqa: E402
from doc_section import write_section  # noqa: E402

MODELS = {
    # layers, width, heads, key/value heads, feed-forward (Llama 3's Table 3)
    "8b": (32, 4096, 32, 8, 14336),
    "70b": (80, 8192, 64, 8, 28672),
    "405b": (126, 16384, 128, 8, 53248),
}
GPUS = [8, 64, 1024, 8192]
# Published layouts (TP, PP, DP) where one exists for the model and count.
PUBLISHED = {
    ("405b", 8192): "TP 8, PP 16, DP 64 (CP 1), 43% MFU: Llama 3, Table 4",
    ("8b", 8): "TP 1, PP 1 (CP 2): Megatron's H100 recipe",
    ("70b", 64): "TP 4, PP 4 to 8, with VP and CP 2: Megatron's H100 recipe",
}


def make_model(pipec, name, path):
    layers, hidden, heads, kv, ffn = MODELS[name]
    subprocess.run([pipec, "model", "llama", "--layers", str(layers), "--hidden", str(hidden),
                    "--heads", str(heads), "--kv-heads", str(kv), "--ffn", str(ffn),
                    "--vocab", "128256", "--seq", "8192", "--loss", "--light", "-o", path],
                   check=True, capture_output=True)


def search(pipec, model, out, gpus):
    """The plan's JSON and the seconds compile took, or (None, error, seconds)."""
    batch = max(128, gpus // 4)
    cmd = [pipec, "compile", model, "--emit", "json", "-o", out, "--parallel", "auto",
           "--gpus", str(gpus), "--gpus-per-node", "8", "--batch", str(batch),
           "--hardware", "h100", "--precision", "bf16", "--optimizer", "adamw",
           "--recompute", "auto", "--shard-optimizer", "--sequence-parallel"]
    started = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.time() - started
    if run.returncode != 0:
        return None, run.stderr.strip().splitlines()[-1], seconds
    with open(out) as f:
        return json.load(f), batch, seconds


def row(name, gpus, plan, detail, seconds):
    published = PUBLISHED.get((name, gpus), "")
    if plan is None:
        why = re.sub(r"^.*?no layout", "no layout", detail)
        return f"| {name.upper()} | {gpus} | - | {why} | | | | {seconds:.1f} s | {published} |", None
    s = plan["schedule"]
    chosen = plan["parallel_search"][0]
    mfu = float(re.search(r"predicted MFU ([0-9.]+)%", chosen).group(1))
    peak = max(int(r["peak_memory_bytes"]) for r in plan["ranks"])
    layout = (f"T={s.get('tensor_parallel', 1)} P={s['stages']} D={s.get('data_parallel', 1)}")
    micro = (f"{s['name']} V={s.get('virtual_stages', 1)}, M={s['microbatches']} of "
             f"{s.get('microbatch_size', 1)} (batch {detail})")
    step = float(plan["predicted"]["step_time_s"])
    text = (f"| {name.upper()} | {gpus} | {layout} | {micro} | {step:.2f} s | {mfu:.1f}% | "
            f"{gb(peak)} GB | {seconds:.1f} s | {published} |")
    return text, (s.get("tensor_parallel", 1), mfu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipec", default="build/bin/pipec")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--only", choices=sorted(MODELS))
    args = parser.parse_args()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            if args.only and name != args.only:
                continue
            model = os.path.join(tmp, f"llama{name}.onnx")
            make_model(args.pipec, name, model)
            for gpus in GPUS:
                plan, detail, seconds = search(args.pipec, model, os.path.join(tmp, "p.json"),
                                               gpus)
                text, chosen = row(name, gpus, plan, detail, seconds)
                print(text, flush=True)
                rows.append(text)
                if seconds >= 10:
                    print(f"bench_parallel: {name} on {gpus}: {seconds:.1f} s", file=sys.stderr)
                    ok = False
                if name == "405b" and gpus == 8192:
                    if chosen is None or chosen[0] != 8 or not 35 <= chosen[1] <= 60:
                        print(f"bench_parallel: 405B on 8192 chose {chosen}", file=sys.stderr)
                        ok = False
    table = [
        "| model | devices | chosen | schedule and microbatches | predicted step | predicted MFU | "
        "peak per rank (largest) | compile | published |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(table)
    print(text)
    if args.write and not args.only:
        here = os.path.dirname(os.path.abspath(__file__))
        write_section(os.path.join(here, "..", "docs", "PERFORMANCE.md"), "parallel-search", text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
