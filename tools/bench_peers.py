#!/usr/bin/env python3
"""pipec's CPU speed against PyTorch and onnxruntime on the benchmark GPT.

The model is transformers' GPT2LMHeadModel from GPT2Config(n_layer=6, n_embd=256, n_head=8,
vocab_size=2000, n_positions=64), untied LM head, random seeded weights (each nudged by
1e-3 x randn, as in the torch fixtures, so that no two are equal), every dropout 0: sequence
64, global batch 8, fp32, SGD with lr 0.01. torch builds it once and saves its weights;
every contender starts from those weights and the same batch (token ids, labels = the ids: the
model shifts them itself). It is exported three times with torch.onnx.export's dynamo exporter,
as tools/fixtures/torch_reference.py exports a model with its loss (optimize=False, then
onnxscript's optimizer told not to fold any node that reads a parameter, so that every torch
parameter stays an initializer that pipec trains): with its loss at batch 8 and at batch 1 (a
microbatch of the M=8 plans), and without it (logits, eval mode, default optimizer) at batch 8
for inference, as tools/fixtures/torch_exports.py does. onnxruntime checks each export against
torch before anything is timed.

--size gpt2-124m and --size llama-246m run the same rows at real size (bench_peers_models.py
gives the shapes): GPT-2 small as published (124M, tied head) and a Llama of 246M (16 layers,
width 1024, GQA 16/4, feed-forward 2816, vocabulary 32,000), sequence 128, global batch 8, M = 4
in the microbatched rows (microbatches of 2), the pipelining cut after layer 6 of 12 or 8 of 16.
There torch.distributed.pipelining's last stage holds its own copy of GPT-2's tied head (the
stages are separate modules). Every row also reports each contender's peak resident set size,
the median over the rounds: each process's VmHWM (pipec's as its last step ends, the peers'
after their last step; the sum of both processes for the pipelining row). The tables go between the peers-SIZE markers.

Rows, each contender alternating with its peer within one run (pipec, peer, pipec, peer, ...):

  train-m1   pipec, 1 rank, 1 microbatch of 8        torch eager: forward, backward, SGD step
  train-m8   pipec, 1 rank, 8 microbatches of 1      torch, gradient accumulation over 8 of 1
  train-p2   pipec, 2 ranks, 1F1B, 8 microbatches    torch.distributed.pipelining, Schedule1F1B,
                                                     gloo, 2 processes, cut after block 3 of 6
                                                     (pipec's plan is cut by its balancer)
  infer      pipec --mode infer, 1 stage, batch 8    onnxruntime InferenceSession on the same
                                                     inference ONNX file

Each contender runs STEPS + 1 steps in a fresh process per round and its first step is dropped
(warm-up: page faults, allocator, lazy initialisation). pipec's step times are the intervals
between the progress lines `pipec run` prints after each step, time-stamped as they arrive; the
peers time each step with perf_counter (the pipelining step ends at a barrier of both ranks).
Each row reports the median and the quartiles of the R x STEPS step times per contender, pipec
/ peer (the ratio of medians), and GFLOP/s = FLOPs per step / median step time, where the FLOPs
per step are counted once from the model's shape, not measured:

  forward  = 2 x tokens x (weights of the matrix products: 12 d^2 per block, d V for the head)
             + 4 x tokens x seq x d x blocks (attention scores and their product with V; the
               causal half not subtracted)
  training = 3 x forward (backward: twice the forward), tokens = 8 x 64 per step

The header also prints `pipec inspect`'s forward FLOPs of the inference export, for comparison.

Threads: torch eager and onnxruntime run with --threads (default: the machine's cores); each
torch pipelining process with --threads-per-rank if given, else --threads / 2. pipec runs with
its own default (its ranks share the cores); --threads-per-rank N is passed to every `pipec run`
when the binary accepts it (`pipec run --help`). The losses of steps 1 and 2 of each training
row are printed for pipec and torch: they agree when both train the same model on the same batch
with the same SGD step.

Needs torch, transformers, onnx, onnxruntime, onnxscript, numpy: tools/bench-peers.sh makes a
virtual environment with the pinned versions and runs this script in it.

Usage:
  bench_peers.py [--pipec build/bin/pipec] [--size small|gpt2-124m|llama-246m]
                 [--rounds 5] [--steps 10] [--threads N]
                 [--threads-per-rank N] [--rows train-m1,train-m8,train-p2,infer]
                 [--workdir build/peers-bench] [--quick] [--write]

  --quick  1 round of 2 steps per row (a smoke test; refuses --write)
  --write  replace the table between <!-- BEGIN peers --> and <!-- END peers --> in
           docs/PERFORMANCE.md (the section is added after the runtime section if missing)
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.dont_write_bytecode = True

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FIXTURES = os.path.join(ROOT, "tools", "fixtures")
DOC = os.path.join(ROOT, "docs", "PERFORMANCE.md")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peers_models as M  # noqa: E402

# The model's shape: --size picks one of bench_peers_models.SIZES (use_size sets these). The
# benchmark GPT, "small", is the shape tools/bench/ and docs/PERFORMANCE.md's runtime section use.
SIZE, LAYERS, WIDTH, HEADS, VOCAB, SEQ, BATCH, MICRO = "small", 6, 256, 8, 2000, 64, 8, 8
LR = 0.01
SEED = 0
TIMEOUT_S = 1800  # one contender's run of one round

# Row names are those of the benchmark GPT; "train-m8" runs M = MICRO microbatches (4 at the
# real sizes), as its label says.
ROWS = {
    "train-m1": "train, 1 rank, 1 microbatch, vs torch ({threads} threads)",
    "train-m8": "train, 1 rank, {micro} microbatches, vs torch gradient accumulation",
    "train-p2": "train, 2 ranks 1F1B M={micro}, vs torch.distributed.pipelining (gloo, 2 "
                "processes)",
    "infer": "inference, batch {batch}, vs onnxruntime ({threads} threads)",
}


def use_size(size):
    """Sets the module's shape constants to bench_peers_models.SIZES[size]."""
    global SIZE, LAYERS, WIDTH, HEADS, VOCAB, SEQ, BATCH, MICRO
    s = M.SIZES[size]
    SIZE = size
    LAYERS, WIDTH, HEADS, VOCAB = s["layers"], s["width"], s["heads"], s["vocab"]
    SEQ, BATCH, MICRO = s["seq"], s["batch"], s["micro"]


