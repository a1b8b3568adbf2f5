"""Gated DeltaNet linear attention (Qwen3.5 / 3.6, Qwen3-Next): a layer that keeps, per sequence,
a recurrent state instead of keys and values, fused into the iteration like attention.

Per token: q, k, v (and the output gate z, the decay input a and the write strength b) come from
one fused projection; q, k and v pass a causal depthwise conv of K taps (its last K - 1 inputs
are the slot's *conv state*) and SiLU; q and k are L2-normalised (q also scaled by 1/sqrt(dk));
each value head h then updates its state S [dk, dv] by the gated delta rule

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

with g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b); o is RMS-normed per head,
times SiLU(z), and projected out. Decode rows take one step of it; a prompt chunk runs the
chunked form (a UT transform per chunk of CHUNK tokens, one sequential step per chunk), the
same numbers within the dtype's rounding (docs/qwen3_5.md). The state is kept in float32 (float64
for float64 models), as transformers keeps it.

A sequence's state lives in the slot buffer beside the other layers' KV (runner/kv_buffer.py):
the shuffle moves it with its slot; a chunk that starts at position 0 starts from zeros, so a
slot's previous request never leaks into the next.

Tensor parallelism: value heads are split across ranks; in Hugging Face's grouped order each
rank keeps the key heads its value heads read, in llama.cpp's tiled order every rank keeps all
key heads (q and k are small); out_proj is row-parallel (the caller all-reduces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.attention import ForwardBatch
from flover.models.layers import Linear, cols, new_param, rows, whole
from flover.models.model_config import LinearAttentionConfig, ModelConfig
from flover.models.safetensors_reader import Source, WeightSpec
from flover.models.tp_layout import TPLayout

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and fla's default)
L2_EPS = 1e-6  # of q and k's L2 norm (as the fla kernels and transformers)


@dataclass(frozen=True)
class DeltaHeads:
    """This rank's heads of a DeltaNet layer: key heads [key_start, + key_count), value heads
    [value_start, + value_count)."""

    key_start: int
    key_count: int
    value_start: int
    value_count: int

    @classmethod
    def build(cls, la: LinearAttentionConfig, tp: TPLayout) -> "DeltaHeads":
        ranks, rank = tp.size, tp.rank
        if la.value_heads % ranks:
            raise ValueError(
                f"tensor parallelism over {ranks} ranks: {la.value_heads} linear-attention value heads "
                f"are not divisible by {ranks}"
            )
        values = la.value_heads // ranks
        if la.tiled:  # value head j reads key head j % key_heads: each rank's block must cover all of them
            if values % la.key_heads:
                raise ValueError(
                    f"tensor parallelism over {ranks} ranks: this GGUF file's {la.value_heads} value heads "
                    f"(llama.cpp's order) split into blocks of {values}, not a multiple of {la.key_heads} key heads"
                )
            return cls(0, la.key_heads, rank * values, values)
        if la.key_heads % ranks:
            raise ValueError(
                f"tensor parallelism over {ranks} ranks: {la.key_heads} linear-attention key heads "
                f"are not divisible by {ranks}"
            )
        keys = la.key_heads // ranks
        return cls(rank * keys, keys, rank * values, values)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrent state's and the delta rule's dtype: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def state_shapes(la: LinearAttentionConfig, tp: TPLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state, recurrent state) of one slot on this rank: [channels, K - 1], [value heads, dk, dv]."""
    heads = DeltaHeads.build(la, tp)
    channels = 2 * heads.key_count * la.key_dim + heads.value_count * la.value_dim
    return (channels, la.conv_kernel - 1), (heads.value_count, la.key_dim, la.value_dim)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayout, dtype: torch.dtype, device: torch.device):
        super().__init__()
        la = self.la = cfg.linear_attention
        self.heads = hd = DeltaHeads.build(la, tp)
        self.eps = cfg.norm_eps
        self.qk_size = hd.key_count * la.key_dim  # q's (and k's) width on this rank
        self.v_size = hd.value_count * la.value_dim
        channels = 2 * self.qk_size + self.v_size
        # q k v | z | b | a: one GEMM
        self.in_proj = Linear(channels + self.v_size + 2 * hd.value_count, cfg.hidden_size, False, dtype, device)
        self.conv = new_param(channels, 1, la.conv_kernel, dtype=dtype, device=device)  # [channels, 1, K]
        self.dt_bias = new_param(hd.value_count, dtype=dtype, device=device)
        # the decay rates: A_log as the checkpoint holds it (A = -exp(A_log), in float32 as the
        # reference computes it), or A itself in float32 (llama.cpp's ssm_a)
        stored_a = la.decay_stored == "A"
        self.A_log = None if stored_a else new_param(hd.value_count, dtype=dtype, device=device)
        self.A = new_param(hd.value_count, dtype=torch.float32, device=device) if stored_a else None
        self.norm = new_param(la.value_dim, dtype=dtype, device=device)  # the gated RMSNorm's, every head's
        self.out = Linear(cfg.hidden_size, self.v_size, False, dtype, device)

    # -- weights ---------------------------------------------------------------------------
    def weight_specs(self, cfg: ModelConfig, prefix: str) -> list[WeightSpec]:
        la, hd, h = self.la, self.heads, cfg.hidden_size
        att = f"{prefix}.linear_attn"
        key_total, v_total = la.key_heads * la.key_dim, la.value_heads * la.value_dim
        channels = 2 * key_total + v_total
        k0, kn = hd.key_start * la.key_dim, self.qk_size
        v0, vn = hd.value_start * la.value_dim, self.v_size

        def channel_rows(name: str, shape: tuple) -> tuple:  # this rank's q, k and v channels
            return (
                rows(name, shape, k0, kn),
                rows(name, shape, key_total + k0, kn),
                rows(name, shape, 2 * key_total + v0, vn),
            )

        def head_rows(name: str, per_head: int) -> Source:  # this rank's value heads' rows
            return rows(name, (la.value_heads * per_head, h), hd.value_start * per_head, hd.value_count * per_head)

        in_proj = (
            *channel_rows(f"{att}.in_proj_qkv.weight", (channels, h)),
            head_rows(f"{att}.in_proj_z.weight", la.value_dim),
            head_rows(f"{att}.in_proj_b.weight", 1),
            head_rows(f"{att}.in_proj_a.weight", 1),
        )
        per_head = lambda name: (rows(name, (la.value_heads,), hd.value_start, hd.value_count),)  # noqa: E731
        specs = [
            WeightSpec(self.in_proj.weight, in_proj),
            WeightSpec(self.conv, channel_rows(f"{att}.conv1d.weight", (channels, 1, la.conv_kernel))),
            WeightSpec(self.dt_bias, per_head(f"{att}.dt_bias")),
            WeightSpec(self.norm, (whole(f"{att}.norm.weight", (la.value_dim,)),)),
            WeightSpec(self.out.weight, (cols(f"{att}.out_proj.weight", (h, v_total), v0, vn),)),
        ]
        decay = (self.A, f"{att}.A") if self.A is not None else (self.A_log, f"{att}.A_log")
        specs.append(WeightSpec(decay[0], per_head(decay[1])))
        return specs

    # -- the forward -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden] (this rank's partial sum). state: this layer's
        share of the slot buffer (kv_buffer.RecurrentLayerState: conv [slots, channels, K - 1],
        recurrent [slots, value heads, dk, dv], read and written for the iteration's slots; their
        snapshots, written after the rows `batch.snapshots` names)."""
        la, hd = self.la, self.heads
        tokens = x.shape[0]
        widths = (2 * self.qk_size + self.v_size, self.v_size, hd.value_count, hd.value_count)
        mixed, z, b, a = self.in_proj(x).split(widths, dim=-1)
        mixed = F.silu(self._conv(mixed, batch, state.conv, state.snapshot_conv))  # [T, channels]
        q, k, v = mixed.split((self.qk_size, self.qk_size, self.v_size), dim=-1)
        q = q.reshape(tokens, hd.key_count, la.key_dim)
        k = k.reshape(tokens, hd.key_count, la.key_dim)
        v = v.reshape(tokens, hd.value_count, la.value_dim)
        beta = b.sigmoid()  # [T, value heads]
        g = self.decay_rates() * F.softplus(a.float() + self.dt_bias)  # [T, value heads], log of the decay
        o = self._delta_rule(q, k, v, g, beta, batch, state.state, state.snapshot_state)  # [T, heads, dv]
        o = self._gated_norm(o, z.reshape(tokens, hd.value_count, la.value_dim))
        return self.out(o.reshape(tokens, self.v_size))

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) [value heads], float32, as the reference rounds it (or A as the file holds it)."""
        return -self.A_log.detach().float().exp() if self.A is None else self.A

    def _conv(self, mixed: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor, snapshots) -> torch.Tensor:
        """The causal depthwise conv over each sequence's rows [T, channels] -> [T, channels],
        each slot's last K - 1 inputs kept in conv_state [slots, channels, K - 1]."""
        weight = self.conv  # [channels, 1, K]
        out = torch.empty_like(mixed)
        n = batch.num_decode
        if n:
            slots = _decode_slots(batch, mixed.device)
            window = torch.cat((conv_state[slots], mixed[:n, :, None]), dim=-1)  # [n, channels, K]
            out[:n] = (window * weight[:, 0]).sum(-1)
            conv_state[slots] = window[:, :, 1:]
            _keep_decoded(batch, snapshots, conv_state, slots)
        for span in batch.prefills:
            rows_ = mixed[span.token_start : span.token_start + span.length].t()  # [channels, L]
            kept = weight.shape[-1] - 1
            past = conv_state[span.slot] if span.start_pos > 0 else rows_.new_zeros(rows_.shape[0], kept)
            seq = torch.cat((past, rows_), dim=-1)  # [channels, K - 1 + L]
            conv = F.conv1d(seq[None], weight, groups=seq.shape[0])[0]  # [channels, L]
            out[span.token_start : span.token_start + span.length] = conv.t()
            conv_state[span.slot] = seq[:, -kept:]
            _keep_after(batch, span, snapshots, conv_state)
        return out

    def _delta_rule(self, q, k, v, g, beta, batch: ForwardBatch, ssm: torch.Tensor, snapshots) -> torch.Tensor:
        """q, k [T, key heads, dk], v [T, value heads, dv], g and beta [T, value heads] -> the
        outputs [T, value heads, dv] (v's dtype); ssm [slots, value heads, dk, dv] read and written."""
        wide = ssm.dtype
        q, k = _l2norm(q.to(wide)), _l2norm(k.to(wide))
        q, k = self._per_value_head(q), self._per_value_head(k)  # [T, value heads, dk]
        q = q * q.shape[-1] ** -0.5
        v, g, beta = v.to(wide), g.to(wide), beta.to(wide)
        out = torch.empty_like(v)
        n = batch.num_decode
        if n:
            slots = _decode_slots(batch, v.device)
            out[:n], ssm[slots] = delta_step(q[:n], k[:n], v[:n], g[:n], beta[:n], ssm[slots])
            _keep_decoded(batch, snapshots, ssm, slots)
        for span in batch.prefills:
            r = slice(span.token_start, span.token_start + span.length)
            start = ssm[span.slot] if span.start_pos > 0 else None
            out[r], ssm[span.slot] = chunked_delta_rule(q[r], k[r], v[r], g[r], beta[r], start)
            _keep_after(batch, span, snapshots, ssm)
        return out.to(self.norm.dtype)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[T, key heads, dk] -> [T, value heads, dk]: each value head's q/k head (grouped or tiled)."""
        repeat = self.heads.value_count // self.heads.key_count
        if repeat == 1:
            return x
        return x.repeat(1, repeat, 1) if self.la.tiled else x.repeat_interleave(repeat, dim=1)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output [T, heads, dv] times SiLU(z), rounded as the reference
        rounds it (normalised in float32, cast back, weighted, gated in float32, cast back)."""
        wide = o.to(torch.float32)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm * normed.to(o.dtype) * F.silu(z.to(torch.float32))).to(o.dtype)


def _decode_slots(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """The slot of each decode row."""
    if batch.decode_rows is not None:
        return batch.decode_rows
    return torch.arange(batch.num_decode, device=device)


def _keep_decoded(batch: ForwardBatch, snapshots: torch.Tensor | None, states: torch.Tensor, slots: torch.Tensor):
    """The states [slots, ...] of decode rows named in batch.snapshots into their snapshot rows."""
    for row, snapshot in batch.snapshots.items():
        if row < batch.num_decode:
            snapshots[snapshot] = states[slots[row]]


def _keep_after(batch: ForwardBatch, span, snapshots: torch.Tensor | None, states: torch.Tensor) -> None:
    """A prompt chunk's slot's state after it into its snapshot row, where batch.snapshots names one."""
    snapshot = batch.snapshots.get(span.token_start + span.length - 1)
    if snapshot is not None:
        snapshots[snapshot] = states[span.slot]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def delta_step(q, k, v, g, beta, state):
    """One token of each of n sequences: q, k [n, heads, dk], v [n, heads, dv], g, beta [n, heads],
    state [n, heads, dk, dv] -> (outputs [n, heads, dv], the new states)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # [n, heads, dv]: what S already says for k
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked_delta_rule(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """One sequence of L tokens: q, k [L, heads, dk], v [L, heads, dv], g, beta [L, heads];
    state [heads, dk, dv] or None (zeros) -> (outputs [L, heads, dv], the final state).

    Within a chunk of C tokens the C delta-rule updates are one UT transform (a unit lower
    triangular solve): with W the chunk's decayed k_beta k^T (strictly lower), the corrected
    values U = (I + W)^-1 (beta v), and the old state's share of them (I + W)^-1 (beta k
    exp(cumulative g)); then the chunk's outputs are its queries against the old state plus its
    causal within-chunk attention over the new values, and the state moves on once per chunk."""
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [heads, L', d]
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))  # [heads, L']
    n = (length + pad) // chunk
    q, k, v = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)  # [heads, n, C]: log decay from the chunk's start through each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [heads, n, C, C]
    # I + W (the solve reads the strictly lower part and takes the diagonal as ones)
    system = (k_beta @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [heads, n, C, dv]
    k_decayed = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )  # [heads, n, C, dk]
    within = (q @ k.transpose(-1, -2)) * pair  # causal within-chunk scores, decayed
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [heads, n, 1, 1]
    s = state.to(q.dtype) if state is not None else q.new_zeros(heads, dk, dv)
    out = torch.empty_like(v)
    for i in range(n):
        corrected = new_v[:, i] - k_decayed[:, i] @ s  # [heads, C, dv]
        out[:, i] = q_decayed[:, i] @ s + within[:, i] @ corrected
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ corrected
    return out.reshape(heads, n * chunk, dv)[:, :length].transpose(0, 1), s
