"""The tensor half: `runner` (carries out a step plan), `kv_buffer` (the slot buffer and the
prefix pool), `sampler`, `cuda_graphs`."""
