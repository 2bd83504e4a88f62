#!/usr/bin/env python3
"""The torch side of tools/gpu-check.sh's benchmark.

Usage: gpu_check_torch_bench.py [--device cuda|cpu] [--eager | --compile] L H NH S V B M STEPS

Prints "TORCH_MODE pipelining|accumulation|eager|compile", "TORCH_STEP_MS <ms>" and,
on a GPU, "TORCH_PEAK_MB <MB>" (torch.cuda.max_memory_allocated). --eager:
torch eager over the same microbatches (gradient accumulation), without
torch.distributed.pipelining. --compile: the same with the model under
torch.compile (its default inductor backend); the first step, which
compiles, is timed apart ("TORCH_COMPILE_S <s>"). The CPU (tools/gpu-check.sh
--dry-run) runs the same code with a tiny model.
"""
import sys

args = sys.argv[1:]
device = "cuda"
eager = compiled = False
while args[:1] in (["--device"], ["--eager"], ["--compile"]):
    if args[0] == "--eager":
        eager, args = True, args[1:]
    elif args[0] == "--compile":
        eager = compiled = True
        args = args[1:]
    else:
        device, args = args[1], args[2:]

# The benchmark GPT (pre-LN blocks, tied to nothing, GELU MLP of 4x) in bf16
# autocast with AdamW, one pipeline stage of torch.distributed.pipelining
# (world size 1: NCCL cannot put two ranks on one GPU), M microbatches.
import os, sys, time, torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
L, H, NH, S, V, B, M, STEPS = map(int, args[:8])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29517")
dist.init_process_group("gloo", rank=0, world_size=1)
dev = torch.device("cuda:0" if device == "cuda" else "cpu")
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.ln1 = nn.LayerNorm(H); s.qkv = nn.Linear(H, 3 * H); s.proj = nn.Linear(H, H)
        s.ln2 = nn.LayerNorm(H); s.fc = nn.Linear(H, 4 * H); s.out = nn.Linear(4 * H, H)
    def forward(s, x):
        b, t, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).view(b, t, 3, NH, H // NH).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, H)
        x = x + s.proj(a)
        return x + s.out(F.gelu(s.fc(s.ln2(x))))
class Gpt(nn.Module):
    def __init__(s):
        super().__init__(); s.tok = nn.Embedding(V, H); s.pos = nn.Embedding(S, H)
        s.blocks = nn.ModuleList(Block() for _ in range(L)); s.ln = nn.LayerNorm(H); s.head = nn.Linear(H, V)
    def forward(s, ids):
        x = s.tok(ids) + s.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in s.blocks: x = b(x)
        return s.head(s.ln(x))
model = Gpt().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
forward = torch.compile(model) if compiled else model
loss = lambda logits, y: F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
ids = torch.randint(0, V, (B, S), device=dev); labels = torch.randint(0, V, (B, S), device=dev)
def pipelined():
    sched = Schedule1F1B(PipelineStage(model, 0, 1, dev), n_microbatches=M, loss_fn=loss)
    return lambda: sched.step(ids, target=labels)
def accumulated():
    # The same microbatches without the pipelining runtime.
    def run():
        for x, y in zip(ids.chunk(M), labels.chunk(M)):
            (loss(forward(x), y) / M).backward()
    return run
def step(body):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        body()
    opt.step()
if eager:
    body, mode = accumulated(), "compile" if compiled else "eager"
    t = time.perf_counter()
    step(body)
    sync()
    if compiled:
        print("TORCH_COMPILE_S %.1f" % (time.perf_counter() - t))
else:
    try:
        body, mode = pipelined(), "pipelining"
        step(body)
    except Exception as e:  # a torch without single-stage schedules
        print("pipelining failed (%s); timing gradient accumulation" % e)
        body, mode = accumulated(), "accumulation"
        step(body)
sync()
print("TORCH_MODE", mode)
t = time.perf_counter()
for _ in range(STEPS): step(body)
sync()
print("TORCH_STEP_MS %.3f" % ((time.perf_counter() - t) / STEPS * 1e3))
if device == "cuda":
    print("TORCH_PEAK_MB %.0f" % (torch.cuda.max_memory_allocated() / 2**20))
