"""Several engines behind one front door: data-parallel groups of one `mpirun` job.

World rank 0 leads group 0 and holds `EngineGroups`, which the daemon and `flover run` use as they
use an Engine: a request is validated and tokenized there (the same model and limits everywhere),
then `Router` picks its group, and it is queued in rank 0's own engine or sent to that group's
leader, which runs `serve_group`: the events from rank 0 into its engine, one iteration, its
outputs back. Requests never move between groups; each group has its own slots, prefix cache and
step plans (docs/data_parallel.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

from flover.config import SamplingParams
from flover.engine.engine import Engine
from flover.engine.interface import EngineStats, ServingEngine
from flover.engine.prefix_cache import BLOCK_TOKENS
from flover.parallel.groups import GroupLayout, Mailbox
from flover.request import EmbedParams, Request, RequestInput, RequestOutput
from flover.structured.spec import Structured

log = logging.getLogger(__name__)

AFFINITY_BLOCKS = 4  # prompt prefixes of 1..4 blocks are remembered with the group that cached them
REMEMBERED = 4096  # prefixes remembered (least recently routed forgotten first)
SILENT = dict(
    running=0,
    waiting=0,
    kv_tokens=0,
    kv_use=0.0,
    iterations=0,
    last_step_tokens=0,
    shuffle_moves=0,
    shuffle_bytes=0,
    shuffle_seconds=0.0,
    draft_tokens=0,
    accepted_tokens=0,
    prefix_cache=None,
)


@dataclass
class Router:
    """Least loaded group (tokens still to compute: prompt + max_new_tokens - produced, over its
    requests in flight), unless the prompt starts like a recent one: then the group that has that
    prefix cached, as long as it has a free slot or no group has fewer requests in flight
    (affinity yields to load: a full group's backlog never grows while another's is shorter)."""

    groups: int
    slots: int  # per group
    load: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)  # requests sent to each group (counter)
    _prefixes: OrderedDict = field(default_factory=OrderedDict)  # prefix hash -> group
    _last: list[int] = field(default_factory=list)  # when each group last got a request (tie-break)
    _clock: int = 0

    def __post_init__(self) -> None:
        self.load, self.in_flight, self.routed, self._last = ([0] * self.groups for _ in range(4))

    def choose(self, token_ids: list[int], salt: str | None) -> int:
        keys = prefix_keys(token_ids, salt)
        group = next((self._prefixes[k] for k in reversed(keys) if k in self._prefixes), None)
        if group is None or (self.in_flight[group] >= self.slots and self.in_flight[group] > min(self.in_flight)):
            group = min(range(self.groups), key=lambda g: (self.load[g], self.in_flight[g], self._last[g]))
        for key in keys:
            self._prefixes[key] = group
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > REMEMBERED:
            self._prefixes.popitem(last=False)
        self._clock += 1
        self._last[group] = self._clock
        return group

    def started(self, group: int, tokens: int) -> None:
        self.load[group] += tokens
        self.in_flight[group] += 1
        self.routed[group] += 1

    def progressed(self, group: int, tokens: int, finished_with: int | None = None) -> None:
        """`tokens` produced; `finished_with`: the request ended, the load it still had."""
        self.load[group] -= tokens
        if finished_with is not None:
            self.load[group] -= finished_with
            self.in_flight[group] -= 1


def prefix_keys(token_ids: list[int], salt: str | None) -> list[bytes]:
    """Hashes of the prompt's first 1..AFFINITY_BLOCKS whole blocks (with its cache partition):
    what the prefix cache could reuse."""
    digest, keys = hashlib.blake2b((salt or "").encode(), digest_size=16), []
    for b in range(min(AFFINITY_BLOCKS, len(token_ids) // BLOCK_TOKENS)):
        digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS]))
        keys.append(digest.copy().digest())
    return keys


@dataclass
class Routed:
    """A request in flight on a group of rank 0's."""

    group: int
    prompt_token_ids: list[int]
    to_go: int  # its share of the group's load
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=dict)  # "logprobs" / "top_logprobs" so far, when asked


