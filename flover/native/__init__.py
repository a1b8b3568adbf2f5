"""The native CPU step: C files compiled for this CPU on first use (build.py), loaded and checked
against Python's declarations of their structs (abi.py), the weights laid out for the kernels
(weights.py, grids.py), and one fused iteration per call (forward.py)."""
