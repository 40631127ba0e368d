#!/usr/bin/env bash
# docs/clusters.md, "Workers on other hosts", as one script. Two hosts made of network
# namespaces on this machine (needs root; no traffic leaves them): host A runs the driver
# (tests/multihost_job.py) with one local worker; a worker started by hand on host B joins,
# crashes, comes back, is cut off longer than EDT_HEARTBEAT_TIME_OUT, is told at the heal that
# it was removed, and joins once more. It ends with what the driver checked, and each change.
#
#   sudo bash examples/clusters/hand_started.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."                        # the repository: the job is a module of tests/
work=$(realpath -m "${1:-$(mktemp -d)}"); mkdir -p "$work"
tag=${FM_RECIPE_TAG:-fmr}                         # namespace names: ${tag}a, ${tag}b, ${tag}br
net=${FM_RECIPE_NET:-10.233.0}
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" EDT_HEARTBEAT_TIME_OUT=3 MH_PACE=${MH_PACE:-0.5}

source examples/clusters/hosts.sh
trap remove_hosts EXIT
make_hosts "$tag" "$net" a b

metrics=$work/run/logs/metrics.jsonl
generations() { if [ -f "$metrics" ]; then grep -c '"type": "generation"' "$metrics" || true; else echo 0; fi; }
at_least() { (( $(generations) >= $1 )); }
stepped_in() { [ -f "$metrics" ] && grep -qE "\"type\": \"train\".*\"generation\": $1," "$metrics"; }
b_is_empty() { [ -z "$(ip netns pids "${tag}b")" ]; }
worker_on_b() {  # what a user types on host B (in a subshell: not a job of this shell, whose kill it would report)
  (ip netns exec "${tag}b" "$py" -m fabric_model worker --join "$work/run/join.json" >> "$work/b.log" 2>&1 &)
}

touch "$work/pace"                                # steps are paced while it exists: time to act
FABRIC_MODEL_CPU_WORKERS=1 ip netns exec "${tag}a" \
  "$py" -m tests.multihost_job "$work/run" "$net.1" "$work/pace" "$work/final.pt" > "$work/driver.out" 2>&1 &
driver=$!
wait_for join.json 120 test -f "$work/run/join.json"
worker_on_b
wait_for "join of B" 120 at_least 2               # generation 1: A's worker and B's
wait_for "a step with B" 60 stepped_in 1
ip netns pids "${tag}b" | xargs -r kill -9        # B crashes
wait_for "generation without B" 60 at_least 3
worker_on_b                                       # B comes back
wait_for "second join of B" 120 at_least 4
wait_for "a step with B again" 60 stepped_in 3
ip -n "${tag}br" link set portb nomaster          # B is cut off ...
wait_for "removal of B" 60 at_least 5             # ... longer than EDT_HEARTBEAT_TIME_OUT
ip -n "${tag}br" link set portb master br0        # heal: B's worker is told it was removed; exits 4
wait_for "exit of B's fenced worker" 60 b_is_empty
worker_on_b                                       # B joins once more
wait_for "third join of B" 120 at_least 6
rm "$work/pace"                                   # let the run finish
wait "$driver"
"$py" examples/clusters/report.py "$work/run"
grep -E '^\[fabric-model\] (done|model):' "$work/driver.out"   # what the driver checked
