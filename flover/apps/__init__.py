"""The applications on top of the engine and the client: `cli`, `chat`, `demo`, `batch` (prompt
files, with `prompt_file` and `results_file`), `fetch`."""
