"""Run under mpirun by the tensor-parallel tests: builds this rank's engine and prints one JSON
line with its shard shapes and weight memory (float64, so weights stay plain tensors)."""

import json
import sys

import torch

from flover.config import EngineConfig
from flover.engine.engine import Engine
from flover.parallel.launch import make_communicator

comm = make_communicator("cpu")
engine = Engine(EngineConfig(sys.argv[1], dtype="float64", max_slots=2, max_seq_len=64), comm)
layer = engine.model.layers[0]
weights = sum(p.numel() * p.element_size() for p in engine.model.parameters() if p is not None)
print(
    json.dumps(
        {
            "rank": comm.rank if comm else 0,
            "qkv": list(layer.qkv.shape),
            "o": list(layer.o.shape),
            "gate_up": list(layer.gate_up.shape),
            "down": list(layer.down.shape),
            "embed": list(engine.model.embed.shape),
            "kv_cache": list(engine.buffer.kv.shape),
            "weight_bytes": weights,
            "threads": torch.get_num_threads(),
        }
    ),
    flush=True,
)
if engine.comm is not None:
    if engine.is_leader:
        engine.shutdown()
    else:
        engine.follow()