class BenchError(Exception):
    """A failure with a one-line explanation: printed as `bench_peers: error: ...`, exit 1."""


def fail(msg):
    raise BenchError(msg)


# --------------------------------------------------------------------------------------------
# The model, its FLOPs, its exports


def build_gpt():
    """The model of this run's size (bench_peers_models.build), seeded, train() mode."""
    try:
        return M.build(SIZE, SEED)
    except ValueError as e:
        fail(str(e))


def load_gpt(workdir):
    """The benchmark GPT holding the weights prepare() saved."""
    import torch
    model = build_gpt()
    model.load_state_dict(torch.load(os.path.join(workdir, "weights.pt"), weights_only=True))
    model.train()
    return model


def load_batch(workdir):
    import numpy as np
    import torch
    ids = torch.from_numpy(np.load(os.path.join(workdir, "train", "input_ids.npy")))
    labels = torch.from_numpy(np.load(os.path.join(workdir, "train", "labels.npy")))
    return ids, labels


def model_flops():
    """(training, inference) FLOPs of one step of the global batch, counted from the shape."""
    return M.flops(SIZE)


@contextlib.contextmanager
def output_to(path):
    """Sends this process's file descriptors 1 and 2 to path: the exporter's progress lines,
    warnings and what the libraries print from C++."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def prepare(workdir, pipec, log):
    """Saves the weights and the batch, exports the three ONNX files, checks them with
    onnxruntime against torch, and compiles the four plans. Returns pipec inspect's forward
    FLOPs of the inference export (None when inspect gives none)."""
    import numpy as np
    import onnxruntime as ort
    import torch
    sys.path.insert(0, FIXTURES)
    import _torch_fixture_common as C
    import torch_reference as R

    os.makedirs(workdir, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_gpt()
    torch.save(model.state_dict(), os.path.join(workdir, "weights.pt"))
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)
    labels = ids.clone()
    C.save_arrays(os.path.join(workdir, "train"), {"input_ids": ids.numpy(),
                                                   "labels": labels.numpy()})
    C.save_arrays(os.path.join(workdir, "infer"), {"input_ids": ids.numpy()})

    class WithLoss(C.hf_output_module("loss")):
        """The GPT returning its loss (transformers' shifted token-mean cross entropy)."""

    class LogitsOnly(C.hf_output_module("logits")):
        """The GPT returning its logits."""

    def session(path):
        so = ort.SessionOptions()
        so.intra_op_num_threads = os.cpu_count() or 1
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    micro = BATCH // MICRO
    with torch.no_grad():
        ref_loss = {BATCH: float(model(input_ids=ids, labels=labels).loss),
                    micro: float(model(input_ids=ids[:micro], labels=labels[:micro]).loss)}
    for batch in (BATCH, micro):
        path = os.path.join(workdir, "train_b%d.onnx" % batch)
        args = (ids[:batch], labels[:batch])
        t = time.time()
        R.export_dynamo(WithLoss(model, ["input_ids", "labels"]), args,
                        ["input_ids", "labels"], path, "keep_params")
        names = C.graph_input_names(path)
        if names != ["input_ids", "labels"]:
            fail("%s: graph inputs %s, expected input_ids and labels" % (path, names))
        params, _ = R.map_params(WithLoss(model, ["input_ids", "labels"]), path)
        lost = sorted(n for n, m in params.items() if m is None)
        if lost:
            fail("%s: %d torch parameter(s) are no initializer of their own (%s): pipec would "
                 "not train the model torch trains" % (path, len(lost), ", ".join(lost[:3])))
        loss = float(session(path).run(None, {"input_ids": args[0].numpy(),
                                               "labels": args[1].numpy()})[0])
        diff = abs(loss - ref_loss[batch])
        log("exported train_b%d.onnx (%.1f s): onnxruntime loss %.6f, torch %.6f, |diff| %.1e"
            % (batch, time.time() - t, loss, ref_loss[batch], diff))
        if diff > 1e-4 * abs(ref_loss[batch]):
            fail("train_b%d.onnx: onnxruntime's loss differs from torch's by %.3g"
                 % (batch, diff))

    path = os.path.join(workdir, "infer.onnx")
    lm = LogitsOnly(model, ["input_ids"])
    lm.eval()
    t = time.time()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(lm, (ids,), dynamo=True, input_names=["input_ids"],
                                 output_names=["logits"], external_data=False)
    prog.save(path, external_data=False)
    C.clean_metadata(path)
    with torch.no_grad():
        ref = lm(ids).numpy()
    got = session(path).run(None, {"input_ids": ids.numpy()})[0]
    diff = float(np.max(np.abs(got - ref)))
    log("exported infer.onnx (%.1f s): max |onnxruntime - torch| %.1e over the logits"
        % (time.time() - t, diff))
    if diff > 1e-3:
        fail("infer.onnx: onnxruntime's logits differ from torch's by %.3g" % diff)

    common = ["--hardware", "cpu", "--batch", str(BATCH)]
    plans = {
        "train-m1": ["train_b%d.onnx" % BATCH, "--mode", "train", "--stages", "1",
                     "--microbatches", "1", "--optimizer", "sgd"],
        "train-m8": ["train_b%d.onnx" % micro, "--mode", "train", "--stages", "1",
                     "--microbatches", str(MICRO), "--schedule", "1f1b", "--optimizer", "sgd"],
        "train-p2": ["train_b%d.onnx" % micro, "--mode", "train", "--stages", "2",
                     "--microbatches", str(MICRO), "--schedule", "1f1b", "--optimizer", "sgd"],
        "infer": ["infer.onnx", "--mode", "infer", "--stages", "1", "--microbatches", "1"],
    }
    for row, flags in plans.items():
        cmd = [pipec, "compile", os.path.join(workdir, flags[0]), "-o",
               os.path.join(workdir, row + ".plan")] + flags[1:] + common
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            fail("%s failed (exit %d): %s" % (" ".join(cmd[1:3]), r.returncode,
                                              tail(r.stderr or r.stdout)))
    log("compiled %s" % ", ".join(row + ".plan" for row in plans))

    r = subprocess.run([pipec, "inspect", os.path.join(workdir, "infer.onnx"), "--format",
                        "json", "--batch", str(BATCH), "--seq", str(SEQ)],
                       capture_output=True, text=True)
    try:
        return float(json.loads(r.stdout)["model"]["flops_fwd"])
    except (ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------------------------
# The peers: each runs in a process of its own (this script with --worker KIND)


def set_threads(n):
    import torch
    torch.set_num_threads(n)


def peak_rss_mb():
    """This process's peak resident set size (VmHWM), in MB. Not ru_maxrss: Linux carries
    that over exec, so a worker would report the parent's size before it forked."""
    return vm_hwm_mb(os.getpid())


def timed_steps(steps, body):
    """Runs body() steps + 1 times; returns the step times in seconds, the first dropped."""
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        body()
        times.append(time.perf_counter() - t)
    return times[1:]


def worker_torch_train(a):
    """torch eager: forward, backward and an SGD step on the batch of 8, in a.microbatches
    microbatches (gradient accumulation: each microbatch's loss / M, one step)."""
    import torch
    set_threads(a.threads)
    model = load_gpt(a.workdir)
    ids, labels = load_batch(a.workdir)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    m = a.microbatches

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(ids.chunk(m), labels.chunk(m)):
            loss = model(input_ids=x, labels=y).loss / m
            loss.backward()
            total += float(loss)
        opt.step()
        losses.append(total)

    times = timed_steps(a.steps, step)
    return {"times": times, "losses": losses, "rss_mb": peak_rss_mb()}


def worker_ort(a):
    """onnxruntime: the inference export on the batch of 8."""
    import numpy as np
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(os.path.join(a.workdir, "infer.onnx"), so,
                                providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.load(os.path.join(a.workdir, "infer", "input_ids.npy"))}
    times = timed_steps(a.steps, lambda: sess.run(None, feeds))
    return {"times": times, "rss_mb": peak_rss_mb()}


def pipeline_stages(model):
    """The model cut after layer LAYERS / 2 into two torch modules (bench_peers_models)."""
    return M.pipeline_stages(model, SIZE)


def causal_lm_loss(logits, labels):
    """transformers' causal LM loss: the labels shifted left, -100 padding the end, token
    mean."""
    import torch.nn.functional as F
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                           ignore_index=-100)


def worker_torch_pipe(a):
    """torch.distributed.pipelining, one process per stage (gloo), Schedule1F1B over
    a.microbatches microbatches; gradients scaled by 1/M (scale_grads), then an SGD step. The
    step ends at a barrier of both ranks; the last rank reports."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    set_threads(a.threads)
    dist.init_process_group("gloo", rank=a.rank, world_size=2)
    try:
        model = load_gpt(a.workdir)
        ids, labels = load_batch(a.workdir)
        first, last = pipeline_stages(model)
        if a.rank == 1:
            with torch.no_grad():  # the two halves compute the whole model
                whole = model(input_ids=ids[:1], labels=labels[:1])
                logits = last(first(ids[:1]))
                diff = float((logits - whole.logits).abs().max())
                ldiff = abs(float(causal_lm_loss(logits, labels[:1])) - float(whole.loss))
            if diff > 1e-4 or ldiff > 1e-5:
                fail("the two pipeline stages differ from the whole model: max |logits| %.3g, "
                     "|loss| %.3g" % (diff, ldiff))
        module = first if a.rank == 0 else last
        stage = PipelineStage(module, a.rank, 2, torch.device("cpu"))
        sched = Schedule1F1B(stage, n_microbatches=a.microbatches, loss_fn=causal_lm_loss)
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        losses = []

        def step():
            opt.zero_grad(set_to_none=True)
            if a.rank == 0:
                sched.step(ids)
            else:
                mb = []
                sched.step(target=labels, losses=mb)
                losses.append(float(sum(float(x) for x in mb) / len(mb)))
            opt.step()
            dist.barrier()

        dist.barrier()
        times = timed_steps(a.steps, step)
        if a.rank == 1:
            return {"times": times, "losses": losses, "rss_mb": peak_rss_mb()}
        return {"rss_mb": peak_rss_mb()}
    finally:
        dist.destroy_process_group()


WORKERS = {"torch-train": worker_torch_train, "torch-pipe": worker_torch_pipe,
           "ort": worker_ort}


def worker_main(a):
    try:
        out = WORKERS[a.worker](a)
    except BenchError as e:
        print("bench_peers: error: %s" % e, file=sys.stderr)
        return 1
    if out is not None:
        print("RESULT " + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# Running the contenders


def tail(text, lines=6):
    return " | ".join(text.strip().splitlines()[-lines:])


def worker_env(threads):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


def start_worker(a, kind, threads, microbatches=1, extra=(), env_extra=None):
    """This script as a peer's worker process; its output goes to temporary files (a full pipe
    never blocks it)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--workdir", a.workdir,
           "--size", a.size, "--steps", str(a.steps), "--threads", str(threads), "--microbatches",
           str(microbatches)] + list(extra)
    env = worker_env(threads)
    env.update(env_extra or {})
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
    return proc, out, err