class EngineGroups(ServingEngine):
    """World rank 0's engine and the links to the other groups' leaders, as one ServingEngine for
    the front ends: requests are made by rank 0's engine's intake (the same model and limits
    everywhere), enqueue routes them."""

    def __init__(self, engine: Engine, mailbox: Mailbox, layout: GroupLayout, world):
        self.engine, self.mailbox, self.layout, self.comm = engine, mailbox, layout, world
        self.intake, self.groups = engine.intake, layout.count
        self.config = dataclasses.replace(engine.config, max_slots=engine.config.max_slots * layout.count)
        self.router = Router(layout.count, engine.config.max_slots)
        self.routed: dict[str, Routed] = {}
        self.group_stats: list[dict | None] = [None] * layout.count  # the latest each leader sent
        self._timed: deque[tuple[float, int]] = deque(maxlen=1024)  # the other groups' iterations, not yet read

    @property
    def embeddings_refused(self) -> str | None:
        return self.engine.embeddings_refused  # (every group runs the same model alike)

    def make_request(self, given: RequestInput) -> Request:
        """Rank 0's engine makes it (its ids: unique across the groups, which never make their own)."""
        return self.engine.make_request(given)

    def enqueue(self, request: Request) -> str:
        group = self.router.choose(request.prompt_token_ids, request.cache_salt)
        to_go = request.prompt_len + request.params.max_new_tokens
        if group == 0:
            self.engine.enqueue(request)
        else:
            age = time.perf_counter() - request.timings.arrival  # (clocks differ across nodes)
            self.mailbox.send(
                self.layout.leaders[group],
                {
                    "add": [
                        request.request_id,
                        request.prompt_token_ids,
                        asdict(request.params),
                        request.cache_salt,
                        request.stream,
                        age,
                        request.embed and asdict(request.embed),
                    ]
                },
            )
        self.router.started(group, to_go)
        self.routed[request.request_id] = Routed(group, request.prompt_token_ids, to_go)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        routed = self.routed.get(request_id)
        if routed is None:
            return False
        if routed.group == 0:
            return self.engine.abort(request_id)
        self.mailbox.send(self.layout.leaders[routed.group], {"cancel": request_id})
        return True  # its `cancelled` final comes back with that group's next outputs

    def step(self) -> list[RequestOutput]:
        """Rank 0's iteration (if it has work) and the outputs the other groups sent since."""
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        if not outputs and not self.engine.has_unfinished() and len(self.routed):
            self.mailbox.wait(0.002)  # only other groups are busy: wait for them without spinning
        for source, message in self.mailbox.receive():
            group = self.layout.leaders.index(source)
            self.group_stats[group] = message.get("stats") or self.group_stats[group]
            self._timed.extend(message.get("iterations", ()))
            outputs += [
                _output(wire, self.routed[wire["request_id"]])
                for wire in message.get("outputs", ())
                if wire["request_id"] in self.routed
            ]
        for out in outputs:
            self._account(out)
        return outputs

    def _account(self, out: RequestOutput) -> None:
        routed = self.routed.get(out.request_id)
        if routed is None:  # (every request comes through enqueue; nothing to count otherwise)
            return
        out.group = routed.group
        produced = len(out.new_token_ids)
        routed.to_go -= produced
        if out.finished:
            del self.routed[out.request_id]
            self.router.progressed(routed.group, produced, finished_with=max(0, routed.to_go))
        else:
            self.router.progressed(routed.group, produced)

    def has_unfinished(self) -> bool:
        return bool(self.routed) or self.engine.has_unfinished()

    @property
    def iterations(self) -> int:
        """Every group's (the other groups' as their leaders last said)."""
        return self.engine.iterations + sum(s["iterations"] for s in self.group_stats[1:] if s)

    def timed_iterations(self) -> list[tuple[float, int]]:
        """Rank 0's and the other groups' iterations since the last call: (seconds, rows) each."""
        timed = self.engine.timed_iterations() + list(self._timed)
        self._timed.clear()
        return timed

    @property
    def num_in_flight(self) -> int:
        return len(self.routed)

    def can_accept(self, max_waiting: int) -> bool:
        """Whether fewer than `max_waiting` requests wait for a slot, over all groups."""
        slots = self.engine.config.max_slots
        return sum(max(0, n - slots) for n in self.router.in_flight) < max_waiting

    def stats(self) -> EngineStats:
        """Rank 0's engine's figures summed with the other groups' latest (`groups`: each one's)."""
        mine = asdict(self.engine.stats())
        unheard = {**mine, **SILENT}  # a group that has sent nothing yet: rank 0's sizes, no activity
        per_group = [mine] + [s or unheard for s in self.group_stats[1:]]
        total = dict(mine)
        for key in (
            "running",
            "waiting",
            "slots_total",
            "kv_bytes",
            "kv_tokens",
            "iterations",
            "shuffle_moves",
            "shuffle_bytes",
            "shuffle_seconds",
            "draft_tokens",
            "accepted_tokens",
        ):
            total[key] = sum(s[key] for s in per_group)
        total["kv_use"] = sum(s["kv_use"] for s in per_group) / len(per_group)
        total["prefix_cache"] = _sum_prefix_caches([s["prefix_cache"] for s in per_group])
        total["expert_load"] = _sum_expert_loads([s.get("expert_load") for s in per_group])
        stats = EngineStats(**total)
        stats.groups = [
            {
                "group": g,
                "routed": self.router.routed[g],
                "in_flight": self.router.in_flight[g],
                "load_tokens": self.router.load[g],
                **{k: s[k] for k in ("running", "waiting", "iterations", "kv_tokens", "draft_tokens")},
            }
            for g, s in enumerate(per_group)
        ]
        return stats

    def shutdown(self) -> None:
        for leader in self.layout.leaders[1:]:
            self.mailbox.send(leader, {"stop": True})
        self.mailbox.flush()
        self.engine.shutdown()


