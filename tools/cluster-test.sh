#!/usr/bin/env bash
# cluster-test.sh - a 3-node cluster inside network namespaces, and pipec's
# runs and faults on it.
#
# Nodes node0..node2 are network namespaces, each with one veth whose peer
# sits on a bridge in a namespace of its own; addresses 10.231.7.1-3/24
# exist only inside them. mpirun runs in node0 with a hostfile of the three
# addresses (2 + 3 + 3 slots); Open MPI starts its remote daemons through a
# launch agent (plm_rsh_agent) that enters the node's namespace with a UTS
# namespace named for it, and both its transports are held to the bridge's
# subnet (btl_tcp_if_include, oob_tcp_if_include). The plan: a small GPT,
# 4 stages times --dp 2, 8 ranks.
#
# Scenarios, each asserted here (exit 1 and the reason on failure):
#   clean      5 steps: losses and weights equal a single-host mpirun's, bit
#              for bit; the summary names each rank's node
#   slow       node2's link held to 2 mbit/s (tbf): the same weights, a
#              longer step, and the measured timeline (--trace) puts the
#              time into communication; with 20 ms delay and 2% loss too
#              where the kernel has netem (else that part says it skipped)
#   stalled    one rank of node2 stopped (SIGSTOP): within --timeout (and 3
#              s of pings) a rank names it as the one that does not answer,
#              and the job ends
#   node-lost  node2's daemon and ranks killed (SIGKILL) mid-run: the job
#              ends, the last checkpoint is intact, --resume-if-exists then
#              finishes with the weights of an uninterrupted run
#   partition  node2's link taken down mid-run: the ranks that lost a peer
#              fail within --timeout naming its rank and node, the newest
#              intact checkpoint resumes to an uninterrupted run's weights;
#              mpirun itself returns, non-zero, once TCP gives up on the
#              unreachable daemon (net.ipv4.tcp_retries2=5 on every node:
#              about 13 s; with Linux's default of 15, Open MPI 4.1's abort
#              waits about 15 minutes)
#   all        each of them
#
# Usage: tools/cluster-test.sh SCENARIO      (exit 77: cannot make namespaces)
# Environment: PIPEC (build/bin/pipec). Everything it makes goes at exit,
# however it exits; every wait is bounded.
set -uo pipefail
cd "$(dirname "$0")/.."
pipec=$(realpath "${PIPEC:-build/bin/pipec}")
scenario=${1:-}
case $scenario in
  clean | slow | stalled | node-lost | partition | all) ;;
  *)
    echo "usage: tools/cluster-test.sh clean|slow|stalled|node-lost|partition|all" >&2
    exit 2
    ;;
esac

skip() {
  echo "cluster-test: SKIPPED: $*"
  exit 77
}
fail() {
  echo "cluster-test: $scenario: FAIL: $*"
  exit 1
}
[ "$(id -u)" = 0 ] || skip "not root: network namespaces need CAP_SYS_ADMIN"
for tool in ip tc unshare mpirun; do
  command -v $tool >/dev/null || skip "no $tool on this machine"
done
[ -x "$pipec" ] || fail "no pipec at $pipec (build first)"

id=pc$$
bridge=${id}b
subnet=10.231.7
work=$(mktemp -d "${TMPDIR:-/tmp}/pipec-cluster.XXXXXX")

cleanup() {
  local ns p
  for ns in ${id}n0 ${id}n1 ${id}n2 $bridge; do
    for p in $(ip netns pids $ns 2>/dev/null); do kill -9 $p 2>/dev/null; done
  done
  for ns in ${id}n0 ${id}n1 ${id}n2 $bridge; do ip netns del $ns 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

ip netns add $bridge 2>/dev/null || skip "cannot create a network namespace (ip netns add)"
ip -n $bridge link set lo up
ip -n $bridge link add br0 type bridge || skip "no bridge support in this kernel"
ip -n $bridge link set br0 up
for i in 0 1 2; do
  ns=${id}n$i
  ip netns add $ns || fail "ip netns add $ns"
  ip -n $ns link set lo up
  ip -n $ns link add eth0 type veth peer name p$i netns $bridge || skip "no veth support"
  ip -n $bridge link set p$i master br0
  ip -n $bridge link set p$i up
  ip -n $ns addr add $subnet.$((i + 1))/24 dev eth0
  ip -n $ns link set eth0 up
  # A peer that vanishes without a reset (a partition) fails a TCP
  # connection only when its retransmissions run out: Linux's default of
  # 15 retries takes about 15 minutes, and mpirun's abort waits that long
  # for the daemon it lost. 5 retries take about 13 s (the setting a
  # cluster's nodes need too; docs/CLUSTER.md).
  ip netns exec $ns sysctl -qw net.ipv4.tcp_retries2=5 ||
    skip "cannot set net.ipv4.tcp_retries2 in a namespace"
done

# The launch agent: "agent HOST COMMAND..." runs COMMAND in HOST's node.
cat >"$work/agent" <<EOF
#!/bin/sh
host=\$1
shift
case \$host in
  $subnet.1) i=0 ;;
  $subnet.2) i=1 ;;
  $subnet.3) i=2 ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec ${id}n\$i unshare --uts sh -c "hostname node\$i; \$*"
