#!/usr/bin/env bash
# A model larger than one node: PP pipeline stages across nodes, TP ranks inside each
# (docs/pipeline.md). Ranks are numbered node by node, so with RANKS_PER_NODE = TP every node holds
# one stage: its tensor-parallel all-reduces stay inside it and only the residual rows (4 x hidden
# bytes a token) cross the network. World rank 0 (the first host: the first stage) owns the
# ZeroMQ socket, the HTTP front, the scheduler and the sampler.
#
#   cat hosts
#   node1 slots=2
#   node2 slots=2
#   PP=2 TP=2 launch/pipeline.sh hosts serve --model /shared/models/llama-70b-Q4_K_M.gguf \
#       --bind tcp://0.0.0.0:5555 --curve-secret-key server.key_secret --http 8000
#       # 2 stages (one a node) of 2 ranks, each rank one socket's cores
#
# CPU ranks only for now (activations over MPI). More ranks than PP x TP make data-parallel
# groups of pipelines (RANKS below). A dead rank ends the job: run it under a supervisor.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: PP=P TP=T [RANKS=N] pipeline.sh HOSTFILE flover-command [args...]" >&2; exit 2; }
hostfile=$1
shift
pp=${PP:-2} tp=${TP:-1}
RANKS_PER_NODE=${RANKS_PER_NODE:-$tp} exec "$(dirname "$0")/hostfile.sh" "$hostfile" "${RANKS:-$((pp * tp))}" \
  "$@" --pp "$pp" --tp "$tp"
