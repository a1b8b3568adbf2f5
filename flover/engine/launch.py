"""Starting an engine in this process, for every caller (the command line, bench, demo): under
`mpirun -np N` every rank builds its shard of its group's engine (`tp`: N / T groups; default one
group of N; `pp` pipeline stages in each); the followers run their leader's iterations, the other
groups' leaders serve world rank 0's requests, and both get None back when it shuts down. World
rank 0 gets its engine, or with several groups EngineGroups."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Callable

from flover.config import EngineConfig

if TYPE_CHECKING:  # (the command line imports this module before torch: engine/interface.py loads it)
    from flover.engine.interface import ServingEngine

log = logging.getLogger("flover")


def is_follower_rank() -> bool:
    from flover.parallel.launch import launched_rank, launched_ranks

    return launched_ranks() > 1 and launched_rank() != 0


def ignore_stop_signals() -> None:
    """mpirun forwards SIGTERM/SIGINT/SIGUSR1 to every rank; only world rank 0 decides when to
    stop (it drains, then releases the others), so the other ranks ignore them."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def start_engine(
    config: Callable[[], EngineConfig],
    device: str,
    tp: int | None = None,
    pp: int = 1,
    serving: bool = False,
    on_world: Callable[[object], None] | None = None,
) -> "ServingEngine | None":
    """This process's engine, as the module says. `config()` is called once the ranks are launched
    (a rank's device depends on its number); `on_world(comm)` gets the world communicator (a failing
    rank aborts the whole job through it); `serving`: structured output's tokenizer view is built
    now, not on a running server's loop."""
    from flover.engine.engine import Engine
    from flover.engine.groups import EngineGroups, serve_group
    from flover.parallel.groups import Mailbox
    from flover.parallel.launch import launch_groups, launched_rank

    if launched_rank() != 0:  # from the start: rank 0 serves before the others have built their engines
        ignore_stop_signals()
    launch = launch_groups(device, tp, pp)
    if on_world is not None:
        on_world(launch.world)
    engine = Engine(config(), launch.comm, launch.pipe)
    if serving:
        engine.prepare_grammars(checked_elsewhere=launch.layout.index > 0)
    if not engine.is_leader or launch.layout.index > 0:
        ignore_stop_signals()  # (again, should the launcher not have said this rank's number)
        if engine.is_leader:
            serve_group(engine, Mailbox(launch.world), launch.layout.index)
        else:
            engine.follow()
        return None
    if launch.layout.count > 1:
        log.info(
            "data parallel: %d groups of %d rank(s), leaders at world ranks %s",
            launch.layout.count,
            engine.comm.size if engine.comm else 1,
            list(launch.layout.leaders),
        )
        return EngineGroups(engine, Mailbox(launch.world), launch.layout, launch.world)
    return engine