EOF
chmod +x "$work/agent"
printf '%s.1 slots=2\n%s.2 slots=3\n%s.3 slots=3\n' $subnet $subnet $subnet >"$work/hosts"

# The model and the plan: 4 stages x --dp 2 = 8 ranks.
"$pipec" model gpt --layers 4 --hidden 64 --heads 4 --vocab 128 --seq 16 --loss \
  -o "$work/gpt.onnx" >/dev/null || fail "pipec model"
"$pipec" compile "$work/gpt.onnx" -o "$work/gpt.plan" --stages 4 --dp 2 --microbatches 4 \
  --batch 16 --hardware cpu >/dev/null 2>&1 || fail "pipec compile"

asRoot="OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
# cluster SECONDS ARGS...: pipec run of the plan over the three nodes, from
# node0, ended after SECONDS; its output in $work/out, its status returned.
cluster() {
  local seconds=$1
  shift
  timeout -s KILL "$seconds" ip netns exec ${id}n0 unshare --uts sh -c "hostname node0; \
    $asRoot exec mpirun --hostfile $work/hosts --mca plm_rsh_agent $work/agent \
    --mca btl tcp,vader,self --mca btl_tcp_if_include $subnet.0/24 \
    --mca oob_tcp_if_include $subnet.0/24 -np 8 \
    $pipec run $work/gpt.plan --comm mpi $*" >"$work/out" 2>&1
}
# single ARGS...: the same plan under mpirun on this host.
single() {
  env $asRoot timeout -s KILL 120 mpirun --oversubscribe -np 8 "$pipec" run "$work/gpt.plan" \
    --comm mpi "$@" >"$work/single.out" 2>&1
}
# rankOf NODE: the pid of one of NODE's pipec ranks, once one runs (10 s).
rankOf() {
  local p tries
  for tries in $(seq 100); do
    for p in $(ip netns pids ${id}n$1); do
      if [ "$(cat /proc/$p/comm 2>/dev/null)" = pipec ]; then
        echo $p
        return 0
      fi
    done
    sleep 0.1
  done
  return 1
}
# stepsDone: the steps the running job printed so far.
stepsDone() {
  local n
  n=$(grep -c '^step ' "$work/out" 2>/dev/null)
  echo "${n:-0}"
}
waitSteps() {
  local tries
  for tries in $(seq 300); do
    [ "$(stepsDone)" -ge "$1" ] && return 0
    sleep 0.1
  done
  return 1
}
trainFlags="--optimizer sgd --lr 0.05 --seed 5"
# stepMs: the step the last run's summary reports, in milliseconds.
stepMs() {
  sed -n 's/.* rank(s) (mpi): \([0-9.]*\) \(ms\|s\) per step.*/\1 \2/p' "$work/out" |
    awk '{ print ($2 == "s") ? $1 * 1000 : $1 }'
}

clean() {
  cluster 120 --steps 5 $trainFlags --metrics $work/cluster.jsonl --save-weights $work/cluster.onnx ||
    fail "the cluster run failed: $(tail -3 "$work/out")"
  single --steps 5 $trainFlags --metrics "$work/single.jsonl" --save-weights "$work/single.onnx" ||
    fail "the single-host run failed: $(tail -3 "$work/single.out")"
  cmp -s "$work/cluster.onnx" "$work/single.onnx" || fail "the weights differ from a single host's"
  # The step and loss of each line; the rest is timing.
  losses() { grep -o '"step": [0-9]*, "loss": [^,}]*' "$1"; }
  [ "$(losses "$work/cluster.jsonl")" = "$(losses "$work/single.jsonl")" ] &&
    [ -n "$(losses "$work/single.jsonl")" ] || fail "the losses differ from a single host's"
  grep -q '^nodes: node0 ranks 0-1, node1 ranks 2-4, node2 ranks 5-7$' "$work/out" ||
    fail "the summary does not name the nodes: $(grep nodes: "$work/out")"
  echo "cluster-test: clean: ok: 5 steps on 3 nodes ($(grep '^nodes:' "$work/out")), losses and" \
    "weights equal a single host's bit for bit; $(stepMs) ms per step"
}