def _output(wire: dict, routed: Routed) -> RequestOutput:
    """A group's output as rank 0's engine would have made it (the prompt, the tokens so far and
    their logprobs are kept here, not sent every iteration)."""
    routed.token_ids += wire["new_token_ids"]
    for name in ("logprobs", "top_logprobs"):
        if wire[name] is not None:
            kept = routed.logprobs.setdefault(name, [])
            kept += wire[name]
            wire[name] = list(kept)
    return RequestOutput(prompt_token_ids=routed.prompt_token_ids, token_ids=list(routed.token_ids), **wire)


def _sum_prefix_caches(caches: list[dict | None]) -> dict | None:
    caches = [c for c in caches if c]
    if not caches:
        return None
    alike = ("block_tokens", "block_bytes")  # (sizes, the same in every group)
    return {key: caches[0][key] if key in alike else sum(c[key] for c in caches) for key in caches[0]}


def _sum_expert_loads(loads: list[list[dict] | None]) -> list[dict] | None:
    """Each layer's rows per expert, summed over the groups (the same model in each)."""
    loads = [load for load in loads if load]
    if not loads:
        return None
    return [
        {"layer": layers[0]["layer"], "rows": [sum(counts) for counts in zip(*(layer["rows"] for layer in layers))]}
        for layers in zip(*loads)
    ]


def serve_group(engine: Engine, mailbox: Mailbox, group: int) -> None:
    """A group leader's life (groups 1..): rank 0's events into its engine, one iteration, the
    outputs back; idle, it waits for rank 0 without spinning. Ends on rank 0's stop."""
    log.info("group %d: serving for rank 0", group)
    compiling = GrammarWork(engine)
    while True:
        if not engine.has_unfinished():
            mailbox.wait(0.005 if compiling.pending else 0.5, max_sleep=0.005)
        for _, message in mailbox.receive():
            if "stop" in message:
                compiling.close()
                engine.shutdown()
                mailbox.flush()
                return
            if not compiling.hold(message):
                _apply(engine, mailbox, message)
        for message, error in compiling.ready():
            if error is not None:  # (its grammar does not compile, or costs too much: said once)
                _refuse(mailbox, message["add"][0], message["add"][1], error)
            else:
                _apply(engine, mailbox, message)
        if engine.has_unfinished():
            outputs = engine.step()
            timed = engine.timed_iterations()
            if outputs or timed:
                mailbox.send(
                    0,
                    {"outputs": [_wire(out) for out in outputs], "stats": asdict(engine.stats()), "iterations": timed},
                )


