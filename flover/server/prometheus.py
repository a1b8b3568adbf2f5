"""The daemon's `stats` (flover/server/metrics.py) in Prometheus' text format, for the HTTP
front's `/metrics` (names modelled on vLLM's `vllm:*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from flover.server.metrics import HISTOGRAMS

PREFIX = "flover:"


class _Snapshot:
    """A collector over one `stats` answer (collected once, right away)."""

    def __init__(self, stats: dict, model: str):
        self.stats, self.model = stats, model

    def collect(self):
        s, m, names = self.stats, self.stats["metrics"], ["model_name"]
        yield from self._one_each(
            GaugeMetricFamily,
            (
                ("num_requests_running", "Requests in a slot", s["running"]),
                ("num_requests_waiting", "Requests waiting for a slot", s["waiting"]),
                ("kv_cache_usage_perc", "Share of the KV buffer's positions in use (0-1)", s["kv_use"]),
                ("kv_slots_used", "Slots of the contiguous KV buffer in use", s["slots_used"]),
                ("kv_slots_total", "Slots of the contiguous KV buffer", s["slots_total"]),
                ("kv_cache_bytes_per_token", "KV bytes one position takes over every layer", s["kv_bytes_per_token"]),
            ),
        )
        yield from self._one_each(
            CounterMetricFamily,
            (
                ("prompt_tokens", "Prompt tokens of finished requests", m["prompt_tokens"]),
                ("generation_tokens", "Generated tokens of finished requests", m["generation_tokens"]),
                ("iterations", "Engine iterations", s["iterations"]),
                ("shuffle_moves", "Slots moved by the memory shuffle", s["shuffle_moves"]),
                ("shuffle_bytes", "KV bytes copied by the memory shuffle", s["shuffle_bytes"]),
                (
                    "spec_decode_num_draft_tokens",
                    "Speculative draft tokens verified (rows computed for them)",
                    s["draft_tokens"],
                ),
                (
                    "spec_decode_num_accepted_tokens",
                    "Draft tokens accepted (each a token without an iteration of its own)",
                    s["accepted_tokens"],
                ),
                ("request_errors", "Requests that ended with an error", s["errors"]),
                ("requests_rejected", "Requests refused before running (invalid, overloaded, ...)", s["rejected"]),
            ),
        )
        p = s.get("prefix_cache")
        if p is not None:  # None: --prefix-cache 0. vLLM's names: queries and hits count prompt tokens
            yield from self._one_each(
                CounterMetricFamily,
                (
                    (
                        "prefix_cache_queries",
                        "Prompt tokens looked up in the prefix cache (whole blocks)",
                        p["queried_tokens"],
                    ),
                    (
                        "prefix_cache_hits",
                        "Prompt tokens found in the prefix cache (not prefilled)",
                        p["cached_tokens"],
                    ),
                    ("prefix_cache_lookups", "Admitted requests that looked up their prompt", p["lookups"]),
                    ("prefix_cache_lookup_hits", "... and found at least one block", p["hits"]),
                    ("prefix_cache_evicted_blocks", "Blocks evicted from the prefix cache (LRU)", p["evicted_blocks"]),
                ),
            )
            yield from self._one_each(
                GaugeMetricFamily,
                (
                    (
                        "prefix_cache_usage_perc",
                        "Share of the prefix cache's blocks in use (0-1)",
                        p["blocks_used"] / max(1, p["blocks_total"]),
                    ),
                ),
            )
        if p is not None and "disk_files" in p:  # --prefix-cache-dir
            yield from self._prefix_disk(p)
        if s.get("native_kernels"):  # an info metric: which kernels the native step runs
            info = GaugeMetricFamily(
                PREFIX + "native_kernels_info", "The native step's kernel family", labels=[*names, "kernels"]
            )
            info.add_metric([self.model, s["native_kernels"]], 1)
            yield info
        if s.get("expert_load"):  # a mixture of experts: rows routed to each expert of each layer
            rows = CounterMetricFamily(
                PREFIX + "expert_rows",
                "Token rows routed to each expert (routing skew: compare an expert with its layer's mean)",
                labels=[*names, "layer", "expert"],
            )
            for layer in s["expert_load"]:
                for expert, count in enumerate(layer["rows"]):
                    rows.add_metric([self.model, str(layer["layer"]), str(expert)], count)
            yield rows
        if s.get("pipeline"):  # pipeline stages: each stage's busy share (its bubble: the rest), bytes, plans
            pipe = s["pipeline"]
            busy = GaugeMetricFamily(
                PREFIX + "pipeline_stage_busy_ratio",
                "Share of the time since start each pipeline stage spent computing (1 - it: its bubble)",
                labels=[*names, "stage"],
            )
            sent = CounterMetricFamily(
                PREFIX + "pipeline_stage_sent_bytes",
                "Activation bytes each pipeline stage sent to the next",
                labels=[*names, "stage"],
            )
            for stage, (share, mib) in enumerate(zip(pipe["busy"], pipe["mib_sent"])):
                busy.add_metric([self.model, str(stage)], share)
                sent.add_metric([self.model, str(stage)], mib * 2**20)
            yield busy
            yield sent
            yield from self._one_each(
                GaugeMetricFamily,
                (("pipeline_plans_in_flight", "Iteration plans in the pipeline now", pipe["in_flight"]),),
            )
        if s.get("groups"):  # data-parallel groups: each one's figures under a `group` label
            for name, help_text, key, kind in (
                ("group_requests_routed", "Requests the front door sent to each group", "routed", CounterMetricFamily),
                ("group_requests_running", "Requests in a slot, per group", "running", GaugeMetricFamily),
                ("group_requests_waiting", "Requests waiting for a slot, per group", "waiting", GaugeMetricFamily),
                (
                    "group_load_tokens",
                    "Tokens still to compute for the requests routed to each group",
                    "load_tokens",
                    GaugeMetricFamily,
                ),
                ("group_iterations", "Engine iterations, per group", "iterations", CounterMetricFamily),
            ):
                family = kind(PREFIX + name, help_text, labels=[*names, "group"])
                for g in s["groups"]:
                    family.add_metric([self.model, str(g["group"])], g[key])
                yield family
        finished = CounterMetricFamily(
            PREFIX + "request_success", "Finished requests by finish reason", labels=[*names, "finished_reason"]
        )
        for reason, count in sorted(m["finished"].items()):
            finished.add_metric([self.model, reason], count)
        yield finished
        for name, h in m["histograms"].items():
            cumulative, buckets = 0, []
            for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            family = HistogramMetricFamily(PREFIX + name, HISTOGRAMS[name][1], labels=names)
            family.add_metric([self.model], buckets, h["sum"])
            yield family

    def _prefix_disk(self, p: dict):
        yield from self._one_each(
            CounterMetricFamily,
            (
                (
                    "prefix_cache_disk_hits",
                    "Lookups that took blocks from the prefix cache's directory",
                    p["disk_hits"],
                ),
                ("prefix_cache_disk_hit_tokens", "Prompt tokens those blocks held", p["disk_cached_tokens"]),
                ("prefix_cache_disk_blocks_written", "Blocks written to the directory", p["disk_blocks_written"]),
                (
                    "prefix_cache_disk_files_ignored",
                    "Files ignored: another model's, truncated or changed",
                    p["disk_files_ignored"],
                ),
                (
                    "prefix_cache_disk_writes_dropped",
                    "Blocks not written: the writer was behind",
                    p["disk_writes_dropped"],
                ),
            ),
        )
        yield from self._one_each(
            GaugeMetricFamily,
            (
                ("prefix_cache_disk_files", "Files in the prefix cache's directory", p["disk_files"]),
                ("prefix_cache_disk_bytes", "Their bytes (bounded by --prefix-cache-disk)", p["disk_bytes"]),
            ),
        )

    def _one_each(self, kind, rows):
        """A family of `kind` with this model's one sample, per (name, help, value) row."""
        for name, help_text, value in rows:
            family = kind(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family


def render(stats: dict, model: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model))
    return generate_latest(registry)
