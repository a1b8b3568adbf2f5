"""Building blocks against transformers' own modules, bit for bit, in the 16-bit dtypes too."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rms_norm_gives_llamarmsnorms_bits(dtype):
    from flover.models.layers import rms_norm

    torch.manual_seed(0)
    x = (torch.randn(9, 96) * 4).to(dtype)
    ref = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(96))
        expected = ref(x)
    assert torch.equal(rms_norm(x, ref.weight.detach(), 1e-5), expected)
