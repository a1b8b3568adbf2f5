#!/usr/bin/env bash
# Several nodes with a hostfile, one rank per GPU. Use this when one model needs the GPUs of
# more than one machine and you launch by hand (no Slurm). Every node needs the same checkpoint
# path and the same Python environment.
#
#   cat hosts
#   node1 slots=4
#   node2 slots=4
#   launch/hostfile.sh hosts 8 serve --model /shared/models/llama --device cuda
#
# Rank r runs on the node the hostfile places it on and uses that node's local GPU
# OMPI_COMM_WORLD_LOCAL_RANK (flover maps it itself). NCCL carries the activations; MPI
# carries only the small per-iteration step plans.
set -euo pipefail
hostfile=${1:?usage: hostfile.sh HOSTFILE RANKS flover-command [args...]}
ranks=${2:?usage: hostfile.sh HOSTFILE RANKS flover-command [args...]}
shift 2
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
exec mpirun -np "$ranks" --hostfile "$hostfile" --map-by ppr:"${RANKS_PER_NODE:-4}":node --bind-to none \
  -x PATH -x LD_LIBRARY_PATH -x NCCL_DEBUG python -m flover.apps.cli "$@"
