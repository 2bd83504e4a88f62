#!/usr/bin/env bash
# gpu-check.sh - everything that needs a GPU, in one run, for a machine that
# has one:
#   1. configure and build pipec with CUDA (build-gpu/, native architecture)
#   2. GpuTest: every device kernel against the CPU kernels
#   3. equivalence: a GPT trained 3 steps on one rank and as a 2-stage pipeline
#      (two ranks sharing the GPU) gives the same weights; and the same as the
#      CPU backend; and over NCCL under mpirun (2 stages with two GPUs, else
#      one rank)
#   4. benchmark: a bf16 GPT stack on one GPU, 1F1B and ZB-H1 with the ranks
#      sharing the device: measured and predicted step time, TFLOP/s, MFU;
#      and one rank again without fused kernels (run --no-fuse)
#   5. optional: the same model in torch.distributed.pipelining, as a ratio
# and prints one table. A piece that cannot run is marked in the table; the
# script still goes on (exit status 1 if a check failed, 0 otherwise).
#
# Formulas: training FLOPs per step = 3 x M x (sum over stages of the plan's
# forward FLOPs per microbatch) (backward = 2x forward); TFLOP/s = FLOPs /
# steady step time; MFU = TFLOP/s / the GPU's dense bf16 peak. The steady
# step time is (N t_N - t_1) / (N - 1) from an N-step and a 1-step run, so
# that start-up (cuBLAS, the memory pool's first step) is not counted.
#
# The Python parts live beside it: gpu_check_compare.py (weights of two ONNX
# files), gpu_check_table.py (the tables' arithmetic), gpu_check_torch_bench.py.
#
# Usage: tools/gpu-check.sh
# Environment: PIPEC_GPU_BUILD (build-gpu), PIPEC_JOBS (16),
#   PIPEC_PEAK_TFLOPS (peak dense bf16 TFLOP/s; default from the GPU's name),
#   PIPEC_BENCH="layers hidden heads seq vocab batch microbatches steps"
#   (default "8 1024 16 512 8192 16 8 6"), PIPEC_SKIP_BUILD=1, PIPEC_TORCH=0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build="${PIPEC_GPU_BUILD:-build-gpu}"
jobs="${PIPEC_JOBS:-16}"
work="$build/gpu-check"
mkdir -p "$work"
pipec="$build/bin/pipec"
status=0
rows=()

# row CHECK RESULT DETAIL: one line of the final table.
row() {
  rows+=("$1|$2|$3")
  echo "== $1: $2${3:+ ($3)}"
  if [ "$2" = FAIL ]; then status=1; fi
}

# The last line of FILE matching PATTERN, for a table cell.
last() { grep -E "$2" "$1" 2>/dev/null | tail -1 | tr -d '\n' | cut -c1-110; }

#--- 0. the device -------------------------------------------------------------
gpu="none"
arch=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
  arch=${cap/./}
fi
echo "== GPU: ${gpu:-none} (compute capability ${cap:-?})"

#--- 1. build ------------------------------------------------------------------
if [ "${PIPEC_SKIP_BUILD:-0}" != 1 ]; then
  archFlag=()
  if [ -n "$arch" ]; then archFlag=(-DCMAKE_CUDA_ARCHITECTURES="$arch"); fi
  if PIPEC_JOBS="$jobs" tools/build-onnx.sh >"$work/configure.log" 2>&1 &&
     cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPIPEC_CUDA=ON \
      ${archFlag[@]+"${archFlag[@]}"} >>"$work/configure.log" 2>&1; then
    targets=(pipec GpuTest)
    # The CUDA plugin that `pipec run --backend cuda` loads, if the build has it.
    while read -r t; do targets+=("$t"); done < <(ninja -C "$build" -t targets all 2>/dev/null |
      sed -n 's/^\(pipec_cuda_backend\|pipec_cuda_plugin\): .*/\1/p' | sort -u)
    if cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$work/build.log" 2>&1; then
      row build ok "${targets[*]}"
    else
      row build FAIL "$(last "$work/build.log" 'error|FAILED')"
    fi
  else
    row build FAIL "configure: $(last "$work/configure.log" 'Error|error')"
  fi
