#!/usr/bin/env bash
# One node, N tensor-parallel ranks (N = GPUs on the node, or a divisor of the CPU cores).
# Use this on a single multi-GPU server or to split a model over the cores of one CPU server.
#
#   launch/single_node.sh 2 run --model models/bench-124m --prompts p.jsonl --out r.jsonl
#   launch/single_node.sh 4 serve --model /models/llama --device cuda
#
# Rank r uses local GPU r with --device cuda; on CPU each rank gets cores/N torch threads.
set -euo pipefail
ranks=${1:?usage: single_node.sh RANKS flover-command [args...]}
shift
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,sm}   # shared memory only: fast start on one node
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
exec mpirun -np "$ranks" --bind-to none python -m flover.apps.cli "$@"
