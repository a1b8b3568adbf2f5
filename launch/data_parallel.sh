#!/usr/bin/env bash
# Several engines behind one front door (docs/data_parallel.md): NODES x RANKS_PER_NODE ranks in
# groups of TP, each group one engine inside one node; world rank 0 (on the first host) owns the
# ZeroMQ socket and the HTTP front and routes each request to a group.
#
#   cat hosts
#   node1 slots=8
#   node2 slots=8
#   TP=2 RANKS_PER_NODE=8 launch/data_parallel.sh hosts 16 serve --model /shared/models/llama \
#       --device cuda --bind tcp://0.0.0.0:5555 --curve-secret-key server.key_secret --http 8000
#       # 8 engines of 2 GPUs each, 4 per node
#
# On CPU servers: TP=1 and one rank per socket (or per NUMA node), e.g. RANKS_PER_NODE=2; each
# rank's torch threads default to the node's cores divided by its ranks. For restarts run this
# under a supervisor (systemd Restart=on-failure, or sbatch --requeue): a dead rank ends the job.
set -euo pipefail
hostfile=${1:?usage: data_parallel.sh HOSTFILE RANKS flover-command [args...]}
ranks=${2:?usage: data_parallel.sh HOSTFILE RANKS flover-command [args...]}
shift 2
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
exec mpirun -np "$ranks" --hostfile "$hostfile" --map-by ppr:"${RANKS_PER_NODE:-8}":node --bind-to none \
  -x PATH -x LD_LIBRARY_PATH -x NCCL_DEBUG python -m flover.apps.cli "$@" --tp "${TP:-1}"
