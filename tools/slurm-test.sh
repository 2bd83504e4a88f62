#!/usr/bin/env bash
# slurm-test.sh - tools/slurm/pipec.sbatch submitted to a Slurm of its own:
# a controller and a node daemon on this machine (Debian's slurm-wlm, with
# munge), configured in a temporary folder on their own ports, and gone at
# exit however it exits.
#
#   1. A 2-stage plan, 40 steps: the job completes and its weights equal a
#      direct mpirun's of the same plan, bit for bit.
#   2. The same job requeued mid-run (scontrol requeue, as a preemption
#      does): it continues from its newest intact checkpoint
#      (--resume-if-exists) and ends with the weights of the uninterrupted
#      run.
#
# Usage: tools/slurm-test.sh   (exit 77, with the reason, where Slurm or munge
# is not installed or its daemons cannot run here)
# Environment: PIPEC (build/bin/pipec).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
pipec=$(realpath "${PIPEC:-build/bin/pipec}")
skip() {
  echo "slurm-test: SKIPPED: $*"
  exit 77
}
fail() {
  echo "slurm-test: FAIL: $*"
  exit 1
}
[ "$(id -u)" = 0 ] || skip "not root: the test starts slurmd and munged"
for tool in slurmctld slurmd sbatch squeue scontrol munged munge mpirun; do
  command -v $tool >/dev/null || skip "no $tool (Debian: slurm-wlm, munge, openmpi-bin)"
done
[ -x "$pipec" ] || fail "no pipec at $pipec (build first)"

work=$(mktemp -d "${TMPDIR:-/tmp}/pipec-slurm.XXXXXX")
mkdir -p "$work"/{state,spool,log,run,bin}
started=()
cleanup() {
  local pid
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null; done
  sleep 0.5
  for pid in "${started[@]}"; do kill -9 "$pid" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

# munge: the machine's daemon if one runs, else one of ours.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [ -f /etc/munge/munge.key ] || skip "no /etc/munge/munge.key"
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null
  runuser -u munge -- munged --pid-file="$work/run/munged.pid" 2>"$work/log/munged.err" ||
    munged --force --pid-file="$work/run/munged.pid" 2>>"$work/log/munged.err" ||
    skip "munged does not start: $(head -1 "$work/log/munged.err")"
  started+=("$(cat "$work/run/munged.pid")")
  munge -n | unmunge >/dev/null 2>&1 || skip "munge does not authenticate"
fi

host=$(hostname)
port=$((20000 + $$ % 20000))
cpus=$(nproc)
cat >"$work/slurm.conf" <<EOF
ClusterName=pipectest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/run/slurmctld.pid
SlurmdPidFile=$work/run/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
JobRequeue=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
export SLURM_CONF=$work/slurm.conf
slurmctld || skip "slurmctld does not start: $(tail -1 "$work/log/slurmctld.log" 2>/dev/null)"
sleep 0.5
[ -f "$work/run/slurmctld.pid" ] && started+=("$(cat "$work/run/slurmctld.pid")")
slurmd || skip "slurmd does not start: $(tail -1 "$work/log/slurmd.log" 2>/dev/null)"
sleep 0.5
[ -f "$work/run/slurmd.pid" ] && started+=("$(cat "$work/run/slurmd.pid")")
ready=0
for tries in $(seq 100); do
  if sinfo -h -o %t 2>/dev/null | grep -q idle; then
    ready=1
    break
  fi
  sleep 0.2
done
echo "slurm-test: ($SECONDS s) the node is up"
[ $ready = 1 ] || skip "the node does not come up: $(tail -1 "$work/log/slurmd.log" 2>/dev/null)"
srun --mpi=list 2>&1 | grep -q pmix || skip "this Slurm has no pmix plugin"

# pipec on the job's PATH, as on a cluster.
ln -s "$pipec" "$work/bin/pipec"
export PATH=$work/bin:$PATH
"$pipec" model gpt --layers 4 --hidden 64 --heads 4 --vocab 128 --seq 16 --loss \
  -o "$work/gpt.onnx" >/dev/null || fail "pipec model"
"$pipec" compile "$work/gpt.onnx" -o "$work/gpt.plan" --stages 2 --microbatches 4 --batch 8 \
  --hardware cpu >/dev/null 2>&1 || fail "pipec compile"

# submit NAME STEPS: the sbatch script's job id; waitJob ID SECONDS: until it
# has left the queue.
submit() {
  mkdir -p "$work/$1"
  PIPEC_CHECKPOINT_EVERY=5 sbatch --parsable --nodes=1 --ntasks=2 --output="$work/$1.out" \
    "$root/tools/slurm/pipec.sbatch" "$work/gpt.plan" "$work/$1" "$2"
}
waitJob() {
  local tries
  for tries in $(seq $(($2 * 5))); do
    [ -z "$(squeue -h -j "$1" -o %T 2>/dev/null)" ] && return 0
    sleep 0.2
  done
  return 1
}

# 1. A job that runs through, against a direct mpirun.
job=$(submit through 40) || fail "sbatch refused the script"
waitJob "$job" 120 || fail "job $job did not finish in 120 s: $(tail -3 "$work/through.out")"
grep -q '^trained 40 step(s) of 1f1b on 2 rank(s) (mpi)' "$work/through.out" ||
  fail "job $job did not train 40 steps: $(tail -3 "$work/through.out")"
env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 mpirun \
  --oversubscribe -np 2 "$pipec" run "$work/gpt.plan" --comm mpi --steps 40 \
  --save-weights "$work/direct.onnx" >"$work/direct.out" 2>&1 || fail "the direct mpirun failed"
cmp -s "$work/through/trained.onnx" "$work/direct.onnx" ||
  fail "the job's weights differ from a direct mpirun's"
echo "slurm-test: ($SECONDS s) sbatch: ok: job $job trained 40 steps under srun --mpi=pmix, the weights of a" \
  "direct mpirun"

# 2. The same job requeued after step 15: it resumes and ends the same.
job=$(submit requeued 40) || fail "sbatch refused the script"
for tries in $(seq 300); do
  grep -q '^step 15/' "$work/requeued.out" 2>/dev/null && break
  sleep 0.1
done
grep -q '^step 15/' "$work/requeued.out" || fail "job $job did not reach step 15"
scontrol requeue "$job" || fail "scontrol requeue $job"
# Slurm holds a requeued job back a while before it may start again: once
# it is pending again, it may start now.
pending=0
for tries in $(seq 300); do
  state=$(squeue -h -j "$job" -o %T 2>/dev/null)
  if [ "$state" = PENDING ]; then
    pending=1
    scontrol update jobid="$job" StartTime=now 2>/dev/null
  fi
  [ $pending = 1 ] && [ "$state" != PENDING ] && break
  sleep 0.2
done
waitJob "$job" 180 || fail "the requeued job $job did not finish: $(tail -3 "$work/requeued.out")"
grep -q '^trained .* step(s) of 1f1b' "$work/requeued.out" ||
  fail "the requeued job did not finish: $(tail -3 "$work/requeued.out")"
restarts=$(scontrol show job "$job" 2>/dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p')
cmp -s "$work/requeued/trained.onnx" "$work/direct.onnx" ||
  fail "the requeued job's weights differ from the uninterrupted run's"
echo "slurm-test: ($SECONDS s) requeue: ok: job $job requeued after step 15 (restarts ${restarts:-?}), resumed" \
  "from its checkpoint and ended with the uninterrupted run's weights"
