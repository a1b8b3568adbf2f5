"""What the native step (gated_deltanet.c) reads of Qwen3.5's layers beyond the decoder's: the
Model fields of its Gated DeltaNet layers, gated attention and shared expert, and each DeltaNet
layer's Layer fields: its projections (blocked, or their codes), float32 copies of its small
tensors, and its share of the slot buffer (states and snapshots, runner/kv_buffer.py)."""

from __future__ import annotations

import torch

from flover.models.gated_deltanet import GatedDeltaNet


def model_fields(model) -> dict:
    """Model's fields of the recurrent layers (none: zeros), the attention gate, the shared expert."""
    cfg, fields = model.cfg, {}
    la = cfg.linear_attention
    if la is not None:
        heads = (
            next(layer.linear for layer in model.layers if layer.linear is not None).heads
            if any(layer.linear is not None for layer in model.layers)
            else None
        )
        if heads is not None:
            fields.update(
                delta_key_heads=heads.key_count,
                delta_value_heads=heads.value_count,
                delta_dk=la.key_dim,
                delta_dv=la.value_dim,
                delta_conv=la.conv_kernel,
                delta_tiled=int(la.tiled),
            )
    if cfg.attn_output_gate:
        fields["attn_gate"] = 1
    if cfg.moe is not None and cfg.moe.shared_intermediate:
        fields["shared_inter"] = cfg.moe.shared_intermediate // model.tp.size
    return fields


def layer_fields(linear: GatedDeltaNet, state, projection, address, keep: list[torch.Tensor]) -> dict:
    """Layer's fields of a DeltaNet layer. `state`: its kv_buffer.RecurrentLayerState;
    `projection(lin)`: (blocked weight, Grid) addresses; `address(t)`: a model-dtype tensor's;
    `keep`: float32 copies the C code reads (held by the caller)."""

    def f32(t: torch.Tensor) -> int:
        keep.append(t.detach().float().contiguous())
        return keep[-1].data_ptr()

    (delta_in, delta_in_grid), (delta_out, delta_out_grid) = projection(linear.in_proj), projection(linear.out)
    assert state.conv.is_contiguous() and state.state.is_contiguous() and state.state.dtype == torch.float32
    return dict(
        delta=1,
        delta_in=delta_in,
        delta_in_grid=delta_in_grid,
        delta_out=delta_out,
        delta_out_grid=delta_out_grid,
        delta_conv_w=f32(linear.conv[:, 0]),
        delta_dt_bias=address(linear.dt_bias),
        delta_a=f32(linear.decay_rates()),
        delta_norm=address(linear.norm),
        conv_state=state.conv.data_ptr(),
        ssm_state=state.state.data_ptr(),
        snap_conv=state.snapshot_conv.data_ptr() if state.snapshot_conv is not None else 0,
        snap_ssm=state.snapshot_state.data_ptr() if state.snapshot_state is not None else 0,
    )


def shared_expert_fields(experts, projection, address) -> dict:
    """Layer's fields of a layer's shared expert (none: {})."""
    if experts.shared_gate is None:
        return {}
    (gate_up, gate_up_grid), (down, down_grid) = projection(experts.shared_gate_up), projection(experts.shared_down)
    return dict(
        shared_gate_up=gate_up,
        shared_gate_up_grid=gate_up_grid,
        shared_down=down,
        shared_down_grid=down_grid,
        shared_gate=address(experts.shared_gate[0]),
    )
