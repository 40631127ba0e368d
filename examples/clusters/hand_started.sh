#!/usr/bin/env bash
# docs/clusters.md, "Workers on other hosts", as one script. Two hosts made of network
# namespaces on this machine (needs root; no traffic leaves them): host A runs the driver
# (tests/multihost_job.py) with one local worker; a worker started by hand on host B joins,
# crashes, comes back, is cut off longer than EDT_HEARTBEAT_TIME_OUT, is told at the heal that
# it was removed, and joins once more. Then the driver is SIGKILLed: both workers wait for it
# (FABRIC_MODEL_DRIVER_WAIT), and the same command again takes them back. It ends with what the
# driver checked, and each change.
#
#   sudo bash examples/clusters/hand_started.sh [WORK_DIR]
#
# B's first worker may connect before A's local worker is ready (then the first generation takes
# both) or after A trains alone (then it joins): the script holds either way. FM_RECIPE_JOIN=first
# or after forces one order (tests/test_recipes.py runs both); unset, they come as they come.
set -euo pipefail
cd "$(dirname "$0")/../.."                        # the repository: the job is a module of tests/
work=$(realpath -m "${1:-$(mktemp -d)}"); mkdir -p "$work"
tag=${FM_RECIPE_TAG:-fmr}                         # namespace names: ${tag}a, ${tag}b, ${tag}br
net=${FM_RECIPE_NET:-10.233.0}
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" EDT_HEARTBEAT_TIME_OUT=3 MH_PACE=${MH_PACE:-0.5}
export FABRIC_MODEL_DRIVER_WAIT=60                # how long workers wait for a vanished driver

source examples/clusters/hosts.sh
trap remove_hosts EXIT
make_hosts "$tag" "$net" a b

training_on() { [ "$("$py" examples/clusters/report.py --hosts "$work/run")" = "$*" ]; }  # has stepped
b_is_empty() { [ -z "$(ip netns pids "${tag}b")" ]; }
worker_on_b() {  # what a user types on host B (in a subshell: not a job of this shell, whose kill it would report)
  (ip netns exec "${tag}b" "$py" -m fabric_model worker --join "$work/run/join.json" >> "$work/b.log" 2>&1 &)
}
a=$net.1 b=$net.2
hold=
if [ "${FM_RECIPE_JOIN:-}" = first ]; then hold=$work/hold; touch "$hold"; fi  # A's worker waits in its set-up

start_driver() {  # the job's command on host A, resume="auto"; its console appended to driver.out
  FABRIC_MODEL_CPU_WORKERS=1 MH_HOLD=$hold ip netns exec "${tag}a" \
    "$py" -m tests.multihost_job "$work/run" "$a" "$work/pace" "$work/final.pt" auto >> "$work/driver.out" 2>&1 &
  driver=$!
}
restarted() { grep -q '"reason": "the driver restarted"' "$work/run/logs/metrics.jsonl"; }

touch "$work/pace"                                # steps are paced while it exists: time to act
start_driver
wait_for join.json 120 test -f "$work/run/join.json"
if [ "${FM_RECIPE_JOIN:-}" = after ]; then wait_for "training on A" 120 training_on "$a"; fi
worker_on_b
if [ -n "$hold" ]; then                           # B's worker has the job: the first generation waits for it
  wait_for "B's worker set up" 120 grep -q "intra-op threads" "$work/b.log"
  rm "$hold"; hold=
fi
wait_for "training on A and B" 120 training_on "$a" "$b"
ip netns pids "${tag}b" | xargs -r kill -9        # B crashes
wait_for "training on A without B" 60 training_on "$a"
worker_on_b                                       # B comes back
wait_for "training on A and B again" 120 training_on "$a" "$b"
ip -n "${tag}br" link set portb nomaster          # B is cut off ...
wait_for "training on A after B's removal" 60 training_on "$a"  # ... longer than EDT_HEARTBEAT_TIME_OUT
ip -n "${tag}br" link set portb master br0        # heal: B's worker is told it was removed; exits 4
wait_for "exit of B's fenced worker" 60 b_is_empty
worker_on_b                                       # B joins once more
wait_for "training on A and B once more" 120 training_on "$a" "$b"
kill -9 "$driver"; wait "$driver" 2>/dev/null || true  # the driver vanishes: its workers wait for it ...
wait_for "B's worker waiting" 60 grep -q "vanished" "$work/b.log"
start_driver                                      # ... and the same command again takes them back
wait_for "the restarted driver's generation" 60 restarted
wait_for "training on A and B after the restart" 120 training_on "$a" "$b"
rm "$work/pace"                                   # let the run finish
wait "$driver"
"$py" examples/clusters/report.py "$work/run"
grep -E '^\[fabric-model\] (done|model):' "$work/driver.out"   # what the driver checked
