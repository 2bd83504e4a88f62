#!/usr/bin/env python3
"""Turns Google Benchmark JSON from bench_runtime into the runtime table in PERFORMANCE.md."""
import json
import platform
import sys

results, doc = sys.argv[1], sys.argv[2]
data = json.load(open(results))
ctx = data["context"]
rows = {b["name"].split("/manual_time")[0]: b for b in data["benchmarks"]}


def ms(x):
    return f"{x * 1e3:.2f}"


lines = ["| run | measured step (ms) | predicted step (ms) | measured / predicted |",
         "|---|---:|---:|---:|"]
ranks = ["| run | rank | measured compute (ms) | predicted compute (ms) | measured / predicted |",
         "|---|---:|---:|---:|---:|"]
for name, b in rows.items():
    if "predicted_step_s" not in b:
        continue  # the fusion rows have notes of their own
    step = b["real_time"] / 1e3  # ms -> s
    pred = b["predicted_step_s"]
    ratio = f"{step / pred:.2f}" if pred > 0 else "-"
    lines.append(f"| {name} | {ms(step)} | {ms(pred)} | {ratio} |")
    r = 0
    while f"rank{r}_busy_s" in b:
        busy, pbusy = b[f"rank{r}_busy_s"], b[f"rank{r}_predicted_busy_s"]
        ratio = f"{busy / pbusy:.2f}" if pbusy > 0 else "-"
        ranks.append(f"| {name} | {r} | {ms(busy)} | {ms(pbusy)} | {ratio} |")
        r += 1
notes = []


def scaling(one_rank, two_ranks, what):
    """A note on 2 ranks against 1, when both rows ran."""
    one, two = rows.get(one_rank), rows.get(two_ranks)
    if not (one and two):
        return
    speedup = one['real_time'] / two['real_time']
    notes.append(f"- {what}: 2 ranks (1F1B) against 1 rank at M = 8 are {speedup:.2f}x "
                 f"{'faster' if speedup >= 1 else 'the speed (slower)'} "
                 f"({one['real_time']:.0f} ms against {two['real_time']:.0f} ms per step); "
                 f"the bubble (1/9 at P = 2, M = 8) allows 1.8x.")


def row_note(name, text):
    """Adds the note text(row) when the row `name` ran."""
    row = rows.get(name)
    if row:
        notes.append(text(row))


def overhead_note(name, b):
    """The note on row `name`'s time in instructions outside node kernels and waits. Instructions
    and their overhead are summed over the ranks: per rank, against the step's wall time."""
    nranks = sum(1 for key in b if key.endswith("_busy_s") and "predicted" not in key)
    share = (b['overhead_per_instruction_s'] * b['instructions'] / max(1, nranks)
             / (b['real_time'] / 1e3) * 100)
    return (f"- {name}: {b['overhead_per_instruction_s'] * 1e3:.2f} ms per instruction "
            f"inside instructions but outside node kernels and waits (gradient "
            f"accumulation, the optimizer update and loading data happen there), "
            f"{share:.0f}% of each rank's step.")


cpus = int(ctx.get('num_cpus', 2))
scaling("gpt6/1_rank_m8", "gpt6/2_ranks_1f1b_m8",
        f"By default each rank computes on the cores divided by the ranks (1 rank: {cpus} "
        f"threads; 2 ranks: {max(1, cpus // 2)} each, {cpus} CPUs)")
scaling("gpt6/1_rank_m8_1_thread", "gpt6/2_ranks_1f1b_m8_1_thread_each",
        "With `--threads-per-rank 1` (each rank on one thread, pinned to a core of its own)")
row_note("mlp16_tiny/4_ranks_1f1b_m64", lambda mlp: (
    f"- Executor overhead per instruction (the tiny MLP, where kernels do next to "
    f"nothing): {mlp['overhead_per_instruction_s'] * 1e6:.1f} us of time inside "
    f"instructions but outside node kernels and message waits; "
    f"{mlp['instructions']:.0f} instructions and {mlp['nodes']:.0f} nodes per step "
    f"over 4 ranks, {mlp['real_time']:.2f} ms per step."))
for name in ("gpt6/1_rank_m8", "gpt6/2_ranks_1f1b_m8"):
    row_note(name, lambda b: overhead_note(name, b))