fi
if ! grep -q 'PIPEC_HAVE_CUDA:INTERNAL=ON\|pipec: CUDA backend ON' "$work/configure.log" 2>/dev/null &&
   [ "${PIPEC_SKIP_BUILD:-0}" != 1 ]; then
  row cuda-toolkit FAIL "configured without CUDA: see $work/configure.log"
fi

#--- 2. GpuTest ----------------------------------------------------------------
if [ -x "$build/tests/GpuTest" ]; then
  timeout 900 "$build/tests/GpuTest" >"$work/gputest.log" 2>&1
  rc=$?
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$work/gputest.log" | tail -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$work/gputest.log" | tail -1)
  failed=$(grep -c '^\[  FAILED  \] .*\.' "$work/gputest.log")
  # Skipped for want of any device (not, say, of a second one).
  noDevice=$(grep -c '^no CUDA device$' "$work/gputest.log")
  detail="${passed:-0} passed, ${skipped:-0} skipped, $failed failed"
  if [ $rc -eq 0 ] && [ "$noDevice" -le 0 ]; then
    row GpuTest ok "$detail"
  elif [ $rc -eq 0 ]; then
    row GpuTest SKIPPED "$detail: no device seen by the tests?"
  else
    row GpuTest FAIL "$detail (rc $rc; $work/gputest.log)"
  fi
else
  row GpuTest UNAVAILABLE "not built"
fi

#--- helpers for pipec run ------------------------------------------------------
# Seconds from pipec's "12.34 ms" style.
seconds() { python3 tools/gpu_check_table.py seconds "$1" 2>/dev/null; }
# pipec run ... > LOG; prints "MEASURED PREDICTED" (seconds) from its summary.
runPipec() {
  local log=$1
  shift
  timeout 900 "$pipec" run "$@" >"$log" 2>&1 || return 1
  local line
  line=$(grep -E 'step\(s\) of .* per step, predicted' "$log" | tail -1)
  [ -n "$line" ] || return 1
  local measured predicted
  measured=$(echo "$line" | sed -E 's/.*: ([0-9.]+ [mu]?s) per step.*/\1/')
  predicted=$(echo "$line" | sed -E 's/.*predicted ([0-9.]+ [mu]?s).*/\1/')
  echo "$(seconds "$measured") $(seconds "$predicted")"
}