def collect(workers, what):
    """Waits for the workers (those of one measurement); returns the RESULT the last one
    printed, its rss_mb the sum of every worker's peak (the processes of one run). The first to
    fail stops the others: a pipelining rank whose peer died would otherwise wait for it."""
    deadline = time.time() + TIMEOUT_S
    try:
        while True:
            codes = [p.poll() for p, _, _ in workers]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                proc, out, err = workers[bad[0]]
                err.seek(0)
                out.seek(0)
                fail("%s failed (exit %d): %s" % (what, proc.returncode,
                                                  tail(err.read() or out.read())))
            if all(c == 0 for c in codes):
                break
            if time.time() > deadline:
                fail("%s: no result within %d s" % (what, TIMEOUT_S))
            time.sleep(0.05)
        results = []
        for proc, out, err in workers:
            out.seek(0)
            results += [json.loads(line[len("RESULT "):]) for line in out.read().splitlines()
                        if line.startswith("RESULT ")]
        if not results or "times" not in results[-1]:
            proc, out, err = workers[-1]
            err.seek(0)
            fail("%s printed no result: %s" % (what, tail(err.read())))
        result = results[-1]
        result["rss_mb"] = sum(r.get("rss_mb", 0.0) for r in results)
        return result
    finally:
        for proc, out, err in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peer(a, row):
    if row == "train-m1":
        return collect([start_worker(a, "torch-train", a.threads, 1)], "torch (train, batch 8)")
    if row == "train-m8":
        return collect([start_worker(a, "torch-train", a.threads, MICRO)],
                       "torch (gradient accumulation)")
    if row == "train-p2":
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        return collect([start_worker(a, "torch-pipe", a.rank_threads, MICRO,
                                     ["--rank", str(r)], env) for r in (0, 1)],
                       "torch.distributed.pipelining")
    return collect([start_worker(a, "ort", a.threads)], "onnxruntime")


