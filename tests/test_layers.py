"""Building blocks against transformers' own modules, bit for bit, in the 16-bit dtypes too."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("family", ["olmo2", "gemma3"])
def test_the_norms_that_round_once_give_their_families_bits(dtype, family):
    """OLMo 2's and Gemma 3's RMSNorms multiply by the weight (Gemma: 1 + weight) in float32 and
    round once; Llama's rounds before the weight too, which differs in the 16-bit dtypes."""
    from flover.models.layers import offset_rms_norm, rms_norm, wide_weight_rms_norm

    torch.manual_seed(1)
    x = (torch.randn(9, 96) * 4).to(dtype)
    ref = (Olmo2RMSNorm(96, eps=1e-6) if family == "olmo2" else Gemma3RMSNorm(96, eps=1e-6)).to(dtype)
    ours = wide_weight_rms_norm if family == "olmo2" else offset_rms_norm
    with torch.no_grad():
        ref.weight.copy_(torch.randn(96))
        expected = ref(x)
    assert torch.equal(ours(x, ref.weight.detach(), 1e-6), expected)
    if family == "olmo2" and dtype == torch.bfloat16:  # the difference this makes
        assert not torch.equal(rms_norm(x, ref.weight.detach(), 1e-6), expected)
