#!/usr/bin/env bash
# One task of a Slurm job, as `srun` runs it on each node of the allocation (one task a node):
#
#   #SBATCH --nodes=3 --ntasks-per-node=1 --requeue
#   srun bash slurm_task.sh RUN_DIR python train.py ...
#
# Task 0 runs the training script: the driver and one local worker, listening on its node's
# address. Every other task waits for this allocation's driver to write RUN_DIR/join.json (the
# run directory is on the file system the nodes share) and joins it as a worker started by hand.
# The script calls train(..., run_dir=RUN_DIR, resume="auto"), so a requeued job goes on from
# its checkpoint. At the allocation's end Slurm sends every process SIGTERM: the driver saves
# a checkpoint, stops the workers and exits 143 (docs/elasticity.md, "Preemption").
set -euo pipefail
run_dir=$1
shift
if [ "${SLURM_PROCID:?run by srun}" = 0 ]; then
  # This node's first address, unless the job's environment names one (another network).
  FABRIC_MODEL_BIND_ADDRESS=${FABRIC_MODEL_BIND_ADDRESS:-$(hostname -I | awk '{print $1}')}
  export FABRIC_MODEL_BIND_ADDRESS FABRIC_MODEL_LOCAL_WORKERS=1
  exec "$@"
fi
# Slurm signals every process of the job, the worker among them: this shell waits for it and ends
# with its code (0 when the driver told it the job ended), not killed by the signal itself.
trap 'true' TERM
read -ra worker <<< "${FABRIC_MODEL_WORKER:-fabric-model}"   # the command, e.g. "python3 -m fabric_model"
until [ -f "$run_dir/join.json" ]; do sleep 0.5; done
# A join.json can be a previous allocation's, left by a SIGKILL: no driver answers there, and the
# worker exits 2 at once. Try again until this allocation's driver has written its own.
for _ in $(seq 120); do
  code=0
  "${worker[@]}" worker --join "$run_dir/join.json" || code=$?
  [ "$code" = 2 ] || exit "$code"
  sleep 1
done
exit 2
