"""The native CPU step: `llama_forward.c` and its Python binding, `forward`."""