row_note("gpt6/1_rank_m8_fused_vs_unfused", lambda fz: (
    f"- Fused element-wise kernels and MatMul bias adds (the default; `pipec compile "
    f"--no-fuse` turns them off), one rank, the two runs alternating: "
    f"{fz['fused_step_s'] * 1e3:.0f} ms fused against {fz['unfused_step_s'] * 1e3:.0f} ms "
    f"unfused per step ({fz['unfused_step_s'] / fz['fused_step_s']:.2f}x), "
    f"{fz['fused_nodes']:.0f} against {fz['unfused_nodes']:.0f} nodes run per step."))
row_note("gelu_2048x1024/fused_vs_unfused", lambda gelu: (
    f"- GPT-2's GELU (eight nodes, tanh form, on a 2048 x 1024 activation plus a bias, "
    f"keeping the tanh and x / 2 for backward as training does), the two forms "
    f"alternating: {gelu['fused_s'] * 1e3:.2f} ms as one fused kernel against "
    f"{gelu['unfused_s'] * 1e3:.2f} ms as eight kernels, "
    f"{gelu['unfused_s'] / gelu['fused_s']:.2f}x."))
row_note("mlp2000x8/dispatch_1_rank_1_thread", lambda dispatch: (
    f"- The executor's cost per node (`pipec model mlp --layers 2000 --hidden 8`, "
    f"{dispatch['nodes']:.0f} nodes of 8-wide Gemm and Relu, inference, one thread, "
    f"unfused): {dispatch['real_time']:.2f} ms per step, "
    f"{dispatch['ns_per_node']:.0f} ns per node, dispatch included."))
decode = [(name, b) for name, b in rows.items()
          if name.startswith("decode_gemm") and "few_row_gflops" in b]
if decode:
    def shape(name):
        f = dict(part.split(":") for part in name.split("/")[1:])
        how = "B^T" if f["transposed"] == "1" else "B"
        rows = "1 row" if f["m"] == "1" else f"{f['m']} rows"
        return f"{rows} x {how} ({f['n']} x {f['k']})"

    def target(b):
        return f" on {b['label']}" if b.get("label") else ""
    notes.append("- A decode step's products, a few rows by a weight (B^T: read transposed, a "
                 "Linear as torch stores it; B: as the exporter folds it), weights streamed "
                 "from memory, one thread, the two alternating, in GFLOP/s: gemm's loops over "
                 "the weight as stored (runtime/cpu/FewRowGemm.h; each target this CPU runs) "
                 "against the BLAS on the same operands. " + "; ".join(
                     f"{shape(name)}{target(b)}: {b['few_row_gflops']:.1f} against "
                     f"{b['blas_gflops']:.1f} "
                     f"({b['few_row_gflops'] / b['blas_gflops']:.2f}x)" for name, b in decode)
                 + ".")
notes.append("- The predicted steps use the default `cpu` spec, which is calibrated on pipec's "
             "own kernels for the threads each rank gets by default (docs/HARDWARE.md, "
             "\"CPU calibration\"), afresh before each row, so that the prediction sees the machine its steps run on: the measured / predicted column is the cost model's error on "
             "whole steps. The `_1_thread` rows run the default plans with "
             "`--threads-per-rank 1`, so one rank computes on half the threads it was "
             "predicted for. The `_profiled_costs` rows predict from `pipec profile`'s "
             "measured per-layer table (microbatch of 1, one layer per rank) instead, which is "
             "what `compile --costs` is for.")
machine = (f"{ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz, "
           f"{platform.system()} {platform.release()}, date {ctx.get('date')}")
section = "\n".join(
    ["<!-- BEGIN runtime -->",
     "Command: `tools/bench-runtime.sh` (runs `build/bin/bench_runtime --benchmark_min_time=2`).",
     f"Machine: {machine}. Models: a GPT of 6 blocks, hidden 256, 8 heads, vocabulary 2,000, "
     "sequence 64, trained with SGD, global batch 8; and an MLP of 16 layers of width 8 "
     "(`mlp16_tiny`), whose kernels do next to nothing.", ""]
    + lines + [""] + ranks + [""] + notes + ["<!-- END runtime -->"])
text = open(doc).read()
if "<!-- BEGIN runtime -->" in text:
    begin, end = text.index("<!-- BEGIN runtime -->"), text.index("<!-- END runtime -->")
    text = text[:begin] + section + text[end + len("<!-- END runtime -->"):]
else:
    text = text.rstrip() + "\n\n## Runtime (CPU executor)\n\n" + section + "\n"
open(doc, "w").write(text)
print(section)