class GrammarWork:
    """A group leader's structured requests wait here while their grammar compiles on a worker
    thread (rank 0 compiled it within the limits already: the same time and memory), so that
    the group's running streams never wait on a compile. A cancel reaches one still waiting."""

    def __init__(self, engine: Engine):
        from concurrent.futures import ThreadPoolExecutor

        from flover.hardware import background_thread

        self.engine = engine
        self.pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flover-grammar", initializer=background_thread
        )
        self.pending: dict[str, tuple[dict, object]] = {}  # request id -> (its add message, the compile)

    def hold(self, message: dict) -> bool:
        """Whether `message` waits here (an add whose grammar is not compiled yet, or its cancel)."""
        if "cancel" in message and message["cancel"] in self.pending:
            self.pending[message["cancel"]][0]["cancelled"] = True
            return True
        structured = message.get("add", [None] * 3)[2].get("structured") if "add" in message else None
        if structured is None:
            return False
        try:
            structured = Structured.of(structured)
        except ValueError:
            return False  # _apply refuses it, naming the problem
        if self.engine.grammars.cached(structured):
            return False
        self.pending[message["add"][0]] = (message, self.pool.submit(self.engine.grammars.compile, structured))
        return True

    def ready(self) -> list[tuple[dict, Exception | None]]:
        """(add message, what its compile raised or None) of the compiles that ended, a cancel
        that came meanwhile after its add."""
        done = [rid for rid, (_, future) in self.pending.items() if future.done()]
        out = []
        for rid in done:
            message, future = self.pending.pop(rid)
            out.append((message, future.exception()))
            if message.pop("cancelled", False) and future.exception() is None:
                out.append(({"cancel": rid}, None))
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _wire(out: RequestOutput) -> dict:
    """An output as a group leader sends it: rank 0 keeps the prompt, the tokens so far and their
    logprobs (_output); a field copy, not asdict's deep one (a leader sends one per token)."""
    sent = {name: getattr(out, name) for name in _WIRED}
    new = len(out.new_token_ids)
    for name in ("logprobs", "top_logprobs"):  # (one per token: the new tokens' are the last)
        if sent[name] is not None:
            sent[name] = sent[name][len(sent[name]) - new :]
    return sent


_WIRED = [f.name for f in dataclasses.fields(RequestOutput) if f.name not in ("prompt_token_ids", "token_ids", "group")]


def _apply(engine: Engine, mailbox: Mailbox, message: dict) -> None:
    if "cancel" in message:
        engine.abort(message["cancel"])
        return
    request_id, token_ids, params, salt, stream, age, embed = message["add"]
    try:
        engine.enqueue(
            engine.make_request(
                RequestInput(
                    token_ids,
                    None if embed else SamplingParams(**params),  # (an embedding's are the intake's)
                    request_id,
                    stream=stream,
                    cache_salt=salt,
                    arrival_time=time.perf_counter() - age,
                    embed=EmbedParams(**embed) if embed else None,
                )
            )
        )
    except (ValueError, TypeError) as e:  # rank 0 validated it alike: a mismatch, said, not hidden
        _refuse(mailbox, request_id, token_ids, e)


def _refuse(mailbox: Mailbox, request_id: str, token_ids: list[int], e: Exception) -> None:
    log.error("group request %s refused: %s", request_id, e)
    refused = RequestOutput(
        request_id=request_id,
        prompt_token_ids=token_ids,
        new_token_ids=[],
        token_ids=[],
        text=None,
        finished=True,
        finish_reason="error",
        logprobs=None,
        timings={},
        error=f"refused by its group: {e}",
        error_code="invalid_request" if isinstance(e, ValueError) else None,
    )
    mailbox.send(0, {"outputs": [_wire(refused)]})