# traceSeconds FILE CATEGORIES: the seconds a measured trace's events of
# those categories (F, B, I, W, C: communication, O) add up to, all ranks.
traceSeconds() {
  python3 -c "import json, sys
events = json.load(open(sys.argv[1]))
events = events['traceEvents'] if isinstance(events, dict) else events
print('%.3f' % (sum(e.get('dur', 0) for e in events if e.get('cat', '') in sys.argv[2]) / 1e6))" "$1" "$2"
}

slow() {
  cluster 120 --steps 5 $trainFlags --save-weights $work/fast.onnx --trace $work/fast.json ||
    fail "the run failed"
  local fast
  fast=$(stepMs)
  ip netns exec ${id}n2 tc qdisc add dev eth0 root tbf rate 2mbit burst 32kbit latency 400ms ||
    skip "no tbf qdisc here"
  cluster 300 --steps 5 $trainFlags --save-weights $work/slow.onnx --trace $work/slow.json \
    --timeout 120 || fail "the run over the slow link failed: $(tail -3 "$work/out")"
  local slowStep
  slowStep=$(stepMs)
  cmp -s "$work/fast.onnx" "$work/slow.onnx" || fail "the weights changed over the slow link"
  awk -v f="$fast" -v s="$slowStep" 'BEGIN { exit !(s > 1.5 * f) }' ||
    fail "the step did not grow: $fast ms, then $slowStep ms"
  # The measured timelines say where the time went: into communication.
  local fastComm slowComm fastCompute slowCompute
  fastComm=$(traceSeconds "$work/fast.json" C)
  slowComm=$(traceSeconds "$work/slow.json" C)
  # (The optimizer step, O, waits for the step's label count from every
  # rank: it grows too.)
  fastCompute=$(traceSeconds "$work/fast.json" FBIW)
  slowCompute=$(traceSeconds "$work/slow.json" FBIW)
  awk -v fc="$fastComm" -v sc="$slowComm" -v fk="$fastCompute" -v sk="$slowCompute" \
    'BEGIN { exit !(sc > 10 * fc && sk < 2 * fk + 0.05) }' ||
    fail "the trace does not put the time into communication: communication $fastComm s ->" \
      "$slowComm s, compute $fastCompute s -> $slowCompute s"
  # Delay and loss need netem, which not every kernel has.
  ip netns exec ${id}n2 tc qdisc del dev eth0 root
  if ip netns exec ${id}n2 tc qdisc add dev eth0 root netem delay 20ms loss 2% 2>/dev/null; then
    cluster 300 --steps 5 $trainFlags --save-weights $work/lossy.onnx --timeout 120 ||
      fail "the run over the lossy link failed: $(tail -3 "$work/out")"
    cmp -s "$work/fast.onnx" "$work/lossy.onnx" || fail "the weights changed over the lossy link"
    echo "cluster-test: slow: ok: node2 with 20 ms delay and 2% loss (netem): the same weights," \
      "$(stepMs) ms per step"
  else
    echo "cluster-test: slow: netem SKIPPED: this kernel has no netem qdisc; delay and loss not tried"
  fi
  echo "cluster-test: slow: ok: node2 at 2 mbit/s: the same weights, $fast ms -> $slowStep ms per" \
    "step; the measured timelines' communication $fastComm s -> $slowComm s, forward and" \
    "backward $fastCompute s -> $slowCompute s (summed over ranks and steps)"
}

stalled() {
  local start pid took
  start=$(date +%s)
  cluster 60 --steps 100000 $trainFlags --timeout 5 &
  local job=$!
  waitSteps 3 || fail "the run did not start: $(tail -3 "$work/out")"
  pid=$(rankOf 2) || fail "no rank on node2"
  kill -STOP "$pid"
  wait $job
  local rc=$?
  took=$(($(date +%s) - start))
  [ $rc != 0 ] && [ $rc != 137 ] || fail "exit status $rc (0: it went on; 137: it hung)"
  grep -q "no progress for 5 s waiting for .*; rank [0-9]* (on node2) does not answer" \
    "$work/out" || fail "no rank named the stopped one: $(grep 'pipec: error' "$work/out" | head -3)"
  echo "cluster-test: stalled: ok: a rank of node2 stopped; the job ended (status $rc, $took s" \
    "from start) with: $(grep -m1 'does not answer' "$work/out")"
}

