#!/usr/bin/env bash
# One node's Ray, for scripts/slurm/polar_loop.sbatch: run inside an srun step, it works out
# this node's share of the allocation and execs `ray start --block`, so the Ray processes live
# and die with the step (Slurm ends the step, and everything under it, when the job ends).
#
#   ray_node.sh head NODE_IP PORT     the head: GCS on NODE_IP:PORT
#   ray_node.sh worker HEAD_ADDRESS   a worker that joins HEAD_ADDRESS (host:port)
#
# Read from the environment (the sbatch script exports them; srun passes them on):
#   POLAR_VENV           the virtual environment whose `ray` runs (same path on every node)
#   RAY_TMPDIR           Ray's files (sockets, logs, spilled objects): node-local, per job
#   POLAR_HEAD_SESSIONS  1: the head offers `polar_node` too (runs sessions); 0: workers only
#   POLAR_CPUS_PER_NODE, POLAR_GPUS_PER_NODE   override what this step was given
#   POLAR_RAY_START_ARGS more `ray start` flags for every node (ports on a shared node)
#   POLAR_RAY_HEAD_ARGS  more for the head only (--ray-client-server-port, --include-dashboard...)
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN   the cluster's token: read by Ray from the environment,
#                        never on argv (ps shows argv to every user of the node)
set -euo pipefail

role=${1:?usage: ray_node.sh head NODE_IP PORT | ray_node.sh worker HEAD_ADDRESS}
ray="${POLAR_VENV:?POLAR_VENV is not set}/bin/ray"

# CPUs: what Slurm gave this node, not what the machine has (Ray would count them all).
cpus=${POLAR_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(nproc)}}

# GPUs: the ones Slurm bound to this step (CUDA_VISIBLE_DEVICES); none if it bound none.
# Left to itself Ray would count every GPU of the machine, other jobs' included.
gpus=${POLAR_GPUS_PER_NODE:-}
if [[ -z $gpus ]]; then
  gpus=0
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != NoDevFiles ]]; then
    IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
    gpus=${#visible[@]}
  fi
fi

# Ray's files stay in this job's own directory, readable by this user only: two jobs on one
# node never share a session_latest, and other users never reach the sockets.
mkdir -p -m 700 "${RAY_TMPDIR:?RAY_TMPDIR is not set}"

# At the end of the job Slurm signals every process of the step at once, the GCS included, so
# Ray's drain-on-SIGTERM (made for Serve, unused here) would wait 30 s for a GCS that is gone.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

args=(start --block --num-cpus "$cpus" --num-gpus "$gpus" --disable-usage-stats)
case $role in
  head)
    args+=(--head --node-ip-address "${2:?NODE_IP}" --port "${3:?PORT}")
    # The dashboard (and `ray job submit`) stays on the head's loopback: Ray's default. Reach
    # it through an ssh tunnel, never by binding it to 0.0.0.0.
    sessions=${POLAR_HEAD_SESSIONS:-1}
    ;;
  worker)
    # The worker finds its own address: the one it reaches the head from.
    args+=(--address "${2:?HEAD_ADDRESS}")
    sessions=1
    ;;
  *)
    echo "ray_node.sh: unknown role '$role' (head or worker)" >&2
    exit 2
    ;;
esac
# `polar_node`: this node runs a gateway node (proxy + sandboxes) for the loop's sessions.
if [[ $sessions == 1 ]]; then
  args+=(--resources '{"polar_node": 1}')
fi
if [[ -n ${POLAR_RAY_START_ARGS:-} ]]; then
  read -ra extra <<<"$POLAR_RAY_START_ARGS"
  args+=("${extra[@]}")
fi
if [[ $role == head && -n ${POLAR_RAY_HEAD_ARGS:-} ]]; then   # flags `ray start` takes only with --head
  read -ra extra <<<"$POLAR_RAY_HEAD_ARGS"
  args+=("${extra[@]}")
fi

echo "ray_node.sh: $role on $(hostname -s): $cpus CPUs, $gpus GPUs, polar_node=$sessions, RAY_TMPDIR=$RAY_TMPDIR"
exec "$ray" "${args[@]}"