#--- 3. pipeline vs one rank ----------------------------------------------------
if [ -x "$pipec" ]; then
  gptFlags=(--layers 4 --hidden 256 --heads 8 --vocab 2000 --seq 64 --loss)
  trainFlags=(--steps 3 --seed 7 --optimizer sgd --lr 0.01 --quiet)
  if "$pipec" model gpt "${gptFlags[@]}" -o "$work/gpt.onnx" >"$work/model.log" 2>&1 &&
     "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-1.plan" --stages 1 --microbatches 4 \
       --batch 8 --hardware h200 --precision fp32 --optimizer sgd >>"$work/model.log" 2>&1 &&
     "$pipec" compile "$work/gpt.onnx" -o "$work/gpt-2.plan" --stages 2 --microbatches 4 \
       --batch 8 --hardware h200 --precision fp32 --optimizer sgd >>"$work/model.log" 2>&1; then
    ok1=0; ok2=0; okc=0
    timeout 900 "$pipec" run "$work/gpt-1.plan" --backend cuda --precision fp32 "${trainFlags[@]}" \
      --save-weights "$work/w-cuda-1.onnx" >"$work/run-1.log" 2>&1 && ok1=1
    timeout 900 "$pipec" run "$work/gpt-2.plan" --backend cuda --precision fp32 \
      --ranks-per-device 2 "${trainFlags[@]}" --save-weights "$work/w-cuda-2.onnx" \
      >"$work/run-2.log" 2>&1 && ok2=1
    timeout 900 "$pipec" run "$work/gpt-1.plan" --backend cpu "${trainFlags[@]}" \
      --save-weights "$work/w-cpu-1.onnx" >"$work/run-cpu.log" 2>&1 && okc=1
    if [ $ok1 = 1 ] && [ $ok2 = 1 ]; then
      if out=$(python3 tools/gpu_check_compare.py "$work/w-cuda-1.onnx" "$work/w-cuda-2.onnx" 1e-5 1e-6); then
        row "2-stage = 1-rank (cuda)" ok "$out"
      else
        row "2-stage = 1-rank (cuda)" FAIL "$out"
      fi
    else
      row "2-stage = 1-rank (cuda)" FAIL \
        "1 rank: $(last "$work/run-1.log" 'rror'); 2 ranks: $(last "$work/run-2.log" 'rror')"
    fi
    if [ $ok1 = 1 ] && [ $okc = 1 ]; then
      if out=$(python3 tools/gpu_check_compare.py "$work/w-cuda-1.onnx" "$work/w-cpu-1.onnx" 1e-3 1e-5); then
        row "cuda = cpu (1 rank)" ok "$out"
      else
        row "cuda = cpu (1 rank)" FAIL "$out"
      fi
    elif [ $ok1 = 1 ]; then
      row "cuda = cpu (1 rank)" UNAVAILABLE "cpu run: $(last "$work/run-cpu.log" 'rror')"
    else
      row "cuda = cpu (1 rank)" UNAVAILABLE "no cuda run"
    fi
    fallbacks=$(grep -ih 'fall' "$work/run-1.log" | head -1)
    [ -n "$fallbacks" ] && row "cpu fallbacks" info "$fallbacks"
    # NCCL (one process per rank under mpirun; NCCL cannot put two ranks of a
    # communicator on one GPU): the 2-stage plan on two GPUs, else one rank
    # (which still loads the plugin's NCCL transport and sets it up).
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if ! command -v mpirun >/dev/null 2>&1; then
      row "nccl = local" UNAVAILABLE "no mpirun"
    elif [ $ok1 != 1 ]; then
      row "nccl = local" UNAVAILABLE "no 1-rank cuda run to compare with"
    else
      if [ "$gpus" -ge 2 ]; then nPlan=2; else nPlan=1; fi
      if OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 900 \
           mpirun -np "$nPlan" "$pipec" run "$work/gpt-$nPlan.plan" --backend cuda --comm nccl \
           --precision fp32 "${trainFlags[@]}" --save-weights "$work/w-nccl.onnx" \
           >"$work/run-nccl.log" 2>&1; then
        if out=$(python3 tools/gpu_check_compare.py "$work/w-cuda-1.onnx" "$work/w-nccl.onnx" 1e-5 1e-6); then
          row "nccl = local ($nPlan rank)" ok "$out"
        else
          row "nccl = local ($nPlan rank)" FAIL "$out"
        fi
      else
        row "nccl = local ($nPlan rank)" FAIL "$(last "$work/run-nccl.log" 'rror')"
      fi
    fi
  else
    row equivalence FAIL "$(last "$work/model.log" 'rror')"
  fi
else
  row equivalence UNAVAILABLE "no $pipec"
fi

#--- 4. benchmark --------------------------------------------------------------
read -r bLayers bHidden bHeads bSeq bVocab bBatch bMicro bSteps <<<"${PIPEC_BENCH:-8 1024 16 512 8192 16 8 6}"
peak="${PIPEC_PEAK_TFLOPS:-}"
if [ -z "$peak" ]; then
  case "$gpu" in
    *H200* | *H100*) peak=989 ;;
    *A100*) peak=312 ;;
    *L40S*) peak=362 ;;
    *) peak="" ;;
  esac
