#!/usr/bin/env bash
# gpu-check.sh - everything that needs a GPU, run from a prebuilt bundle
# (tools/gpu-bundle.sh) on the GPU test machine. It builds nothing.
#
# Rows, each printed (and appended to RESULTS_DIR/table.txt) as soon as it
# is measured:
#   libraries   where CUDA's and NCCL's libraries come from (the bundle has
#               none of them: the machine's Python packages or toolkit)
#   pipec       the bundle's pipec runs and sees the device
#   GpuTest     every device kernel against the CPU kernel, the backend's
#               own operations (bf16 GEMMs, cuBLASLt's bias epilogue, ...)
#   = 1 rank    a GPT trained 3 steps as a 2-stage pipeline (1F1B, ZB-H1,
#               DualPipeV), both ranks on the one GPU (--ranks-per-device 2),
#               gives the weights of the one-rank run, within 1e-5; and the
#               one-rank CUDA run those of the CPU backend, within 1e-3
#   recompute   the 2-stage 1F1B plan with --recompute, the same
#   tp          the 2-stage 1F1B plan with --tp 2 (4 ranks on the GPU, the
#               head's vocabulary-parallel loss included), the same; and with
#               --sequence-parallel, the same
#   sharded     --shard-optimizer with two replicas on the GPU gives the
#               unsharded replicas' weights after 3 AdamW steps, within 1e-6
#   autocast    torch's GPT-2 export trained 50 AdamW steps with --precision
#               bf16 --autocast (bf16 activations): each loss within 1% of
#               torch's own autocast run, the last within 1% of its float32
#               run; the CPU fallbacks it took (the device has no bf16
#               kernels yet)
#   generate    greedy generation (fp32) of the GPT-2 and Llama fixtures, and of
#               the Llama in onnxruntime-genai's form, on 2 stages sharing the
#               GPU gives transformers' 32 tokens exactly
#   fallbacks   the nodes the one-rank CUDA run handed to the CPU, by op
#   nccl        the same over NCCL under mpirun, or why it could not run
#   bench       a bf16 GPT trained with 1F1B on one rank (fused,
#               --no-fuse, and --attention unfused), and 1F1B and ZB-H1 on
#               two ranks sharing the GPU:
#               steady step, TFLOP/s, MFU against the peak, measured
#               against predicted step, and each rank's device memory peak
#               against the plan's
#   profile     the one-rank bench plan's last step by op class, with the
#               backend's launches, host syncs, bytes to the host and
#               allocations (run --profile; the JSON is kept in the results)
#   torch       the same GPT in torch.distributed.pipelining with the
#               machine's torch, bf16 autocast: its step beside pipec's
#   torch.compile  the same GPT and microbatches in torch eager under
#               torch.compile, where it compiles within 150 s: its step and
#               compile time
#   alternated  pipec's one-rank bench plan and torch eager (bf16 autocast,
#               SDPA) on the same GPT and batch, run in turn three times:
#               the medians of their steps and pipec / torch
#   real size   a GPT of 24 x 2048, sequence 2048, 16 sequences, one rank:
#               pipec's step (as a bench row) and torch eager's (bf16
#               autocast, SDPA) with its peak memory
#
# Formulas: training FLOPs per step = 3 x M x (sum over stages of the plan's
# forward FLOPs per microbatch) (backward = 2 x forward); TFLOP/s = FLOPs /
# steady step; MFU = TFLOP/s / peak dense bf16 (989 TFLOP/s for the H100
# and H200 SXM, NVIDIA's datasheet). The steady step is (N t_N - t_1) /
# (N - 1) from an N-step and a 1-step run, so that start-up (cuBLAS, the
# memory pool's first step) is not counted. The prediction assumes one GPU
# per rank: with P ranks on one GPU expect about P times the prediction.
#
# Limits: every step at most 180 s (pipec run also gets --timeout, so a
# rank that stops progressing fails instead of hanging); the whole script
# stops starting steps after 9 minutes and marks what is left SKIPPED.
# RESULTS_DIR gets at most 8 files: table.txt, env.log, gputest.log,
# equivalence.log, bench.log, torch.log. Models and plans go to a
# temporary folder, removed at the end.
#
# --dry-run: the same steps without a GPU, here: GpuTest runs its host half
# (device tests skip), every run uses the CPU backend, the benchmark a tiny
# GPT, torch (if importable) the CPU; the GPU-only rows say SKIPPED. It
# checks that every path but the GPU's works before the first GPU minute.
#
# Usage: tools/gpu-check.sh [--dry-run] BUNDLE RESULTS_DIR
#   BUNDLE: the folder tools/gpu-bundle.sh made, or its .tar.xz
# Environment: PIPEC_PEAK_TFLOPS (989), PIPEC_PYTHON (python3),
#   PIPEC_BENCH="layers hidden heads seq vocab batch microbatches steps"
#   (default "8 1024 16 512 8192 16 8 6"; dry run "2 64 4 32 256 4 2 2"),
#   PIPEC_CHECK_SECONDS (540: the whole script's deadline).
# Exit status: 1 if a row FAILed, 2 on bad usage, else 0.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

