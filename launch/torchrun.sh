#!/usr/bin/env bash
# Start the Trident SPMD program (python -m launch.main) on this node with torchrun.
#
#   launch/torchrun.sh [options] [--] yaml/EXPERIMENT.yaml [key=value ...]
#
# Options:
#   --nnodes N             nodes in the job (default 1)
#   --node-rank R          this node's rank, 0..N-1 (default 0; a hint: the c10d rendezvous
#                          assigns the final group ranks)
#   --nproc-per-node G     ranks (GPUs) on this node (default: GPUs nvidia-smi lists, else 1)
#   --rdzv-endpoint H:P    c10d rendezvous host:port, a host every node reaches; the store runs
#                          there (default 127.0.0.1:29500, fine for one node)
#   --rdzv-id ID           rendezvous id shared by all nodes of one job (default trident)
#   --rollout-gpus K       disaggregated rollout on one node: K of its GPUs go to the SGLang
#                          servers, the ranks take the rest (default --nproc-per-node: the GPUs
#                          nvidia-smi lists minus K); adds actor_rollout_ref.rollout.mode=disaggregated,
#                          rollout.num_gpus=K and trainer.n_gpus_per_node to the overrides
#   --max-restarts N       restart the job up to N times when a rank fails (default 0: stop at the
#                          first failure); a restarted job resumes from the newest complete checkpoint
#                          (trainer.resume_mode=auto). With several nodes every node gives the same N.
#   --module M             the SPMD entry module (default launch.main)
#   --dry-run              print the command, run nothing (also: TRIDENT_DRY_RUN=1 in the
#                          environment, which reaches the copies srun starts)
#
# Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from torchrun; the yaml
# and the overrides are passed through unchanged. Environment: PYTHON (default .venv/bin/python of
# the repo, else python3), OMP_NUM_THREADS (default 1 per rank when unset).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nnodes=1
node_rank=0
nproc_per_node=""
rdzv_endpoint="127.0.0.1:29500"
rdzv_id="trident"
module="launch.main"
rollout_gpus=0
max_restarts=0
dry_run="${TRIDENT_DRY_RUN:-0}"

usage() { sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "launch/torchrun.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) nnodes="${2:?--nnodes needs a value}"; shift 2 ;;
    --node-rank) node_rank="${2:?--node-rank needs a value}"; shift 2 ;;
    --nproc-per-node) nproc_per_node="${2:?--nproc-per-node needs a value}"; shift 2 ;;
    --rdzv-endpoint) rdzv_endpoint="${2:?--rdzv-endpoint needs a value}"; shift 2 ;;
    --rdzv-id) rdzv_id="${2:?--rdzv-id needs a value}"; shift 2 ;;
    --max-restarts) max_restarts="${2:?--max-restarts needs a value}"; shift 2 ;;
    --module) module="${2:?--module needs a value}"; shift 2 ;;
    --rollout-gpus) rollout_gpus="${2:?--rollout-gpus needs a value}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done

[[ $# -ge 1 ]] || die "missing the experiment yaml (usage: launch/torchrun.sh [options] yaml/X.yaml [key=value ...])"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || die "--nnodes must be a positive integer, got '$nnodes'"
[[ "$node_rank" =~ ^[0-9]+$ && "$node_rank" -lt "$nnodes" ]] || die "--node-rank must be in 0..$((nnodes - 1)), got '$node_rank'"
[[ "$rdzv_endpoint" == *:* ]] || die "--rdzv-endpoint must be HOST:PORT, got '$rdzv_endpoint'"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "--max-restarts must be a non-negative integer, got '$max_restarts'"
[[ "$rollout_gpus" =~ ^[0-9]+$ ]] || die "--rollout-gpus must be a non-negative integer, got '$rollout_gpus'"
if [[ "$rollout_gpus" -gt 0 && "$nnodes" -ne 1 ]]; then
  die "--rollout-gpus places the servers on the trainer's node; with --nnodes $nnodes the servers would need nodes of their own, which is not built yet"
fi
if [[ -z "$nproc_per_node" ]]; then
  nproc_per_node="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
  [[ "$nproc_per_node" -gt 0 ]] || nproc_per_node=1
  if [[ "$rollout_gpus" -gt 0 ]]; then
    nproc_per_node=$((nproc_per_node - rollout_gpus))
    [[ "$nproc_per_node" -gt 0 ]] || die "--rollout-gpus $rollout_gpus leaves no GPU of this node to the trainer"
  fi
fi
[[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node must be a positive integer, got '$nproc_per_node'"
program=("$@")
if [[ "$rollout_gpus" -gt 0 ]]; then
  program+=("actor_rollout_ref.rollout.mode=disaggregated" "actor_rollout_ref.rollout.num_gpus=$rollout_gpus"
            "trainer.n_gpus_per_node=$nproc_per_node")
fi

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then python="$REPO_ROOT/.venv/bin/python"; else python=python3; fi
fi

command=(
  "$python" -m launch.torchrun
  --nnodes="$nnodes"
  --node-rank="$node_rank"
  --nproc-per-node="$nproc_per_node"
  --rdzv-backend=c10d
  --rdzv-endpoint="$rdzv_endpoint"
  --rdzv-id="$rdzv_id"
  # A lost rank breaks every collective: torchrun's agents stop all ranks and start them again.
  --max-restarts="$max_restarts"
  -m "$module" "${program[@]}"
)

if [[ "$dry_run" -eq 1 ]]; then
  printf '%q ' "${command[@]}" | sed 's/ $//'
  echo
  exit 0
fi
# The repo on the path, so `-m launch.main` resolves without an install; relative yaml paths keep
# meaning what they meant in the caller's directory.
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${command[@]}"