fi
benchRows=()
pipecP1=""
if [ -x "$pipec" ] && "$pipec" model gpt --layers "$bLayers" --hidden "$bHidden" --heads "$bHeads" \
     --seq "$bSeq" --vocab "$bVocab" --loss -o "$work/bench.onnx" >"$work/bench-model.log" 2>&1; then
  # The second row is the first without fused kernels (run --no-fuse).
  for config in "1f1b 1" "1f1b 1 no-fuse" "1f1b 2" "zb-h1 2"; do
    read -r sched stages extra <<<"$config"
    plan="$work/bench-$sched-$stages.plan"
    label="$sched${extra:+ ($extra)}"
    if [ -n "$extra" ] && [ -f "$plan" ]; then
      flagsExtra=(--"$extra")
    else
      flagsExtra=()
    fi
    if [ ${#flagsExtra[@]} = 0 ] && ! "$pipec" compile "$work/bench.onnx" -o "$plan" \
         --stages "$stages" --schedule "$sched" --microbatches "$bMicro" --batch "$bBatch" \
         --hardware h200 --precision bf16 >"$work/bench-compile-$sched-$stages.log" 2>&1; then
      benchRows+=("$label|$stages|compile failed: $(last "$work/bench-compile-$sched-$stages.log" 'rror')|||")
      status=1
      continue
    fi
    flops=$("$pipec" report "$plan" --format json 2>/dev/null |
      python3 tools/gpu_check_table.py flops 2>/dev/null)
    common=(--backend cuda --precision bf16 --ranks-per-device "$stages" --seed 3
            ${flagsExtra[@]+"${flagsExtra[@]}"})
    tag="$sched-$stages${extra:+-$extra}"
    if timesN=$(runPipec "$work/bench-$tag-n.log" "$plan" "${common[@]}" --steps "$bSteps") &&
       times1=$(runPipec "$work/bench-$tag-1.log" "$plan" "${common[@]}" --steps 1); then
      read -r tN predicted <<<"$timesN"
      read -r t1 _ <<<"$times1"
      cells=$(python3 tools/gpu_check_table.py cells \
        "$bSteps" "$tN" "$t1" "$predicted" "${flops:-0}" "$peak")
      benchRows+=("$label|$stages|$cells")
      if [ "$stages" = 1 ] && [ -z "$extra" ]; then
        pipecP1=$(echo "$cells" | cut -d'|' -f1 | cut -d' ' -f1)
      fi
    else
      benchRows+=("$label|$stages|run failed: $(last "$work/bench-$tag-n.log" 'rror')||||")
      status=1
    fi
  done
else
  benchRows+=("-|-|model generation failed or no pipec||||")
fi

#--- 5. torch ------------------------------------------------------------------
torchCell="not importable"
if [ "${PIPEC_TORCH:-1}" = 1 ] && python3 tools/gpu_check_torch_bench.py --check 2>/dev/null; then
  if timeout 600 python3 tools/gpu_check_torch_bench.py "$bLayers" "$bHidden" "$bHeads" "$bSeq" "$bVocab" \
       "$bBatch" "$bMicro" "$bSteps" >"$work/torch.log" 2>&1; then
    torchMs=$(sed -n 's/^TORCH_STEP_MS //p' "$work/torch.log")
    torchMode=$(sed -n 's/^TORCH_MODE //p' "$work/torch.log")
    if [ -n "$pipecP1" ] && [ -n "$torchMs" ]; then
      torchCell="$torchMs ms/step ($torchMode); pipec 1-rank / torch = $(python3 tools/gpu_check_table.py ratio "$pipecP1" "$torchMs")"
    else
      torchCell="$torchMs ms/step (no pipec 1-rank time to compare)"
    fi
  else
    torchCell="failed: $(last "$work/torch.log" 'rror')"
  fi
elif [ "${PIPEC_TORCH:-1}" != 1 ]; then
  torchCell="skipped (PIPEC_TORCH=0)"
fi

#--- table ---------------------------------------------------------------------
echo
echo "GPU: ${gpu:-none}; logs in $work"
printf '%-26s %-11s %s\n' CHECK RESULT DETAIL
for r in "${rows[@]}"; do
  IFS='|' read -r c res d <<<"$r"
  printf '%-26s %-11s %s\n' "$c" "$res" "$d"
done
echo
echo "GPT L=$bLayers H=$bHidden heads=$bHeads seq=$bSeq vocab=$bVocab, batch $bBatch in $bMicro microbatches, bf16, ranks sharing one GPU (peak ${peak:-?} TFLOP/s)"
printf '%-16s %-3s %-12s %-12s %-9s %-7s %s\n' SCHED P STEP PREDICTED TFLOP/s MFU MEASURED/PRED
for r in "${benchRows[@]}"; do
  IFS='|' read -r s p step pred tf mfu ratio <<<"$r"
  printf '%-16s %-3s %-12s %-12s %-9s %-7s %s\n' "$s" "$p" "$step" "$pred" "$tf" "$mfu" "$ratio"
done
echo "torch (same GPT, bf16 autocast, 1 stage): $torchCell"
echo "(the prediction assumes one GPU per rank; with P ranks on one GPU the measured time is ~P x longer)"
exit $status
