"""Which layers a pipeline stage holds (flover/runner/pipeline.py runs them).

Stages own contiguous ranges of layers; the first also holds the embedding and, since the ring
of stages closes there (the leader's scheduler, grammars and sampler live on it), the final norm
and the LM head. The ranges are chosen so that the largest stage's parameters (its layers', the
first stage's head besides) are as small as they can be: every stage reads its weights once an
iteration, so the slowest stage sets the pipeline's pace.
"""

from __future__ import annotations

from dataclasses import dataclass

from flover.models.model_config import ModelConfig


@dataclass(frozen=True)
class StageLayout:
    index: int  # this stage, 0 .. count - 1
    count: int
    first_layer: int
    end_layer: int  # one past its last layer

    @property
    def has_ends(self) -> bool:
        """The first stage: embedding, final norm and LM head."""
        return self.index == 0

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    @classmethod
    def whole(cls, cfg: ModelConfig) -> "StageLayout":
        return cls(0, 1, 0, cfg.num_layers)

    @classmethod
    def build(cls, cfg: ModelConfig, index: int, count: int) -> "StageLayout":
        return cls(index, count, *cls.ranges(cfg, count)[index])

    @staticmethod
    def ranges(cfg: ModelConfig, count: int) -> list[tuple[int, int]]:
        """Every stage's (first, end) layers."""
        # a layer reading another's KV (Gemma 4) lies on that layer's stage: no cut between them
        cuttable = [all(cfg.kv_source(n) >= j for n in range(j, cfg.num_layers)) for j in range(cfg.num_layers + 1)]
        most = sum(cuttable[1:])  # (cuttable[num_layers]: the end, always)
        if cfg.kv_sources and count > most:
            raise ValueError(
                f"--pp {count}: a layer reading an earlier layer's KV shares its stage; this model "
                f"splits into at most {most} stages (--pp 1..{most})"
            )
        return split_layers(layer_parameters(cfg), end_parameters(cfg), count, cuttable)


def layer_parameters(cfg: ModelConfig) -> list[int]:
    """Each layer's parameter count (projections: what its iteration reads)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    counts = []
    for n in range(cfg.num_layers):
        if cfg.moe is not None and n in cfg.moe.layers:
            mlp = cfg.moe.experts * (3 * h * cfg.moe.intermediate + h)
        else:
            mlp = 3 * h * cfg.intermediate_size
        counts.append(attention + mlp)
    return counts


def end_parameters(cfg: ModelConfig) -> int:
    """What the first stage's ends weigh: the LM head, read whole every iteration as a layer is
    (the embedding is a lookup of a few rows; a tied GGUF head's codes serve both)."""
    return cfg.vocab_size * cfg.hidden_size


def split_layers(layers: list[int], ends: int, count: int, cuttable: list[bool] | None = None) -> list[tuple[int, int]]:
    """Contiguous (first, end) layer ranges, one per stage (each at least one layer), the first
    carrying `ends` besides its layers, that make the largest stage's sum the smallest.
    `cuttable[j]`: whether a stage may start at layer j (None: at any)."""
    n = len(layers)
    cuttable = cuttable or [True] * (n + 1)
    if not 1 <= count <= n:
        raise ValueError(f"--pp {count}: the model has {n} layers; each stage needs at least one (--pp 1..{n})")
    prefix = [0]
    for size in layers:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage sum that puts layers [0, i) on stages 0..s-1;
    # cut[s][i]: where stage s-1 then starts
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for s in range(1, count + 1):
        for i in range(s, n - (count - s) + 1):
            for j in range(s - 1, i):
                if j and not cuttable[j]:
                    continue
                stage = prefix[i] - prefix[j] + (ends if s == 1 else 0)
                worst = max(best[s - 1][j], stage)
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    ranges, end = [], n
    for s in range(count, 0, -1):
        start = cut[s][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]
