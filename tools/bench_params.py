#!/usr/bin/env python3
"""Weights in and out at real size: a 124M GPT-2 checkpoint through pipec and through transformers.

Makes GPT-2 small (124M parameters, weights nudged so that all are distinct, as trained ones
are), saves it with save_pretrained in shards of 200 MB, and exports it with its loss (dynamo,
default optimisation, weights as external data). Then times, alternating the two sides in one
run (--rounds times each, the median kept):
  map     pipec compile --params DIR  less  pipec compile alone (matching every initializer to
          the checkpoint by value)
  load    pipec run --init DIR --steps 1 --lr 0  less  the same run without --init; beside
          transformers' from_pretrained(DIR)
  save    pipec run ... --save-weights OUT.safetensors  less  the run without it; beside
          transformers' save_pretrained
and the peak memory (max RSS) of compile with and without --params. Prints a table and, with
--write, puts it into docs/PERFORMANCE.md between the BEGIN/END params markers.

Needs torch and transformers (a venv as tools/fixtures/_torch_fixture_common.py describes):
  venv-torch/bin/python tools/bench_params.py --pipec build/bin/pipec [--rounds 3] [--write]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))


def make_model(work):
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(use_cache=False, resid_pdrop=0, embd_pdrop=0,
                                       attn_pdrop=0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    model.save_pretrained(os.path.join(work, "ckpt"), max_shard_size="200MB")

    sys.path.insert(0, os.path.join(HERE, "fixtures"))
    from torch_user_exports import wrappers  # the loss wrapper users write
    Loss, _ = wrappers()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))  # a short step: the weights dominate
    os.makedirs(os.path.join(work, "data"), exist_ok=True)
    np.save(os.path.join(work, "data", "input_ids.npy"), ids.numpy())
    np.save(os.path.join(work, "data", "labels.npy"), ids.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Loss(model), (ids, ids), os.path.join(work, "gpt2.onnx"), dynamo=True,
                          input_names=["input_ids", "labels"], external_data=True)
    return sum(p.numel() for p in model.parameters())


def timed(cmd):
    """Seconds and peak RSS (KB) of \\p cmd, which must succeed."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M"] + cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit("bench_params: %s: %s" % (" ".join(cmd), proc.stderr.strip()))
    return seconds, int(proc.stderr.strip().splitlines()[-1])


def torch_side(work, what):
    """Seconds for transformers to load (from_pretrained) or save (save_pretrained)."""
    code = (
        "import time, warnings; warnings.filterwarnings('ignore')\n"
        "from transformers import GPT2LMHeadModel\n"
        "m = GPT2LMHeadModel.from_pretrained(%r)\n" % os.path.join(work, "ckpt"))
    if what == "load":
        code = code.replace("m = ", "t = time.perf_counter(); m = ") + \
            "print(time.perf_counter() - t)\n"
    else:
        code += ("t = time.perf_counter(); m.save_pretrained(%r)\n"
                 "print(time.perf_counter() - t)\n" % os.path.join(work, "torch-saved"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipec", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    pipec = os.path.abspath(args.pipec)
    work = tempfile.mkdtemp(prefix="pipec-bench-params-")
    params = make_model(work)
    w = lambda name: os.path.join(work, name)  # noqa: E731
    compile_base = [pipec, "compile", w("gpt2.onnx"), "--stages", "2", "--hardware", "cpu",
                    "-o", w("plain.plan")]
    compile_params = compile_base[:-1] + [w("mapped.plan"), "--params", w("ckpt")]
    run_base = [pipec, "run", w("mapped.plan"), "--data", w("data"), "--steps", "1", "--lr", "0",
                "--optimizer", "sgd", "--quiet"]
    runs = {
        "compile": lambda: timed(compile_base),
        "compile --params": lambda: timed(compile_params),
        "run": lambda: timed(run_base),
        "run --init": lambda: timed(run_base + ["--init", w("ckpt")]),
        "run --save-weights": lambda: timed(run_base + ["--save-weights", w("out.safetensors")]),
        "from_pretrained": lambda: (torch_side(work, "load"), 0),
        "save_pretrained": lambda: (torch_side(work, "save"), 0),
    }
    seconds = {k: [] for k in runs}
    peak = {}
    for _ in range(args.rounds):
        for name, fn in runs.items():  # alternated: every side once per round
            s, rss = fn()
            seconds[name].append(s)
            peak[name] = max(peak.get(name, 0), rss)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    rows = [
        ("map the checkpoint (compile --params less compile)",
         med["compile --params"] - med["compile"], None),
        ("load it (run --init less run)", med["run --init"] - med["run"],
         med["from_pretrained"]),
        ("save it (run --save-weights .safetensors less run)",
         med["run --save-weights"] - med["run"], med["save_pretrained"]),
    ]
    lines = ["GPT-2 small, %.1fM parameters, save_pretrained shards of 200 MB, one step of 16 tokens; median of %d "
             "rounds, alternated; `python3 tools/bench_params.py --pipec build/bin/pipec "
             "--write` (torch %s)." % (params / 1e6, args.rounds, __import__("torch").__version__),
             "",
             "| step | pipec (s) | transformers (s) | pipec / transformers |",
             "|---|---|---|---|"]
    for name, ours, theirs in rows:
        lines.append("| %s | %.2f | %s | %s |" % (
            name, ours, "%.2f" % theirs if theirs else "-",
            "%.2fx" % (ours / theirs) if theirs else "-"))
    lines += ["",
              "Peak memory of compile: %.2f GB alone, %.2f GB with --params (the weights and "
              "the checkpoint are held together while they are matched)."
              % (peak["compile"] / 2**20, peak["compile --params"] / 2**20)]
    table = "\n".join(lines)
    print(table)
    if args.write:
        sys.path.insert(0, HERE)
        from doc_section import write_section
        write_section(os.path.join(HERE, "..", "docs", "PERFORMANCE.md"), "params", table)


if __name__ == "__main__":
    main()
