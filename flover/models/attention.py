"""Selective batching: everything but attention runs over the fused token matrix; attention is
split into one batched decode call over the live slot range and one call per prefill chunk.

Token order inside an iteration's matrix: first one decode token per decoding request (in slot
order), then the prefill chunks one after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flover.models.kv_codes import CodeRows, code_scores, code_values


@dataclass(frozen=True)
class PrefillSpan:
    token_start: int  # row of the chunk's first token in the token matrix
    length: int
    slot: int
    start_pos: int  # position of the chunk's first token in its sequence


@dataclass
class ForwardBatch:
    """Everything one fused forward pass needs to know about the iteration's tokens."""

    input_ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] position of each token in its sequence
    write_slots: torch.Tensor  # [T] slot whose KV row each token writes
    num_decode: int  # rows [0, num_decode) are decode tokens
    decode_span: int  # decode attention covers slots [0, decode_span)
    decode_rows: torch.Tensor | None  # [num_decode] slot of each decode token; None = slots 0..num_decode-1
    span_lens: torch.Tensor | None  # [decode_span] keys visible to each slot's query (>= 1)
    max_decode_len: int
    prefills: list[PrefillSpan]
    sample_rows: torch.Tensor  # [B] rows whose next-token logits are wanted
    # decode rows that carry speculative drafts (a slot's later positions, speculation.py): only
    # the native step attends per row; the decode attention here would not see them
    draft_rows: int = 0
    # recurrent layers: token row -> prefix-cache snapshot row their states go to after that row
    snapshots: dict[int, int] = field(default_factory=dict)
    # the same rows for the sliding-window layers when they keep only their window
    # (runner/kv_window.py): positions, lengths and chunk starts relative to each slot's base
    window: ForwardBatch | None = None
    # embeddings: rows whose final normed hidden states are wanted, and those states [P, hidden]
    # (the forward fills `pooled`: an output, beside the logits it returns)
    pool_rows: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    token_types: torch.Tensor | None = None  # [T] (an encoder's) 1 for a pair's second part; None: all 0
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[decode_span, 1, 1, max_decode_len] True where a key must be ignored."""
        if window not in self._masks:
            keys = torch.arange(self.max_decode_len, device=self.span_lens.device)
            lens = self.span_lens[:, None]
            masked = keys[None, :] >= lens
            if window is not None:
                masked |= keys[None, :] < lens - window
            self._masks[window] = masked[:, None, None, :]
        return self._masks[window]


@dataclass(frozen=True)
class AttentionOptions:
    scores_dtype: torch.dtype | None = None  # None = the model dtype; GPT-J forces float32
    window: int | None = None  # sliding-window size, None = full causal attention
    # Decode attention entirely in float32 for 16-bit models: on CPU a bfloat16 batched matmul of
    # decode shapes costs more than its float32 twin (the K/V slices are small to widen), and the
    # result is the more exact one. Prefill keeps the model dtype. (Not on CUDA: there the
    # widening would double the KV bytes read.)
    decode_in_float32: bool = False
    scale: float | None = None  # of the scores; None: 1 / sqrt(head_dim) (Gemma 3: query_pre_attn_scalar ** -0.5)
    # gpt-oss: a learned logit per query head [heads] in each softmax's denominator (its weight dropped)
    sinks: torch.Tensor | None = None
    # (EmbeddingGemma) a whole input's rows see each other both ways; within `window` on either side
    bidirectional: bool = False


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
) -> None:
    """Store every token's K/V at (its slot, its position). k_cache: [slots, kv_heads, seq, head_dim]."""
    k_cache[batch.write_slots, :, batch.positions] = k  # k: [T, kv_heads, head_dim]
    v_cache[batch.write_slots, :, batch.positions] = v


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, opts: AttentionOptions
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]. K/V of this iteration are already cached
    (a tensor, or --kv-dtype's codes: models/kv_codes.KVCodes, read as the range attention takes)."""
    outputs = []
    if batch.num_decode:
        rows = (slice(None, batch.decode_span), slice(None), slice(None, batch.max_decode_len))
        outputs.append(_decode(q[: batch.num_decode], k_cache[rows], v_cache[rows], batch, opts))
    for span in batch.prefills:
        q_span = q[span.token_start : span.token_start + span.length]
        rows = (span.slot, slice(None), slice(None, span.start_pos + span.length))
        outputs.append(_prefill(q_span, k_cache[rows], v_cache[rows], span, opts))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _softmax_weights(
    scores: torch.Tensor,
    mask: torch.Tensor,
    head_dim: int,
    q_dtype: torch.dtype,
    v_dtype: torch.dtype,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """scores [..., heads of a kv head, queries, keys]; sinks [kv heads, heads of one, 1, 1] or None."""
    scores = scores / math.sqrt(head_dim) if scale is None else scores * scale
    # Softmax at least in float32 (wider if the model is float64), as transformers does.
    softmax_dtype = torch.promote_types(torch.promote_types(scores.dtype, q_dtype), torch.float32)
    scores = scores.to(softmax_dtype).masked_fill_(mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(v_dtype)
    sink = sinks.to(softmax_dtype).expand(*scores.shape[:-1], 1)  # each head's sink beside its keys
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1].to(v_dtype)


def _scores(q: torch.Tensor, k: torch.Tensor | CodeRows, dtype: torch.dtype) -> torch.Tensor:
    """q [..., queries, d] x k [..., keys, d] -> [..., queries, keys] (codes: kv_codes.code_scores)."""
    return code_scores(q, k) if isinstance(k, CodeRows) else torch.matmul(q, k.to(dtype).transpose(-1, -2))


def _weighed(weights: torch.Tensor, v: torch.Tensor | CodeRows) -> torch.Tensor:
    return code_values(weights, v) if isinstance(v, CodeRows) else torch.matmul(weights, v)


def _fused_kernel(q: torch.Tensor, opts: AttentionOptions, decode: bool, codes: bool = False) -> bool:
    """PyTorch's fused attention (scaled_dot_product_attention) in place of the matmul / softmax /
    matmul sequence. On CPU (its flash kernel, float32 inside as the sequence) faster for one decode
    row and for prompt chunks (docs/design_notes.md, "measured choices"). On CUDA for prompt chunks only:
    eager decode iterations, whose key length changes every time, ran slower with it there. Not
    for GPT-J, whose scores are float32 on 16-bit inputs, nor with attention sinks (no such term),
    nor on --kv-dtype's codes (read as blocks: kv_codes.code_scores)."""
    return not codes and opts.scores_dtype is None and opts.sinks is None and (q.device.type == "cpu" or not decode)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, opts: AttentionOptions
) -> torch.Tensor:
    num_decode, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    span, length = batch.decode_span, batch.max_decode_len
    if (
        span == 1
        and _fused_kernel(q, opts, decode=True, codes=isinstance(k_cache, CodeRows))
        and (opts.window is None or length <= opts.window)
        and int(batch.span_lens[0]) == length
    ):
        # One sequence that sees all `length` keys (a single stream): no mask needed.
        qg = q.view(1, kv_heads, heads // kv_heads, head_dim)  # its query heads as rows of their kv head
        out = F.scaled_dot_product_attention(qg, k_cache[:1, :, :length], v_cache[:1, :, :length], scale=opts.scale)
        return out.reshape(1, heads * head_dim)
    if batch.decode_rows is not None:
        # Decoding slots are not [0, num_decode): place each query at its slot (a tiny scatter of
        # queries; the KV stays where it is). Slots that do not decode get a zero query.
        q_span = q.new_zeros(span, heads, head_dim)
        q_span[batch.decode_rows] = q
        q = q_span
    dtype = torch.float32 if opts.decode_in_float32 else opts.scores_dtype or q.dtype
    qg = q.view(span, kv_heads, heads // kv_heads, head_dim).to(dtype)  # [n, kvh, group, d]
    k = k_cache[:span, :, :length]  # [n, kvh, len, d] view of the live slots
    v = v_cache[:span, :, :length]
    if opts.decode_in_float32 and not isinstance(v, CodeRows):
        v = v.to(dtype)
    scores = _scores(qg, k, dtype)  # [n, kvh, group, len]
    sinks = None if opts.sinks is None else opts.sinks.view(kv_heads, heads // kv_heads, 1)  # [kvh, group, 1]
    v_dtype = torch.float32 if isinstance(v, CodeRows) else v.dtype
    weights = _softmax_weights(scores, batch.decode_mask(opts.window), head_dim, q.dtype, v_dtype, opts.scale, sinks)
    out = _weighed(weights, v).reshape(span, heads * head_dim).to(q.dtype)  # [n, heads * d]
    return out if batch.decode_rows is None else out[batch.decode_rows]


def _prefill_mask(
    start_pos: int, end: int, window: int | None, device: torch.device, bidirectional: bool = False
) -> torch.Tensor:
    """[end - start_pos, end] True where a key must be ignored: queries at positions start_pos..,
    keys at 0..; causal, and within the window if any (both ways: keys less than `window` away)."""
    query_pos = torch.arange(start_pos, end, device=device)[:, None]
    key_pos = torch.arange(end, device=device)[None, :]
    if bidirectional:
        return (key_pos - query_pos).abs() >= (window if window is not None else end + 1)
    mask = key_pos > query_pos  # causal
    if window is not None:
        mask |= key_pos <= query_pos - window
    return mask


def _prefill(
    q: torch.Tensor, k_slot: torch.Tensor, v_slot: torch.Tensor, span: PrefillSpan, opts: AttentionOptions
) -> torch.Tensor:
    length, heads, head_dim = q.shape
    kv_heads = k_slot.shape[0]
    end = span.start_pos + length
    if _fused_kernel(q, opts, decode=False, codes=isinstance(k_slot, CodeRows)):
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, c, d]
        k, v = k_slot[None, :, :end], v_slot[None, :, :end]  # [1, kvh, end, d]
        if span.start_pos == 0 and (opts.window is None or end <= opts.window):
            out = F.scaled_dot_product_attention(
                qh, k, v, is_causal=not opts.bidirectional, enable_gqa=heads != kv_heads, scale=opts.scale
            )
        else:  # a later chunk (or a window): queries sit at start_pos.., keys at 0..
            visible = ~_prefill_mask(span.start_pos, end, opts.window, q.device, opts.bidirectional)
            out = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=visible, enable_gqa=heads != kv_heads, scale=opts.scale
            )
        return out[0].transpose(0, 1).reshape(length, heads * head_dim)  # [c, heads * d]
    dtype = opts.scores_dtype or q.dtype
    qg = q.view(length, kv_heads, heads // kv_heads, head_dim).permute(1, 2, 0, 3).to(dtype)  # [kvh, g, c, d]
    k = k_slot[:, :end].unsqueeze(1)  # [kvh, 1, end, d]
    v = v_slot[:, :end].unsqueeze(1)
    scores = _scores(qg, k, dtype)  # [kvh, g, c, end]
    sinks = None if opts.sinks is None else opts.sinks.view(kv_heads, heads // kv_heads, 1, 1)  # [kvh, g, 1, 1]
    weights = _softmax_weights(
        scores,
        _prefill_mask(span.start_pos, end, opts.window, q.device, opts.bidirectional),
        head_dim,
        q.dtype,
        torch.float32 if isinstance(v, CodeRows) else v.dtype,
        opts.scale,
        sinks,
    )
    out = _weighed(weights, v).to(q.dtype)  # [kvh, g, c, d]
    return out.permute(2, 0, 1, 3).reshape(length, heads * head_dim)