STEP_LINE = re.compile(r"^step (\d+)/(\d+)(?:\s+loss (\S+))?")
PREDICTED_LINE = re.compile(r"per step, predicted ([0-9.]+) (s|ms|us)$")
UNIT_MS = {"s": 1e3, "ms": 1.0, "us": 1e-3}


def vm_hwm_mb(pid):
    """The peak resident set size (VmHWM) of live process pid, in MB; 0 once it is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def run_pipec(a, row):
    """Times `pipec run` of the row's plan: the intervals between its per-step progress
    lines, time-stamped as they arrive (rank 0 prints and flushes one after each step), the
    first step dropped."""
    cmd = [a.pipec, "run", os.path.join(a.workdir, row + ".plan"), "--steps",
           str(a.steps + 1), "--data",
           os.path.join(a.workdir, "infer" if row == "infer" else "train")]
    if row != "infer":
        cmd += ["--optimizer", "sgd", "--lr", str(LR)]
    cmd += a.pipec_run_flags
    stamps, losses, lines, rss = [], [], [], 0.0
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, bufsize=1, text=True)
        watchdog = threading.Timer(TIMEOUT_S, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                now = time.perf_counter()
                lines.append(line)
                m = STEP_LINE.match(line)
                if m:
                    stamps.append(now)
                    rss = max(rss, vm_hwm_mb(proc.pid))
                    if m.group(3):
                        losses.append(float(m.group(3)))
            proc.wait()
        finally:
            watchdog.cancel()
        err.seek(0)
        if proc.returncode != 0:
            fail("pipec run %s failed (exit %d%s): %s"
                 % (row, proc.returncode, ", killed after %d s" % TIMEOUT_S
                    if proc.returncode == -9 else "", tail(err.read() or "".join(lines))))
    if len(stamps) != a.steps + 1:
        fail("pipec run %s printed %d step lines, expected %d: %s"
             % (row, len(stamps), a.steps + 1, tail("".join(lines))))
    times = [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])]
    # The plan's prediction, from the run's summary line ("... per step, predicted 5.51 s").
    predicted = [float(m.group(1)) * UNIT_MS[m.group(2)]
                 for m in (PREDICTED_LINE.search(l.rstrip()) for l in lines) if m]
    return {"times": times, "losses": losses, "rss_mb": rss,
            "predicted_ms": predicted[-1] if predicted else None}


# --------------------------------------------------------------------------------------------
# The report


def quartiles(times):
    import numpy as np
    q1, med, q3 = np.percentile(np.asarray(times) * 1e3, [25, 50, 75])
    return med, q1, q3


def ratio_text(pipec_ms, peer_ms):
    r = pipec_ms / peer_ms
    if r >= 1:
        return "%.1f× slower" % r
    return "%.1f× faster" % (1 / r)


def machine_lines(pipec):
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    r = subprocess.run([pipec, "--version"], capture_output=True, text=True)
    # The line named after the BLAS (openblas, blis, mkl, ...), not cuda's line naming cuBLAS.
    blas = [l.strip() for l in r.stdout.splitlines()
            if re.match(r"\s*\S*(blas|blis|mkl|dnnl)", l, re.I)]
    blas = [re.sub(r"^blas\s+", "", l) for l in blas]
    return cpu, os.cpu_count(), "; build ".join(blas) or "no BLAS line in `pipec --version`"


def versions():
    import importlib.metadata as md
    return {n: md.version(n) for n in ("torch", "onnxruntime", "transformers", "onnx",
                                       "onnxscript", "numpy")}


def command_line(argv):
    shown = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--write":
            continue
        if arg == "--pipec" and i + 1 < len(argv):
            path = os.path.abspath(argv[i + 1])
            if os.path.relpath(path, ROOT) == os.path.join("build", "bin", "pipec"):
                skip = True
                continue
        shown.append(arg)
    return " ".join(["tools/bench-peers.sh"] + [shlex.quote(s) for s in shown])


def report(a, results, inspect_flops, notes):
    train_flops, infer_flops = model_flops()
    cpu, cores, blas = machine_lines(a.pipec)
    v = versions()
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    out = []
    out.append("Command: `%s` (%d round(s) of %d measured step(s) per contender, each after "
               "one dropped warm-up step, pipec and its peer alternating)."
               % (command_line(a.argv), a.rounds, a.steps))
    out.append("Machine: %s, %d cores, Linux %s, date %s. pipec's BLAS: %s. Peers: torch %s, "
               "onnxruntime %s, transformers %s." % (cpu, cores, platform.release(), now, blas,
                                                    v["torch"], v["onnxruntime"],
                                                    v["transformers"]))
    inspect = ("" if inspect_flops is None else
               " (`pipec inspect` counts %.2f GFLOP forward)" % (inspect_flops / 1e9))
    out.append("Model: %s, sequence %d, global batch %d, fp32, SGD lr 0.01. FLOPs per step from "
               "the shape: %.2f GFLOP forward%s, training 3x forward = %.2f GFLOP."
               % (M.SIZES[SIZE]["label"], SEQ, BATCH, infer_flops / 1e9, inspect,
                  train_flops / 1e9))
    out.append("")
    out.append("| run | pipec / peer | pipec GFLOP/s | peer GFLOP/s | pipec step (ms), median "
               "[quartiles] | peer step (ms), median [quartiles] | peak RSS (MB), pipec / "
               "peer | pipec's plan predicted (ms), measured / predicted |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in a.rows:
        label = ROWS[row].format(threads=a.threads, micro=MICRO, batch=BATCH)
        res = results[row]
        if "error" in res:
            out.append("| %s | not measured: %s | | | | | | |" % (label, res["error"]))
            continue
        rss = "%.0f / %.0f" % (statistics.median(res["pipec_rss"]),
                               statistics.median(res["peer_rss"]))
        flops = infer_flops if row == "infer" else train_flops
        pm, pq1, pq3 = quartiles(res["pipec"])
        qm, qq1, qq3 = quartiles(res["peer"])
        predicted = res.get("predicted_ms")
        against = "-" if not predicted else "%.0f, %.2f" % (predicted, pm / predicted)
        out.append("| %s | %s | %.0f | %.0f | %.1f [%.1f, %.1f] | %.1f [%.1f, %.1f] | %s | %s |"
                   % (label, ratio_text(pm, qm), flops / (pm * 1e6), flops / (qm * 1e6),
                      pm, pq1, pq3, qm, qq1, qq3, rss, against))
    out.append("")
    out.extend("- " + n for n in notes)
    for row in a.rows:
        res = results[row]
        if "error" in res or row == "infer":
            continue
        pl, tl = res.get("pipec_loss"), res.get("peer_loss")
        if pl and tl:
            out.append("- %s, the loss of steps 1 and 2 (the same model, batch and SGD step): "
                       "pipec %s, torch %s." % (row, ", ".join("%.4f" % x for x in pl),
                                                ", ".join("%.4f" % x for x in tl)))
    return "\n".join(out) + "\n"


def write_doc(table):
    """The table into docs/PERFORMANCE.md, between its peers markers (peers-SIZE at the real
    sizes)."""
    from doc_section import write_section
    write_section(DOC, "peers" if SIZE == "small" else "peers-" + SIZE, table)


# --------------------------------------------------------------------------------------------


def pipec_run_flags(a, log):
    """Flags added to every `pipec run`: --threads-per-rank when asked and supported."""
    if a.threads_per_rank is None:
        return [], []
    r = subprocess.run([a.pipec, "run", "--help"], capture_output=True, text=True)
    if "threads-per-rank" in r.stdout + r.stderr:
        return (["--threads-per-rank", str(a.threads_per_rank)],
                ["pipec ran with --threads-per-rank %d." % a.threads_per_rank])
    log("warning: this pipec has no `run --threads-per-rank`; it runs with its default")
    return [], ["--threads-per-rank %d asked, but this pipec's `run` does not take it: pipec "
                "ran with its default threads." % a.threads_per_rank]


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="pipec's CPU speed against PyTorch and onnxruntime (see the docstring).")
    p.add_argument("--pipec", default=os.path.join(ROOT, "build", "bin", "pipec"))
    p.add_argument("--rounds", type=int, default=5, help="alternations per row (default 5)")
    p.add_argument("--steps", type=int, default=10,
                   help="measured steps per contender and round, after one dropped (default 10)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of torch eager and onnxruntime (default: the cores)")
    p.add_argument("--threads-per-rank", type=int,
                   help="passed to `pipec run`; threads of each torch pipelining process")
    p.add_argument("--rows", default=",".join(ROWS),
                   help="comma-separated subset of %s" % ",".join(ROWS))
    p.add_argument("--size", default="small", choices=sorted(M.SIZES),
                   help="the model: the benchmark GPT (small) or a real size")
    p.add_argument("--workdir", help="where the exports, data and plans go (overwritten; "
                   "default build/peers-bench, build/peers-bench-SIZE at a real size)")
    p.add_argument("--quick", action="store_true", help="1 round of 2 steps per row")
    p.add_argument("--write", action="store_true", help="write the table to docs/PERFORMANCE.md")
    # Internal: one peer's measurement in a process of its own.
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--microbatches", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.argv = argv
    use_size(a.size)
    if a.workdir is None:
        a.workdir = os.path.join(ROOT, "build", "peers-bench" + (
            "" if a.size == "small" else "-" + a.size))
    if a.worker:
        return a
    if a.quick and a.write:
        p.error("--quick is a smoke test; its numbers do not go to docs/PERFORMANCE.md")
    if a.quick:
        a.rounds, a.steps = 1, 2
    if a.rounds < 1 or a.steps < 1 or a.threads < 1:
        p.error("--rounds, --steps and --threads must be at least 1")
    if a.threads_per_rank is not None and a.threads_per_rank < 1:
        p.error("--threads-per-rank must be at least 1")
    a.rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown or not a.rows:
        p.error("--rows: unknown %s; choose from %s" % (",".join(unknown), ",".join(ROWS)))
    a.rank_threads = a.threads_per_rank or max(1, a.threads // 2)
    a.pipec = os.path.abspath(a.pipec)
    a.workdir = os.path.abspath(a.workdir)
    return a


def main(argv):
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)

    console = os.fdopen(os.dup(2), "w")  # stays the terminal while output_to() redirects

    def log(msg):
        print("bench_peers: " + msg, file=console, flush=True)

    try:
        if not os.access(a.pipec, os.X_OK):
            fail("%s is not an executable; build pipec first (tools/build.sh) or pass --pipec"
                 % a.pipec)
        a.pipec_run_flags, notes = pipec_run_flags(a, log)
        notes.append("Threads: torch eager and onnxruntime %d; each torch pipelining process "
                     "%d; pipec its default unless said above." % (a.threads, a.rank_threads))
        os.makedirs(a.workdir, exist_ok=True)
        # What pipec measures once per machine (the BLAS it calls, the cpu
        # spec the plans are compiled with) is measured afresh for each
        # benchmark, on the quiet machine, not taken from a cache made while
        # the machine was busy.
        cache = os.path.join(a.workdir, "machine-cache")
        shutil.rmtree(cache, ignore_errors=True)
        os.environ["PIPEC_CACHE_DIR"] = cache
        prepare_log = os.path.join(a.workdir, "prepare.log")
        log("exporting the model and compiling the plans in %s (the exporter's output goes to "
            "%s)" % (os.path.relpath(a.workdir), os.path.relpath(prepare_log)))
        with output_to(prepare_log):
            inspect_flops = prepare(a.workdir, a.pipec, log)
        results = {row: {"pipec": [], "peer": []} for row in a.rows}
        for r in range(a.rounds):
            for row in a.rows:
                res = results[row]
                if "error" in res:
                    continue
                got = run_pipec(a, row)
                res["pipec"] += got["times"]
                res.setdefault("pipec_rss", []).append(got["rss_mb"])
                if got["predicted_ms"] is not None:
                    res["predicted_ms"] = got["predicted_ms"]
                if got["losses"] and "pipec_loss" not in res:
                    res["pipec_loss"] = got["losses"][:2]
                try:
                    peer = run_peer(a, row)
                except BenchError as e:
                    if row != "train-p2":
                        raise
                    res["error"] = str(e)  # the other rows still say something
                    log("%s: %s" % (row, e))
                    continue
                res["peer"] += peer["times"]
                res.setdefault("peer_rss", []).append(peer["rss_mb"])
                if peer.get("losses") and "peer_loss" not in res:
                    res["peer_loss"] = peer["losses"][:2]
                log("round %d/%d %s: pipec %.1f ms, peer %.1f ms (medians of this round)"
                    % (r + 1, a.rounds, row, quartiles(got["times"])[0],
                       quartiles(peer["times"])[0]))
        table = report(a, results, inspect_flops, notes)
        print(table, end="")
        if a.write:
            write_doc(table)
            log("wrote the table to %s" % os.path.relpath(DOC, ROOT))
    except BenchError as e:
        print("bench_peers: error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
