#!/usr/bin/env bash
# Bring up a Ray cluster inside a Slurm allocation, run one command against it, then stop it.
#
#   sbatch --nodes=8 --ntasks-per-node=1 --gpus-per-node=8 --exclusive \
#     launch/ray/start_cluster_in_slurm.sh -- python -m launch.ray_launcher yaml/X.yaml --num-gpus 64
#   bash launch/ray/start_cluster_in_slurm.sh --dry-run [--nodelist 'node[01-02]'] -- COMMAND ...
#
# The head runs on the first node of the allocation (port TRIDENT_RAY_PORT, default 6379), one
# worker on every other node, each with the node's GPUs (SLURM_GPUS_ON_NODE, default 8) and CPUs
# (SLURM_CPUS_ON_NODE). COMMAND runs here (the batch script runs on the first node) with
# RAY_ADDRESS=<head>:<port>. --dry-run prints the commands and runs nothing.
set -euo pipefail

dry_run=0
nodelist_arg=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --nodelist) nodelist_arg="${2:?--nodelist needs a value}"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "launch/ray/start_cluster_in_slurm.sh: missing the command to run (after --)" >&2; exit 2; }

if [[ -n "${SLURM_SUBMIT_DIR:-}" && -f "$SLURM_SUBMIT_DIR/launch/torchrun.sh" ]]; then
  REPO_ROOT="$SLURM_SUBMIT_DIR"
else
  REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
fi
PYTHON="${PYTHON:-$( [[ -x "$REPO_ROOT/.venv/bin/python" ]] && echo "$REPO_ROOT/.venv/bin/python" || echo python3 )}"
RAY="${RAY:-$(dirname "$PYTHON")/ray}"
[[ -x "$RAY" ]] || RAY=ray

nodelist="${nodelist_arg:-${SLURM_JOB_NODELIST:-node[01-02]}}"
mapfile -t hosts < <("$PYTHON" "$REPO_ROOT/launch/slurm/hostlist.py" "$nodelist")
head_node="${hosts[0]}"
port="${TRIDENT_RAY_PORT:-6379}"
gpus="${SLURM_GPUS_ON_NODE:-8}"
cpus="${SLURM_CPUS_ON_NODE:-16}"

run() {  # print in dry-run, else run
  if [[ "$dry_run" -eq 1 ]]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi
}

if [[ "$dry_run" -eq 1 ]]; then
  head_ip="<ip of $head_node>"
  echo "# head $head_node, workers ${hosts[*]:1}"
else
  head_ip="$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')"
fi
address="$head_ip:$port"

cleanup() {
  [[ "$dry_run" -eq 1 ]] && return
  srun --nodes="${#hosts[@]}" --ntasks-per-node=1 "$RAY" stop --force >/dev/null 2>&1 || true
  kill $(jobs -p) 2>/dev/null || true
}
trap cleanup EXIT

# --block keeps each srun step alive for as long as its Ray node runs.
if [[ "$dry_run" -eq 1 ]]; then
  run srun --nodes=1 --ntasks=1 -w "$head_node" "$RAY" start --head --node-ip-address="$head_ip" --port="$port" \
    --num-gpus="$gpus" --num-cpus="$cpus" --block
else
  run srun --nodes=1 --ntasks=1 -w "$head_node" "$RAY" start --head --node-ip-address="$head_ip" --port="$port" \
    --num-gpus="$gpus" --num-cpus="$cpus" --block &
  # wait until the head answers before workers try to join
  for _ in $(seq 60); do "$RAY" status --address="$address" >/dev/null 2>&1 && break; sleep 5; done
fi
for worker in "${hosts[@]:1}"; do
  if [[ "$dry_run" -eq 1 ]]; then
    run srun --nodes=1 --ntasks=1 -w "$worker" "$RAY" start --address="$address" --num-gpus="$gpus" --num-cpus="$cpus" --block
  else
    run srun --nodes=1 --ntasks=1 -w "$worker" "$RAY" start --address="$address" --num-gpus="$gpus" --num-cpus="$cpus" --block &
  fi
done
if [[ "$dry_run" -eq 1 ]]; then
  printf 'RAY_ADDRESS=%q ' "$address"; printf '%q ' "$@" | sed 's/ $//'; echo
  exit 0
fi
# all GPUs registered before the job places its workers
for _ in $(seq 60); do
  "$PYTHON" -c "import ray, sys; ray.init(address='$address', logging_level='ERROR'); sys.exit(ray.cluster_resources().get('GPU', 0) < ${#hosts[@]} * $gpus)" 2>/dev/null && break
  sleep 5
done
RAY_ADDRESS="$address" "$@"
