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
[ $# -ge 3 ] || { echo "usage: data_parallel.sh HOSTFILE RANKS flover-command [args...]" >&2; exit 2; }
# the same mpirun as one engine over several nodes (hostfile.sh), with groups of TP ranks
RANKS_PER_NODE=${RANKS_PER_NODE:-8} exec "$(dirname "$0")/hostfile.sh" "$@" --tp "${TP:-1}"
