"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral, gpt-oss): a router scores every
expert for each row of the fused token matrix, each row takes its top k, and each chosen expert
runs once over all the rows that chose it (experts no row chose are not touched).

A row's result depends only on its own routing: each expert's rows are computed as a matrix of
those rows, and each row's k contributions are added in the order of the experts' indices,
starting from zero, as transformers' eager experts do.

Each expert is a pair of `Linear`s (gate and up fused, then down), so every way a projection is
held (quantized, a GGUF file's own codes, packed, the native step's copies) holds experts too;
under tensor parallelism each rank keeps its slice of every expert's columns, as of a dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flover.models.layers import Linear, cols, float32_rms_norm, new_param, rows, whole
from flover.models.model_config import MoEConfig
from flover.models.safetensors_reader import WeightSpec
from flover.models.tp_layout import TPLayout


class ExpertsMLP(nn.Module):
    def __init__(
        self,
        moe: MoEConfig,
        hidden: int,
        act,
        tp: TPLayout,
        dtype: torch.dtype,
        device: torch.device,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.cfg, self.act, self.tp, self.eps = moe, act, tp, eps
        inter, bias = tp.expert_intermediate, moe.expert_bias  # this rank's columns of each expert
        self.router = new_param(moe.experts, hidden, dtype=dtype, device=device)  # [experts, hidden], every rank's
        self.router_bias = new_param(moe.experts, dtype=dtype, device=device) if moe.router_bias else None
        # (Gemma 4) the router input's learned scale [hidden] and each expert's weight's [experts]
        self.router_scale = new_param(hidden, dtype=dtype, device=device) if moe.router_scaled else None
        self.expert_scale = new_param(moe.experts, dtype=dtype, device=device) if moe.router_scaled else None
        self.gate_up = nn.ModuleList(Linear(2 * inter, hidden, bias, dtype, device) for _ in range(moe.experts))
        self.down = nn.ModuleList(Linear(hidden, inter, bias, dtype, device) for _ in range(moe.experts))
        for lin in self.down if bias and tp.rank > 0 else ():  # (gpt-oss) down's bias: added by rank 0 alone
            lin.bias.data.zero_()
        # rows routed to each expert since the model was built (int64 [experts]; the native step adds to it too)
        self.load = torch.zeros(moe.experts, dtype=torch.int64)
        # (Qwen3.5-MoE) the shared expert: a dense MLP on every row, gated by sigmoid(shared_gate x)
        shared = moe.shared_intermediate // tp.size if moe.shared_intermediate else 0
        self.shared_gate_up = Linear(2 * shared, hidden, False, dtype, device) if shared else None
        self.shared_down = Linear(hidden, shared, False, dtype, device) if shared else None
        self.shared_gate = new_param(1, hidden, dtype=dtype, device=device) if shared else None

    def weight_specs(self, prefix: str, hidden: int) -> list[WeightSpec]:
        """The checkpoint's per-expert tensors ({block}.experts.{e}.{gate} ...) into each expert's pair."""
        moe, tp = self.cfg, self.tp
        block, (gate, up, down) = moe.block_of(prefix), moe.projections
        full, start, inter = moe.intermediate, tp.expert_intermediate_start, tp.expert_intermediate
        router = f"{block}.{moe.router}"
        specs = [WeightSpec(self.router, (whole(f"{router}.weight", (moe.experts, hidden)),))]
        if self.router_bias is not None:
            specs.append(WeightSpec(self.router_bias, (whole(f"{router}.bias", (moe.experts,)),)))
        if self.router_scale is not None:  # (Gemma 4: router.proj beside router.scale, router.per_expert_scale)
            parent = router.rsplit(".", 1)[0]
            specs.append(WeightSpec(self.router_scale, (whole(f"{parent}.scale", (hidden,)),)))
            specs.append(WeightSpec(self.expert_scale, (whole(f"{parent}.per_expert_scale", (moe.experts,)),)))
        for e in range(moe.experts):
            expert = f"{block}.experts.{e}"
            gate_up = tuple(rows(f"{expert}.{n}.weight", (full, hidden), start, inter) for n in (gate, up))
            specs.append(WeightSpec(self.gate_up[e].weight, gate_up))
            down_cols = cols(f"{expert}.{down}.weight", (hidden, full), start, inter)
            specs.append(WeightSpec(self.down[e].weight, (down_cols,)))
            if moe.expert_bias:  # (gpt-oss) gate and up's: this rank's columns; down's: rank 0's partial sum
                biases = tuple(rows(f"{expert}.{n}.bias", (full,), start, inter) for n in (gate, up))
                specs.append(WeightSpec(self.gate_up[e].bias, biases))
                if tp.rank == 0:
                    specs.append(WeightSpec(self.down[e].bias, (whole(f"{expert}.{down}.bias", (hidden,)),)))
        if self.shared_gate is not None:
            full, start, inter = (
                moe.shared_intermediate,
                tp.rank * self.shared_down.weight.shape[1],
                self.shared_down.weight.shape[1],
            )
            shared = f"{block}.shared_expert"
            gate_up = tuple(
                rows(f"{shared}.{n}.weight", (full, hidden), start, inter) for n in ("gate_proj", "up_proj")
            )
            specs.append(WeightSpec(self.shared_gate_up.weight, gate_up))
            specs.append(
                WeightSpec(self.shared_down.weight, (cols(f"{shared}.down_proj.weight", (hidden, full), start, inter),))
            )
            specs.append(WeightSpec(self.shared_gate, (whole(f"{block}.shared_expert_gate.weight", (1, hidden)),)))
        return specs

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (experts [T, k], weights [T, k]: float32 where the family multiplies so,
        else in x's dtype)."""
        if self.router_scale is not None:  # (Gemma 4) normed (no weight), times its scale and hidden^-0.5
            x = float32_rms_norm(x, None, self.eps) * self.router_scale * x.shape[-1] ** -0.5
        logits = F.linear(x, self.router, self.router_bias)  # [T, experts]
        if self.cfg.softmax_after_topk:  # (gpt-oss) the top k logits, then their softmax in x's dtype
            top, experts = torch.topk(logits, self.cfg.top_k, dim=-1)
            return experts, torch.softmax(top, dim=-1, dtype=top.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:  # (float32 times the model's dtype: the wider of the two)
            weights = weights * self.expert_scale[experts]
        return experts, weights if self.cfg.weights_float32 else weights.to(logits.dtype)

    def forward(self, x: torch.Tensor, route_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (this rank's partial sum under tensor parallelism).
        `route_input`: the rows the router reads, where they are not x (Gemma 4: the residual)."""
        experts, weights = self.route(x if route_input is None else route_input)
        self.load += torch.bincount(experts.flatten(), minlength=self.cfg.experts).to(self.load.device)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # ascending: each row's sum in the experts' order
            row, slot = torch.where(experts == e)
            gate, up = self.gate_up[e](x[row]).chunk(2, dim=-1)  # [n, inter] each
            y = self.down[e](self.glu(gate, up)) * weights[row, slot, None]  # [n, hidden]
            out.index_add_(0, row, y.to(out.dtype))
        if self.shared_gate is not None:  # added after the routed experts' sum, as the reference adds it
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared_down(self.act(gate) * up)
        return out

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up; gpt-oss's clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha g), g = gate
        clamped above (as transformers' GptOssExperts, operation for operation)."""
        limit = self.cfg.swiglu_limit
        if limit is None:
            return self.act(gate) * up
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))

    def linears(self) -> list[Linear]:
        shared = [self.shared_gate_up, self.shared_down] if self.shared_gate is not None else []
        return [*self.gate_up, *self.down, *shared]