nodeLost() {
  mkdir -p "$work/ckpt"
  cluster 120 --steps 60 $trainFlags --timeout 10 --checkpoint $work/ckpt --checkpoint-every 5 &
  local job=$!
  waitSteps 12 || fail "the run did not get going: $(tail -3 "$work/out")"
  local p
  for p in $(ip netns pids ${id}n2); do kill -9 $p 2>/dev/null; done
  wait $job
  local rc=$?
  [ $rc != 0 ] && [ $rc != 137 ] || fail "exit status $rc after node2 was lost (137: it hung)"
  local done
  done=$(ls "$work/ckpt" | grep -c '^step-')
  [ "$done" -ge 2 ] || fail "no checkpoint was written before the loss"
  cluster 120 --steps 60 $trainFlags --timeout 10 --checkpoint $work/ckpt --checkpoint-every 5 \
    --resume-if-exists --save-weights $work/resumed.onnx ||
    fail "the relaunch failed: $(tail -3 "$work/out")"
  single --steps 60 $trainFlags --save-weights "$work/straight.onnx" || fail "the reference run"
  cmp -s "$work/resumed.onnx" "$work/straight.onnx" ||
    fail "the resumed run's weights differ from an uninterrupted run's"
  echo "cluster-test: node-lost: ok: node2 killed after step 12 or later; the job ended (status" \
    "$rc) with $done intact checkpoints; --resume-if-exists finished the 60 steps with the weights" \
    "of an uninterrupted run"
}

partition() {
  local start took
  start=$(date +%s)
  # (In a subshell whose stderr is dropped: the shell's own "Killed", were
  # the deadline to end mpirun, is not part of the result.)
  mkdir -p "$work/pckpt"
  (cluster 60 --steps 100000 $trainFlags --timeout 5 --checkpoint $work/pckpt \
    --checkpoint-every 5) 2>/dev/null &
  local job=$!
  waitSteps 7 || fail "the run did not get going: $(tail -3 "$work/out")"
  # A checkpoint first (step 5's, all 8 files), so that one exists to resume.
  for tries in $(seq 100); do
    [ "$(ls "$work/pckpt/step-5" 2>/dev/null | wc -l)" -ge 8 ] && break
    sleep 0.1
  done
  ip -n ${id}n2 link set eth0 down
  local cut
  cut=$(date +%s)
  # The ranks that lose a peer say so within --timeout (5 s), plus polling.
  local tries
  for tries in $(seq 200); do
    grep -Eq "\(on node2\) (does|do) not answer" "$work/out" && break
    sleep 0.1
  done
  took=$(($(date +%s) - cut))
  grep -Eq "no progress for 5 s waiting for .*\(on node2\) (does|do) not answer" "$work/out" ||
    fail "no rank named the lost node within 20 s: $(grep 'pipec: error' "$work/out" | head -3)"
  # --timeout, then at most 3 s of pings.
  [ $took -le 12 ] || fail "the lost node was named only after $took s"
  wait $job
  local rc=$?
  local ended
  ended=$(($(date +%s) - cut))
  [ $rc != 137 ] || fail "mpirun did not return within its 60 s deadline after the split"
  [ $rc != 0 ] || fail "mpirun returned 0 after the split"
  ended="mpirun returned (status $rc) $ended s after the split"
  # The last complete checkpoint is intact: a run resumes from it and ends
  # as an uninterrupted one.
  local last
  last=$(ls "$work/pckpt" | sed -n 's/^step-\([0-9]*\)$/\1/p' | sort -n | tail -1)
  [ -n "$last" ] || fail "no checkpoint was written before the split"
  single --steps $((last + 5)) $trainFlags --checkpoint "$work/pckpt" --resume-if-exists \
    --save-weights "$work/after-split.onnx" ||
    fail "no run resumes from the checkpoints: $(tail -2 "$work/single.out")"
  single --steps $((last + 5)) $trainFlags --save-weights "$work/no-split.onnx" ||
    fail "the reference run failed"
  cmp -s "$work/after-split.onnx" "$work/no-split.onnx" ||
    fail "the run resumed after the split ends differently from an uninterrupted one"
  ended="$ended; a run resumed from the newest intact checkpoint (of steps up to $last) and ended with an uninterrupted run's weights"
  echo "cluster-test: partition: ok: $took s after node2's link went down: $(grep -m1 \
    'not answer' "$work/out" | sed 's/^pipec: error: //'); $ended"
}

case $scenario in
  clean) clean ;;
  slow) slow ;;
  stalled) stalled ;;
  node-lost) nodeLost ;;
  partition) partition ;;
  all)
    clean
    slow
    stalled
    nodeLost
    partition
    ;;
esac