dry=0
if [ "${1:-}" = --dry-run ]; then
  dry=1
  shift
fi
if [ $# != 2 ]; then
  echo "usage: tools/gpu-check.sh [--dry-run] BUNDLE RESULTS_DIR" >&2
  exit 2
fi
bundle=$1
results=$2
mkdir -p "$results" || exit 2
results=$(cd "$results" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/pipec-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT
if [[ $bundle == *.tar.xz ]]; then
  tar -C "$work" -xJf "$bundle" || { echo "gpu-check: cannot unpack $bundle" >&2; exit 2; }
  bundle=$(find "$work" -mindepth 2 -maxdepth 3 -name pipec -path '*/bin/*' -printf '%h\n' | head -1)/..
fi
bundle=$(cd "$bundle" 2>/dev/null && pwd)
pipec=$bundle/bin/pipec
if [ ! -x "$pipec" ] || [ ! -x "$bundle/bin/GpuTest" ]; then
  echo "gpu-check: $1 is not a bundle (bin/pipec, bin/GpuTest): make one with tools/gpu-bundle.sh" >&2
  exit 2
fi
py=${PIPEC_PYTHON:-python3}
deadline=${PIPEC_CHECK_SECONDS:-540}
peak=${PIPEC_PEAK_TFLOPS:-989}
if [ $dry = 1 ]; then backend=cpu; else backend=cuda; fi
# Where torch's rows run: the device, or the CPU in the dry run.
if [ $dry = 1 ]; then device=cpu; else device=cuda; fi
table=$results/table.txt
: >"$table"
for f in env gputest equivalence bench torch; do : >"$results/$f.log"; done
status=0

# row CHECK RESULT DETAIL: one line of the table, printed at once.
row() {
  printf '%-30s %-11s %s\n' "$1" "$2" "$3" | tee -a "$table"
  if [ "$2" = FAIL ]; then status=1; fi
}

# Seconds left for the next step: at most 180, none past the deadline.
budget() {
  local left=$((deadline - SECONDS - 5))
  if [ $left -gt 180 ]; then left=180; fi
  echo $((left > 0 ? left : 0))
}

# step LOG COMMAND...: runs COMMAND within budget(), its output appended to
# LOG under a header. Fails with 124 when out of time or stopped.
step() {
  local log=$1 t
  shift
  t=$(budget)
  echo "\$ $* (limit ${t}s)" >>"$log"
  if [ "$t" -lt 10 ]; then
    echo "not run: the script's deadline is reached" >>"$log"
    return 124
  fi
  timeout -k 5 "$t" "$@" >>"$log" 2>&1
}

# The last line of LOG matching PATTERN, short enough for a table cell.
last() { grep -E "$2" "$1" 2>/dev/null | tail -1 | cut -c1-150; }

# why RC LOG: a failed step's cause for its row.
why() {
  if [ "$1" = 124 ] || [ "$1" = 137 ]; then
    echo "stopped at its time limit (see $(basename "$2"))"
  else
    echo "exit $1: $(last "$2" 'rror|FAIL|Abort|what\(\)')"
  fi
}

#--- the machine and the libraries --------------------------------------------
{
  echo "gpu-check $(date -u +%Y-%m-%dT%H:%MZ)$([ $dry = 1 ] && echo ' (dry run)')"
  cat "$bundle/MANIFEST" 2>/dev/null
  nvidia-smi 2>&1 || echo "no nvidia-smi"
} >>"$results/env.log"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPU: ${gpu:-none}$([ $dry = 1 ] && echo ', dry run: CPU backend, tiny benchmark')" | tee -a "$table"

# CUDA's and NCCL's libraries, by the names the bundle needs (its MANIFEST):
# already on the library path, in the Python packages (nvidia-*-cu13), or
# in the toolkit.
needed=$(sed -n 's/^needs from the GPU machine: //p' "$bundle/MANIFEST" 2>/dev/null)
dirs=()
IFS=: read -r -a dirs <<<"${LD_LIBRARY_PATH:-}"
while read -r d; do dirs+=("$d"); done < <("$py" -c '
import os, nvidia
for p in nvidia.__path__:
    for root, _, files in sorted(os.walk(p)):
        if any(".so" in f for f in files): print(root)' 2>/dev/null)
dirs+=(/usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu)
found=() missing=() libPath=()
for lib in $needed; do
  hit=""
  for d in "${dirs[@]}"; do
    if [ -n "$d" ] && [ -e "$d/$lib" ]; then hit=$d; break; fi
  done
  if [ -n "$hit" ]; then
    found+=("$lib in $hit")
    [[ " ${libPath[*]-} " == *" $hit "* ]] || libPath+=("$hit")
  else
    missing+=("$lib")
  fi
done
libs=$(IFS=:; echo "${libPath[*]-}")
export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$results/env.log"
printf '%s\n' "${found[@]-}" >>"$results/env.log"
if [ -z "$needed" ]; then
  row libraries FAIL "the bundle's MANIFEST names no CUDA libraries: rebuild it with tools/gpu-bundle.sh"
elif [ ${#missing[@]} -gt 0 ]; then
  row libraries FAIL "not found: ${missing[*]} (looked in LD_LIBRARY_PATH, $py's nvidia packages, /usr/local/cuda)"
else
  row libraries ok "$(echo "$needed" | wc -w) from ${libs//:/, }"
fi

step "$results/env.log" "$pipec" --version
rc=$?
cudaLine=$(last "$results/env.log" '^  cuda ')
devices=$(echo "$cudaLine" | sed -n 's/.*devices \([0-9]*\).*/\1/p')
if [ $rc != 0 ]; then
  row pipec FAIL "--version: $(why $rc "$results/env.log")"
elif [ $dry = 0 ] && [ "${devices:-0}" -lt 1 ]; then
  row pipec FAIL "sees no CUDA device: ${cudaLine# *}"
else
  row pipec ok "${cudaLine#  }"
fi

#--- GpuTest -------------------------------------------------------------------
step "$results/gputest.log" "$bundle/bin/GpuTest"
rc=$?
g=$results/gputest.log
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$g" | tail -1)
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$g" | tail -1)
failed=$(grep -c '^\[  FAILED  \] .*\.' "$g")
noDevice=$(grep -c 'no CUDA device' "$g")
detail="${passed:-0} passed, ${skipped:-0} skipped, $failed failed"
if [ $rc != 0 ]; then
  row GpuTest FAIL "$detail; $(why $rc "$g")"
elif [ $dry = 1 ]; then
  row GpuTest ok "$detail (dry run: the host half; device tests skip)"
elif [ "$noDevice" -gt 0 ]; then
  row GpuTest FAIL "$detail: tests saw no CUDA device"
else
  row GpuTest ok "$detail"
fi

#--- pipelined = one rank --------------------------------------------------------
e=$results/equivalence.log
gptFlags=(--layers 4 --hidden 256 --heads 8 --vocab 2000 --seq 64 --loss)
planFlags=(--microbatches 4 --batch 8 --hardware h200 --precision fp32 --optimizer sgd)
trainFlags=(--backend "$backend" --precision fp32 --steps 3 --seed 7 --optimizer sgd --lr 0.01
            --timeout 60)
compare() { "$py" "$here/gpu_check_compare.py" "$@"; }
if step "$e" "$pipec" model gpt "${gptFlags[@]}" -o "$work/gpt.onnx" &&
   step "$e" "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-1.plan" --stages 1 "${planFlags[@]}" &&
   step "$e" "$pipec" run "$work/gpt-1.plan" "${trainFlags[@]}" --save-weights "$work/w-1.onnx"; then
  ref=$work/w-1.onnx
  fallbacks=$(last "$e" 'CPU fallbacks: ' | sed 's/.*CPU fallbacks: //')
  if [ $dry = 1 ]; then
    row fallbacks SKIPPED "dry run: the CPU backend has none"
  elif [ -n "$fallbacks" ]; then
    row fallbacks info "1 rank, 3 steps: $fallbacks"
  else
    row fallbacks FAIL "pipec run printed no 'CPU fallbacks:' in its summary"
  fi
else
  ref=""
  row "gpt 1 rank ($backend)" FAIL "$(why $? "$e")"
fi
# matches LABEL REF OTHER RTOL ATOL: the row for two runs' weights.
matches() {
  local out
  if out=$(compare "$2" "$3" "$4" "$5" 2>&1); then row "$1" ok "$out"; else row "$1" FAIL "$out"; fi
}
for sched in 1f1b zb-h1 dualpipev; do
  label="$sched P=2 = 1 rank ($backend)"
  plan=$work/gpt-$sched.plan
  if [ -z "$ref" ]; then
    row "$label" FAIL "no one-rank run to compare with"
    continue
  fi
  virtual=()
  [ "$sched" = dualpipev ] && virtual=(--virtual-stages 2) # two chunks per rank, in a V
  step "$e" "$pipec" compile "$work/gpt.onnx" -o "$plan" --stages 2 --schedule "$sched" \
    ${virtual[@]+"${virtual[@]}"} "${planFlags[@]}"
  rc=$?
  if [ $rc != 0 ]; then row "$label" FAIL "compile: $(why $rc "$e")"; continue; fi
  step "$e" "$pipec" run "$plan" "${trainFlags[@]}" --ranks-per-device 2 --save-weights "$work/w-$sched.onnx"
  rc=$?
  if [ $rc != 0 ]; then row "$label" FAIL "run: $(why $rc "$e")"; continue; fi
  matches "$label" "$ref" "$work/w-$sched.onnx" 1e-5 1e-6
done
# --recompute: FORWARD drops the activations, RECOMPUTE reruns the forward
# nodes that rebuild them on the device before each backward.
label="1f1b P=2 recompute = 1 rank ($backend)"
if [ -z "$ref" ]; then
  row "$label" FAIL "no one-rank run to compare with"
elif step "$e" "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-recompute.plan" --stages 2 \
       --schedule 1f1b --recompute "${planFlags[@]}" &&
     step "$e" "$pipec" run "$work/gpt-recompute.plan" "${trainFlags[@]}" --ranks-per-device 2 \
       --save-weights "$work/w-recompute.onnx"; then
  matches "$label" "$ref" "$work/w-recompute.onnx" 1e-5 1e-6
else
  row "$label" FAIL "$(why $? "$e")"
fi
# --tp 2: each stage's products split over two ranks, all four ranks on the
# one GPU (threads: host sums), the untied head's loss vocabulary-parallel;
# and with --sequence-parallel the norms and residuals split on the tokens
# (reduce-scatters and all-gathers in place of the sums). The same weights.
for split in "tp:" "sp:--sequence-parallel"; do
  name=${split%%:*} extra=${split#*:}
  label="tp=2${extra:+ sequence-parallel} P=2 = 1 rank ($backend)"
  if [ -z "$ref" ]; then
    row "$label" FAIL "no one-rank run to compare with"
  elif step "$e" "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-$name.plan" --stages 2 \
         --schedule 1f1b --tp 2 $extra "${planFlags[@]}" &&
       step "$e" "$pipec" run "$work/gpt-$name.plan" "${trainFlags[@]}" --ranks-per-device 4 \
         --save-weights "$work/w-$name.onnx"; then
    matches "$label" "$ref" "$work/w-$name.onnx" 1e-5 1e-6
  else
    row "$label" FAIL "$(why $? "$e")"
  fi
done
# --shard-optimizer: two replicas on the one GPU (threads: host
# collectives), each updating its shard of every weight on the device, give
# the unsharded replicas' weights after three AdamW steps with clipping and
# weight decay.
label="sharded dp=2 = unsharded ($backend)"
adamFlags=(--backend "$backend" --precision fp32 --steps 3 --seed 7 --timeout 60 --optimizer adamw
           --lr 1e-3 --clip-grad-norm 0.05 --weight-decay 0.1)
if step "$e" "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-dp.plan" --stages 1 --dp 2 \
     "${planFlags[@]}" &&
   step "$e" "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-zero.plan" --stages 1 --dp 2 \
     --shard-optimizer "${planFlags[@]}" &&
   step "$e" "$pipec" run "$work/gpt-dp.plan" "${adamFlags[@]}" \
     --ranks-per-device 2 --save-weights "$work/w-dp.onnx" &&
   step "$e" "$pipec" run "$work/gpt-zero.plan" "${adamFlags[@]}" \
     --ranks-per-device 2 --save-weights "$work/w-zero.onnx"; then
  matches "$label" "$work/w-dp.onnx" "$work/w-zero.onnx" 1e-6 1e-7
else
  row "$label" FAIL "$(why $? "$e")"
fi
# bf16 activations (--autocast): 50 AdamW steps of torch's GPT-2 export on its
# batch, every step's loss within 1% of torch's own run under torch.autocast
# and the last within 1% of torch's float32 run (fixtures/train/autocast.json).
label="autocast gpt2 50 steps = torch bf16 ($backend)"
fx=$bundle/fixtures/train
if [ ! -f "$fx/autocast.json" ]; then
  row "$label" FAIL "the bundle has no $fx/autocast.json"
elif step "$e" "$pipec" compile "$fx/gpt2_tied.onnx" -o "$work/autocast.plan" --mode train \
       --optimizer adamw --precision bf16 --autocast --stages 1 --hardware h100 &&
     step "$e" "$pipec" run "$work/autocast.plan" --data "$fx/gpt2_tied.data" --backend "$backend" \
       --steps 50 --optimizer adamw --lr 1e-3 --weight-decay 0.1 --timeout 120 \
       --metrics "$work/autocast.jsonl"; then
  fb=$(last "$e" 'CPU fallbacks:')
  if out=$("$py" -c "import json, sys
got = [json.loads(l)['loss'] for l in open(sys.argv[1])]
ref = json.load(open(sys.argv[2]))['models']['gpt2_tied']
worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref['bf16']))
last = abs(got[-1] - ref['fp32'][-1]) / abs(ref['fp32'][-1])
print('loss %.4f -> %.4f, worst step %.1e from torch bf16, last %.1e from fp32; %s'
      % (got[0], got[-1], worst, last, sys.argv[3]))
sys.exit(0 if len(got) == len(ref['bf16']) and worst <= 1e-2 and last <= 1e-2 else 1)" \
      "$work/autocast.jsonl" "$fx/autocast.json" "${fb:-no fallback line}" 2>&1); then
    row "$label" ok "$out"
  else
    row "$label" FAIL "$out"
  fi
else
  row "$label" FAIL "$(why $? "$e")"
fi
# Generation: greedy tokens of the GPT-2 and Llama fixtures, and of the
# Llama in onnxruntime-genai's form (GroupQueryAttention), on 2 stages
# sharing the device (prefill and decode programs) are transformers'.
for m in gpt2 llama genai-llama; do
  label="generate $m P=2 = hf ($backend)"
  fx=$bundle/fixtures/generate
  if [ ! -f "$fx/$m.onnx" ]; then row "$label" FAIL "the bundle has no $fx/$m.onnx"; continue; fi
  if ! step "$e" "$pipec" compile "$fx/$m.onnx" --mode generate --max-length 40 --prompt-length 6 \
    --stages 2 --microbatches 2 --slots 4 --hardware h100 --precision fp32 -o "$work/gen-$m.plan"; then
    row "$label" FAIL "compile: $(why $? "$e")"
    continue
  fi
  if ! step "$e" "$pipec" generate "$work/gen-$m.plan" --prompts "$fx/$m.prompts.npy" \
    --max-new-tokens 32 --backend "$backend" --ranks-per-device 2 --timeout 60 \
    -o "$work/gen-$m.npy"; then
    row "$label" FAIL "generate: $(why $? "$e")"
    continue
  fi
  # (int64 .npy files read without numpy: the header, then the ids.)
  if out=$("$py" -c "import struct, sys
def ids(path):
    b = open(path, 'rb').read()
    size = 2 if b[6] == 1 else 4
    start = 8 + size + int.from_bytes(b[8:8 + size], 'little')
    return struct.unpack('<%dq' % ((len(b) - start) // 8), b[start:])
a, b = ids(sys.argv[1]), ids(sys.argv[2])
same = sum(x == y for x, y in zip(a, b)) if len(a) == len(b) else 0
print('%d of %d tokens equal; %s' % (same, len(b), sys.argv[3]))
sys.exit(0 if same == len(b) else 1)" "$work/gen-$m.npy" "$fx/$m.greedy.npy" \
    "$(grep -o '[0-9.]* tokens/s' "$e" | tail -1)" 2>&1); then
    row "$label" ok "$out"
  else
    row "$label" FAIL "$out"
  fi
done
if [ $dry = 1 ]; then
  row "cuda = cpu (1 rank)" SKIPPED "dry run"
elif [ -z "$ref" ]; then
  row "cuda = cpu (1 rank)" FAIL "no one-rank cuda run"
else
  step "$e" "$pipec" run "$work/gpt-1.plan" "${trainFlags[@]/cuda/cpu}" --save-weights "$work/w-cpu.onnx"
  rc=$?
  if [ $rc != 0 ]; then
    row "cuda = cpu (1 rank)" FAIL "cpu run: $(why $rc "$e")"
  else
    matches "cuda = cpu (1 rank)" "$ref" "$work/w-cpu.onnx" 1e-3 1e-5
  fi
fi
# NCCL: one process per rank under mpirun, one GPU per rank (NCCL refuses
# two ranks of a communicator on one device): the 2-stage plan on two GPUs,
# else the one-rank plan (which still sets NCCL up). The dry run starts the
# same processes over MPI with host tensors.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ $dry = 1 ]; then comm=mpi; else comm=nccl; fi
if ! command -v mpirun >/dev/null 2>&1; then
  row "$comm = local" UNAVAILABLE "no mpirun on this machine: NCCL's ranks start under MPI, so it was not run"
elif [ -z "$ref" ]; then
  row "$comm = local" FAIL "no one-rank run to compare with"
else
  if [ "$gpus" -ge 2 ] || [ $dry = 1 ]; then n=2; plan=$work/gpt-1f1b.plan; else n=1; plan=$work/gpt-1.plan; fi
  step "$e" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np $n \
    "$pipec" run "$plan" "${trainFlags[@]}" --comm "$comm" --save-weights "$work/w-$comm.onnx"
  rc=$?
  if [ $rc != 0 ]; then
    row "$comm = local ($n rank)" FAIL "$(why $rc "$e")"
  else
    matches "$comm = local ($n rank)" "$ref" "$work/w-$comm.onnx" 1e-5 1e-6
  fi
fi

#--- benchmark -------------------------------------------------------------------
b=$results/bench.log
if [ $dry = 1 ]; then defaultBench="2 64 4 32 256 4 2 2"; else defaultBench="8 1024 16 512 8192 16 8 6"; fi
read -r bL bH bNH bS bV bB bM bN <<<"${PIPEC_BENCH:-$defaultBench}"
echo "bench: GPT L=$bL H=$bH heads=$bNH seq=$bS vocab=$bV, batch $bB in $bM microbatches, bf16, $bN steps; peak $peak TFLOP/s" |
  tee -a "$table" >>"$b"
pipecP1=""
# The bench plan of SCHED STAGES [FLAGS]: bench-SCHED-STAGES[-FLAGS without blanks and dashes].plan
benchPlan() { local flags=${3:-}; echo "$work/${benchPrefix:-bench}-$1-$2${flags:+-${flags//[ -]/}}.plan"; }
# benchRow LABEL SCHED STAGES [FLAGS]: the plan compiled with the same flags
benchRow() {
  local label=$1 sched=$2 stages=$3 extra=${4:-} plan
  plan=$(benchPlan "$2" "$3" "${4:-}")
  if [ ! -f "$plan" ]; then
    row "$label" FAIL "not run: its plan ($sched, $stages stage(s)) did not compile"
    return
  fi
  local flops common mark tN t1 pred cells rc
  flops=$("$pipec" report "$plan" --format json 2>>"$b" | "$py" "$here/gpu_check_table.py" flops 2>>"$b")
  common=(--backend "$backend" --precision bf16 --ranks-per-device "$stages" --seed 3 --timeout 60)
  mark=$(($(wc -l <"$b") + 1))
  step "$b" "$pipec" run "$plan" "${common[@]}" --steps "$bN"
  rc=$?
  if [ $rc != 0 ]; then row "$label" FAIL "$(why $rc "$b")"; return; fi
  local summary devmem
  summary=$(tail -n +"$mark" "$b" | grep -E 'step\(s\) of .* per step, predicted' | tail -1)
  devmem=$(tail -n +"$mark" "$b" | sed -n 's/^device memory: //p' | tail -1)
  if [ "$extra" = --no-fuse ] && tail -n +"$mark" "$b" | grep -q '^fused '; then
    row "$label" FAIL "asked for --no-fuse but the run fused nodes"
    return
  fi
  mark=$(($(wc -l <"$b") + 1))
  step "$b" "$pipec" run "$plan" "${common[@]}" --steps 1
  rc=$?
  if [ $rc != 0 ]; then row "$label" FAIL "1-step run: $(why $rc "$b")"; return; fi
  local one
  one=$(tail -n +"$mark" "$b" | grep -E 'step\(s\) of .* per step' | tail -1)
  tN=$("$py" "$here/gpu_check_table.py" seconds "$(echo "$summary" | sed -E 's/.*: ([0-9.]+ [mu]?s) per step.*/\1/')")
  pred=$("$py" "$here/gpu_check_table.py" seconds "$(echo "$summary" | sed -E 's/.*predicted ([0-9.]+ [mu]?s).*/\1/')")
  t1=$("$py" "$here/gpu_check_table.py" seconds "$(echo "$one" | sed -E 's/.*: ([0-9.]+ [mu]?s) per step.*/\1/')")
  if ! cells=$("$py" "$here/gpu_check_table.py" cells "$bN" "$tN" "$t1" "$pred" "${flops:-0}" "$peak" 2>>"$b"); then
    row "$label" FAIL "could not read its times (see bench.log)"
    return
  fi
  local steady predicted tf mfu ratio fb
  IFS='|' read -r steady predicted tf mfu ratio <<<"$cells"
  fb=$(echo "$summary" | sed -n 's/.*; CPU fallbacks: //p')
  row "$label" ok "step $steady (predicted $predicted, measured/predicted $ratio), $tf TFLOP/s, MFU $mfu${devmem:+; device memory $devmem}${fb:+; CPU fallbacks: $fb}"
  if [ "$stages" = 1 ] && [ -z "$extra" ]; then pipecP1=${steady% ms}; fi
}
benchOk=1
step "$b" "$pipec" model gpt --layers "$bL" --hidden "$bH" --heads "$bNH" --seq "$bS" --vocab "$bV" \
  --loss -o "$work/bench.onnx" || benchOk=0
for plan in "1f1b 1" "1f1b 2" "zb-h1 2" "1f1b 1 --no-fuse" "1f1b 1 --attention unfused"; do
  read -r sched stages flags <<<"$plan"
  # shellcheck disable=SC2086 # the flags are words
  [ $benchOk = 1 ] && step "$b" "$pipec" compile "$work/bench.onnx" \
    -o "$(benchPlan "$sched" "$stages" "$flags")" \
    --stages "$stages" --schedule "$sched" --microbatches "$bM" --batch "$bB" --hardware h200 \
    --precision bf16 $flags
done
benchRow "bench 1f1b P=1" 1f1b 1
benchRow "bench 1f1b P=1 --no-fuse" 1f1b 1 --no-fuse
# Attention as the exporter's nodes, its scores kept (before fuse-attention).
benchRow "bench 1f1b P=1 --attention unfused" 1f1b 1 "--attention unfused"
benchRow "bench 1f1b P=2 (GPU shared)" 1f1b 2
benchRow "bench zb-h1 P=2 (GPU shared)" zb-h1 2
# The profile of the one-rank plan's third step (run --profile): where the
# step goes by op class, and the host's waits and launches (the file is kept
# with the results).
label="profile 1f1b P=1"
if [ -f "$work/bench-1f1b-1.plan" ] &&
   step "$b" "$pipec" run "$work/bench-1f1b-1.plan" --backend "$backend" --precision bf16 \
     --seed 3 --timeout 60 --steps 3 --quiet --profile "$results/profile-1f1b-1.json" &&
   summary=$("$py" "$here/gpu_check_table.py" profile "$results/profile-1f1b-1.json" 2>>"$b"); then
  row "$label" ok "$summary"
else
  row "$label" FAIL "see bench.log"
fi

#--- torch ------------------------------------------------------------------------
t=$results/torch.log
if ! "$py" -c 'import torch' >>"$t" 2>&1; then
  if [ $dry = 1 ]; then
    "$py" -c 'import ast, sys; ast.parse(open(sys.argv[1]).read())' \
      "$here/gpu_check_torch_bench.py" >>"$t" 2>&1 &&
      row torch SKIPPED "dry run: no torch here (the script compiles)" ||
      row torch FAIL "gpu_check_torch_bench.py does not compile (see torch.log)"
  else
    row torch UNAVAILABLE "$py cannot import torch"
  fi
else
  if step "$t" "$py" "$here/gpu_check_torch_bench.py" --device "$device" "$bL" "$bH" "$bNH" "$bS" \
       "$bV" "$bB" "$bM" "$bN"; then
    torchMs=$(sed -n 's/^TORCH_STEP_MS //p' "$t" | tail -1)
    torchMode=$(sed -n 's/^TORCH_MODE //p' "$t" | tail -1)
    if [ -n "$pipecP1" ]; then
      row "torch ($torchMode)" ok "$torchMs ms/step on $device; pipec 1f1b P=1 / torch = $("$py" "$here/gpu_check_table.py" ratio "$pipecP1" "$torchMs")"
    else
      row "torch ($torchMode)" ok "$torchMs ms/step on $device (no pipec 1f1b P=1 time to compare)"
    fi
  else
    row torch FAIL "$(why $? "$t")"
  fi
fi

# Alternated: the one-rank bench plan and torch eager on the same GPT and
# batch, round after round (pipec, then torch, three times), so that the
# device's clocks and temperature fall on both; the medians and their ratio.
label="alternated pipec 1f1b P=1 / torch eager"
if [ ! -f "$work/bench-1f1b-1.plan" ]; then
  row "$label" FAIL "not run: the bench plan did not compile"
elif ! "$py" -c 'import torch' >>"$t" 2>&1; then
  row "$label" SKIPPED "$py cannot import torch"
else
  metrics="" torchRounds="" altOk=1
  for r in 1 2 3; do
    if step "$b" "$pipec" run "$work/bench-1f1b-1.plan" --backend "$backend" --precision bf16 \
         --seed 3 --timeout 60 --steps "$bN" --quiet --metrics "$work/alt-$r.jsonl" &&
       step "$t" "$py" "$here/gpu_check_torch_bench.py" --device "$device" --eager "$bL" "$bH" \
         "$bNH" "$bS" "$bV" "$bB" "$bM" "$bN"; then
      metrics=${metrics:+$metrics,}$work/alt-$r.jsonl
      torchRounds=${torchRounds:+$torchRounds,}$(sed -n 's/^TORCH_STEP_MS //p' "$t" | tail -1)
    else
      altOk=0
      break
    fi
  done
  if [ $altOk = 1 ] && cells=$("$py" "$here/gpu_check_table.py" alternated "$metrics" "$torchRounds" 2>>"$b"); then
    IFS='|' read -r altPipec altTorch altRatio <<<"$cells"
    row "$label" ok "pipec $altPipec, torch $altTorch (medians of 3 rounds on $device; torch's: $torchRounds ms); pipec / torch = $altRatio"
  else
    row "$label" FAIL "see bench.log and torch.log"
  fi
fi

#--- real size ----------------------------------------------------------------------
# Issue 47's real size: a GPT of 24 blocks, width 2048, 16 heads, sequence
# 2048, 16 sequences a step in 8 microbatches, one rank, bf16; pipec's 1F1B
# step, then torch eager's on the same model and batch (bf16 autocast, SDPA,
# gradient accumulation over the same microbatches) with its peak memory.
if [ $dry = 1 ]; then defaultReal="2 64 4 64 256 4 2 2"; else defaultReal="24 2048 16 2048 32768 16 8 3"; fi
read -r rL rH rNH rS rV rB rM rN <<<"${PIPEC_BENCH_REAL:-$defaultReal}"
echo "real size: GPT L=$rL H=$rH heads=$rNH seq=$rS vocab=$rV, batch $rB in $rM microbatches, bf16, $rN steps" |
  tee -a "$table" >>"$b"
benchP1=$pipecP1 benchSteps=$bN # the bench GPT's, for torch.compile below
benchPrefix=real bN=$rN pipecP1=""
if step "$b" "$pipec" model gpt --layers "$rL" --hidden "$rH" --heads "$rNH" --seq "$rS" \
     --vocab "$rV" --loss -o "$work/real.onnx"; then
  step "$b" "$pipec" compile "$work/real.onnx" -o "$(benchPlan 1f1b 1)" --stages 1 \
    --schedule 1f1b --microbatches "$rM" --batch "$rB" --hardware h200 --precision bf16
fi
benchRow "real 1f1b P=1" 1f1b 1
rm -f "$work/real.onnx"
if "$py" -c 'import torch' >>"$t" 2>&1; then
  if step "$t" "$py" "$here/gpu_check_torch_bench.py" --device "$device" --eager "$rL" "$rH" \
       "$rNH" "$rS" "$rV" "$rB" "$rM" "$rN"; then
    torchMs=$(sed -n 's/^TORCH_STEP_MS //p' "$t" | tail -1)
    torchPeak=$(sed -n 's/^TORCH_PEAK_MB //p' "$t" | tail -1)
    row "real torch (eager)" ok "$torchMs ms/step on $device${torchPeak:+, peak $torchPeak MB}${pipecP1:+; pipec 1f1b P=1 / torch = $("$py" "$here/gpu_check_table.py" ratio "$pipecP1" "$torchMs")}"
  else
    row "real torch (eager)" FAIL "$(why $? "$t")"
  fi
else
  row "real torch (eager)" SKIPPED "$py cannot import torch"
fi

#--- torch.compile ------------------------------------------------------------------
# torch.compile (inductor) on the bench GPT and microbatches, where it compiles
# within 150 s: its steady step beside pipec's, and its compile time. Last, so
# that a slow compile takes no time from the rows above.
if "$py" -c 'import torch' >>"$t" 2>&1; then
  if step "$t" timeout 150 "$py" "$here/gpu_check_torch_bench.py" --device "$device" --compile \
       "$bL" "$bH" "$bNH" "$bS" "$bV" "$bB" "$bM" "$benchSteps"; then
    torchMs=$(sed -n 's/^TORCH_STEP_MS //p' "$t" | tail -1)
    compileS=$(sed -n 's/^TORCH_COMPILE_S //p' "$t" | tail -1)
    row "torch (compile)" ok "$torchMs ms/step on $device after ${compileS}s compiling${benchP1:+; pipec 1f1b P=1 / torch.compile = $("$py" "$here/gpu_check_table.py" ratio "$benchP1" "$torchMs")}"
  else
    rc=$?
    if [ $rc = 124 ] && tail -1 "$t" | grep -q deadline; then
      row "torch (compile)" SKIPPED "not run: the script's deadline is reached"
    elif [ $rc = 124 ]; then
      row "torch (compile)" UNAVAILABLE "torch.compile did not compile and step within 150 s"
    else
      row "torch (compile)" FAIL "$(why $rc "$t")"
    fi
  fi
fi
echo "gpu-check: ${SECONDS}s; table and logs in $results" | tee -a "$table"
exit $status
