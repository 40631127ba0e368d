#!/usr/bin/env bash
# docs/clusters.md, "Slurm", as one script: this machine plays Slurm. Five hosts made of network
# namespaces (needs root; no traffic leaves them) share this machine's file system, as a
# cluster's nodes share one. The job (tests/multihost_job.py, train(..., resume="auto"), 3
# engines) is given an allocation of A, B and C; `srun` runs examples/clusters/slurm_task.sh on
# each: the driver and a local worker on A, workers started by hand on B and C. The allocation
# ends mid-run: every process of it gets SIGTERM (Slurm's signal at the time limit; SIGKILL
# after KillWait). The job is requeued on a smaller allocation, D and E, and goes on from its
# checkpoint on 2 workers. It ends with what the driver checked, and each change of workers.
#
#   sudo bash examples/clusters/slurm.sh [WORK_DIR]
#
# srun starts the tasks at once: B's and C's workers may connect before A's local worker is
# ready (the first generation takes all three) or join it after. FM_RECIPE_JOIN=first or after
# forces one order (tests/test_recipes.py runs both); unset, they come as they come.
set -euo pipefail
cd "$(dirname "$0")/../.."                        # the repository: the job is a module of tests/
work=$(realpath -m "${1:-$(mktemp -d)}"); mkdir -p "$work"
tag=${FM_RECIPE_TAG:-fms}                         # namespace names: ${tag}a .. ${tag}e, ${tag}br
net=${FM_RECIPE_NET:-10.235.0}
py=${PYTHON:-python3}
kill_wait=${KILL_WAIT:-30}                        # Slurm's KillWait: SIGTERM, then SIGKILL this much later
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" EDT_HEARTBEAT_TIME_OUT=3 MH_PACE=${MH_PACE:-0.5} \
  FABRIC_MODEL_WORKER="$py -m fabric_model"

source examples/clusters/hosts.sh
trap remove_hosts EXIT
make_hosts "$tag" "$net" a b c d e

task() {  # task ALLOCATION I N HOST: slurm_task.sh as task I of N on HOST, its exit code to a file
  local alloc=$1 i=$2 n=$3 h=$4 held=
  if ((i == 0)); then held=$hold; fi             # FM_RECIPE_JOIN=first: the driver's local worker waits
  (code=0
    ip netns exec "$tag$h" env SLURM_JOB_ID=42 SLURM_RESTART_COUNT=$((alloc - 1)) SLURM_PROCID=$i \
    SLURM_NODEID=$i SLURM_NNODES=$n ${held:+MH_HOLD=$held} bash examples/clusters/slurm_task.sh "$work/run" \
    "$py" -m tests.multihost_job "$work/run" - "$work/pace" "$work/final.pt" resume \
    > "$work/task-$alloc-$i.log" 2>&1 || code=$?
    echo $code > "$work/task-$alloc-$i.status") &
}
srun() {  # srun ALLOCATION HOST...: slurm_task.sh on each host, task i on the i-th
  local alloc=$1 i=0 h
  shift
  if [ "${FM_RECIPE_JOIN:-}" = after ] && ((alloc == 1)); then  # the workers' tasks once A trains alone
    task "$alloc" 0 $# "$1"
    wait_for "training on A" 180 training_on "$net.1"
    i=1
  fi
  for h in "${@:i+1}"; do task "$alloc" "$i" $# "$h"; i=$((i + 1)); done
}
end_allocation() {  # end_allocation HOST...: SIGTERM to every process there, SIGKILL after KillWait
  local h pids left start=$SECONDS t0
  t0=$(date +%s.%N)
  for h in "$@"; do ip netns pids "$tag$h" | xargs -r kill -TERM; done
  while ((SECONDS - start < kill_wait)); do
    pids=$(for h in "$@"; do ip netns pids "$tag$h"; done)
    if [ -z "$pids" ]; then
      echo "allocation: every process ended $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }') s after SIGTERM"
      return
    fi
    sleep 0.2
  done
  left=$(for h in "$@"; do ip netns pids "$tag$h"; done | xargs -r ps -o args= -p)
  echo "allocation: SIGKILL after $kill_wait s (KillWait) to:" $left
  for h in "$@"; do ip netns pids "$tag$h" | xargs -r kill -KILL; done
}
training_on() { [ "$("$py" examples/clusters/report.py --hosts "$work/run")" = "$*" ]; }
set_up() {  # set_up LOG...: each worker has its job (the driver counts it as starting)
  local f; for f in "$@"; do grep -qs "intra-op threads" "$f" || return 1; done; }
ended() {  # ended FILE...: every task of an allocation wrote its exit code
  local f; for f in "$@"; do [ -s "$f" ] || return 1; done; }

touch "$work/pace"                                # steps are paced while it exists: time to act
driver_log=$work/task-1-0.log                     # what wait_for shows when it gives up
hold=
if [ "${FM_RECIPE_JOIN:-}" = first ]; then hold=$work/hold; touch "$hold"; fi  # A's worker waits in its set-up
srun 1 a b c                                      # sbatch --nodes=3 --requeue: A, B and C
if [ -n "$hold" ]; then                           # B's and C's workers have the job: the first generation waits
  wait_for "B's and C's workers set up" 120 set_up "$work"/task-1-{1,2}.log
  rm "$hold"; hold=
fi
wait_for "training on A, B and C" 180 training_on "$net.1" "$net.2" "$net.3"
sleep 2                                           # a few steps on all three
end_allocation a b c                              # the time limit
wait_for "the end of allocation 1's tasks" 30 ended "$work"/task-1-{0,1,2}.status
echo "allocation 1: tasks exited $(cat "$work"/task-1-{0,1,2}.status | xargs) (A's driver: 143 is SIGTERM)"
tail -1 "$work/task-1-0.log"                      # what the driver said last
driver_log=$work/task-2-0.log
srun 2 d e                                        # requeued on D and E
wait_for "training on D and E" 180 training_on "$net.4" "$net.5"
rm "$work/pace"                                   # let the run finish
wait_for "the end of allocation 2's tasks" 180 ended "$work"/task-2-{0,1}.status
echo "allocation 2: tasks exited $(cat "$work"/task-2-{0,1}.status | xargs)"
"$py" examples/clusters/report.py "$work/run"
grep -E '^\[fabric-model\] (done|model):' "$work/task-2-0.log"   # what the driver checked
