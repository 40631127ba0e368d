#!/usr/bin/env bash
# docs/clusters.md, "On a Ray cluster", as one script. Four hosts made of network namespaces
# on this machine (needs root; no traffic leaves them), Ray's token authentication on: a Ray
# head on A (no CPUs; the driver, tests/multihost_job.py, runs there), nodes on B and C with a
# CPU each; B crashes, D joins, C is cut off longer than EDT_HEARTBEAT_TIME_OUT and healed.
# Every Ray node has its own --temp-dir; they are stopped by their pids, never `ray stop`.
#
#   sudo bash examples/clusters/ray_cluster.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."                        # the repository: the job is a module of tests/
work=$(realpath -m "${1:-$(mktemp -d)}"); mkdir -p "$work/home"
tag=${FM_RECIPE_TAG:-fmy}                         # namespace names: ${tag}a .. ${tag}d, ${tag}br
net=${FM_RECIPE_NET:-10.234.0}
py=${PYTHON:-python3}
ray=${RAY:-$(dirname "$(command -v "$py")")/ray}
# Every Ray process and the driver: token authentication with one token file, Ray's health
# checks declaring a silent node dead in ~4 s (not ~64 s), actors at normal priority, no usage
# report, and a home of their own (no Ray setting of this machine's user reaches the cluster).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HOME="$work/home" \
  RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$work/ray-token" RAY_USAGE_STATS_ENABLED=0 \
  RAY_health_check_period_ms=1000 RAY_health_check_timeout_ms=1000 RAY_health_check_failure_threshold=3 \
  RAY_worker_niceness=0 EDT_HEARTBEAT_TIME_OUT=3 EDT_START_TIME_OUT=120 MH_PACE=${MH_PACE:-0.5}
# Ray's sockets live in each node's --temp-dir, and a socket's path must be short (107 bytes).
raytmp=$(mktemp -d /tmp/fmray.XXXXXX)
"$py" -c 'import secrets; print(secrets.token_hex(32))' > "$work/ray-token"
chmod 600 "$work/ray-token"

source examples/clusters/hosts.sh
cleanup() { remove_hosts; rm -rf "$raytmp"; }   # and Ray's temp dirs
trap cleanup EXIT
make_hosts "$tag" "$net" a b c d

start_node() {  # start_node HOST INDEX RAY_START_OPTIONS...: what a user runs on that host
  local h=$1 i=$2
  shift 2
  (ip netns exec "$tag$h" "$ray" start --node-ip-address="$net.$i" --temp-dir="$raytmp/$h" \
    --disable-usage-stats --block "$@" > "$work/ray-$h.log" 2>&1 &)
}
training_on() { [ "$("$py" examples/clusters/report.py --hosts "$work/run")" = "$*" ]; }
worker_in() { ip netns pids "$tag$1" | xargs -r ps -o args= -p | grep -q "fabric_model worker"; }
no_worker_in() { ! worker_in "$1"; }
head_up() { ip netns exec "${tag}a" "$ray" status --address="$net.1:6379" > /dev/null 2>&1; }

start_node a 1 --head --port=6379 --num-cpus=0 --include-dashboard=false --ray-client-server-port=6380
wait_for "Ray head (see $work/ray-a.log)" 90 head_up
start_node b 2 --address="$net.1:6379" --num-cpus=1
start_node c 3 --address="$net.1:6379" --num-cpus=1
touch "$work/pace"                                # steps are paced while it exists: time to act
(ip netns exec "${tag}a" env RAY_ADDRESS="$net.1:6379" \
  "$py" -m tests.multihost_job "$work/run" - "$work/pace" "$work/final.pt" ray > "$work/driver.out" 2>&1
  echo $? > "$work/driver.status") &
wait_for "training on B and C" 180 training_on "$net.2" "$net.3"
sleep 2                                           # a few steps on both
ip netns pids "${tag}b" | xargs -r kill -9        # B crashes: its raylet, its actor, its worker
wait_for "training without B" 60 training_on "$net.3"
start_node d 4 --address="$net.1:6379" --num-cpus=1   # D joins: the pending actor is placed there
wait_for "training on C and D" 180 training_on "$net.3" "$net.4"
ip -n "${tag}br" link set portc nomaster          # C is cut off ...
wait_for "training without C" 60 training_on "$net.4"   # ... longer than EDT_HEARTBEAT_TIME_OUT
ip -n "${tag}br" link set portc master br0        # heal: C's worker is told why, or Ray ends it
wait_for "the end of C's worker" 60 no_worker_in c
rm "$work/pace"                                   # let the run finish
wait_for "the end of the run" 180 test -s "$work/driver.status"
if [ "$(cat "$work/driver.status")" != 0 ]; then tail -30 "$work/driver.out" >&2; exit 1; fi
"$py" examples/clusters/report.py "$work/run"
grep -E '^\[fabric-model\] (done|model):' "$work/driver.out"   # what the driver checked
