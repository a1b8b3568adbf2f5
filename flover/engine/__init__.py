"""The step: `engine` (schedule -> runner.execute -> scheduler.update -> text), `scheduler` (owns
the requests), `output`
(the text half), `speculation` (prompt-lookup drafts), `prefix_cache` (the index)."""


def __getattr__(name: str):
    """`from flover.engine import Engine` loads torch on first use only (clients never do)."""
    if name in ("Engine", "LLM", "EngineStats", "PromptTooLong"):
        from flover.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'flover.engine' has no attribute {name!r}")
