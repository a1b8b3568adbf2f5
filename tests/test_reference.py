"""Correctness is defined against transformers on the same weights."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from flover import LLM, SamplingParams
from flover.models import load_model_config
from tests.helpers import PROMPTS, VARIANTS, rewrite_config, widened_delta_rule


class Reference:
    """transformers' model on a checkpoint: (experts: its eager loop; its grouped matmul takes
    float32 only; Gated DeltaNet: its delta rule at float64 for a float64 model, helpers)."""

    def __init__(self, model_dir: str, dtype: torch.dtype):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, experts_implementation="eager"
        ).eval()
        self.generation_config, self.dtype = self.model.generation_config, dtype

    def __call__(self, *args, **kwargs):
        with widened_delta_rule(self.dtype):
            return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with widened_delta_rule(self.dtype):
            return self.model.generate(*args, **kwargs)


def reference(model_dir: str, dtype: torch.dtype) -> Reference:
    return Reference(model_dir, dtype)


def max_logit_diff(llm: LLM, ref, prompt: str) -> tuple[float, float]:
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]  # [T, vocab]
    ours = llm.engine.score(ids)
    assert ours.shape == expected.shape
    return (ours.double() - expected.double()).abs().max().item(), expected.abs().max().item()


# Allowed max |ours - transformers| over a prompt's logits, given the logits' largest magnitude.
LOGIT_BOUNDS = {
    "float64": lambda scale: 1e-9,
    "float32": lambda scale: 1e-4 * scale,
    "bfloat16": lambda scale: 0.03 * scale,  # a few ulps of bfloat16
    "float16": lambda scale: 0.03 * scale,
}


def max_seq_len_of(variant: str) -> int:
    """256, but for LongRoPE with an original length of 128 (phi3-gguf): flover picks the short
    factors for an engine whose sequences stay within it, as transformers does for these prompts."""
    return 128 if variant == "phi3-gguf" else 256


LOGIT_CASES = (
    [(v, "float64") for v in VARIANTS]
    + [(v, "float32") for v in VARIANTS]
    + [("llama", "bfloat16"), ("llama", "float16")]
)


@pytest.mark.parametrize("variant,dtype", LOGIT_CASES)
def test_logits_match_transformers(make_model, variant, dtype):
    model_dir = make_model(variant)
    llm = LLM(model_dir, dtype=dtype, max_slots=2, max_seq_len=max_seq_len_of(variant))
    ref = reference(model_dir, getattr(torch, dtype))
    for prompt in PROMPTS:
        diff, scale = max_logit_diff(llm, ref, prompt)
        assert diff <= LOGIT_BOUNDS[dtype](scale), (variant, dtype, prompt, diff, scale)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float64_greedy_generation_matches_transformers(make_model, variant):
    """All prompts run fused in one engine; each must give transformers' own greedy tokens."""
    model_dir = make_model(variant)
    llm = LLM(model_dir, dtype="float64", max_slots=4, max_seq_len=max_seq_len_of(variant))
    ref = reference(model_dir, torch.float64)
    ref.generation_config.eos_token_id = None  # (as ignore_eos: else min_new_tokens masks the end token out)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=True)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        if variant.startswith("gemma3"):
            # transformers' generate disagrees with its own forward here once a sliding-window
            # layer's cache is full (its token differs from the argmax of the full sequence's
            # logits): greedy by the full forward, each of our tokens the argmax at its place
            expected = torch.tensor([ids + out.token_ids])
            with torch.no_grad():
                chosen = ref(expected).logits[0, len(ids) - 1 : -1].argmax(-1).tolist()
            assert out.token_ids == chosen, (variant, prompt)
        else:
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert out.token_ids == expected[0, len(ids) :].tolist(), (variant, prompt)
        assert out.finish_reason == "length"
        # The decode path's log-probabilities equal the reference's for every generated token.
        with torch.no_grad():
            logp = torch.log_softmax(ref(expected).logits[0], dim=-1)
        want = logp[len(ids) - 1 : -1].gather(1, expected[0, len(ids) :, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-8), variant


def test_sliding_window_is_applied(make_model, tmp_path):
    """The window must change the result once prompts are longer than it (so the match above
    is not a coincidence of both sides ignoring it)."""
    windowed = make_model("mistral-window8")
    full = tmp_path / "full"
    shutil.copytree(windowed, full)
    rewrite_config(full, sliding_window=None)
    assert load_model_config(full).sliding_windows == (None, None)
    ids = LLM(windowed, dtype="float64", max_seq_len=256).tokenizer.encode(PROMPTS[2])
    a = LLM(windowed, dtype="float64", max_seq_len=256).engine.score(ids)
    b = LLM(str(full), dtype="float64", max_seq_len=256).engine.score(ids)
    assert torch.equal(a[:8], b[:8])  # inside the window: identical
    assert (a[8:] - b[8:]).abs().max() > 1e-6  # beyond it: different


def test_transformers_v4_config_layout(make_model, tmp_path):
    """v4 keeps rope_theta/rope_scaling at the top level instead of rope_parameters."""
    v5 = make_model("llama-mqa-bias-tied-llama3")
    v4 = tmp_path / "v4"
    shutil.copytree(v5, v4)
    params = load_model_config(v5)
    rewrite_config(
        v4,
        rope_parameters=None,
        rope_theta=params.rope_theta,
        rope_scaling={k: v for k, v in params.rope_scaling.items()},
        torch_dtype="float32",
    )
    cfg = load_model_config(v4)
    assert cfg == params.__class__(**{**params.__dict__, "checkpoint_dtype": "float32"})
    ids = [5, 6, 7, 8, 9]
    a = LLM(v5, dtype="float64").engine.score(ids)
    b = LLM(str(v4), dtype="float64").engine.score(ids)
    assert torch.equal(a, b)


def test_olmo2_under_tensor_parallelism_is_refused_with_the_reason(make_model):
    """Its q/k norms span every head, which TP splits across ranks: one clear error at load."""
    import torch

    from flover.models import open_checkpoint
    from flover.models.decoder import DecoderForCausalLM
    from flover.models.tp_layout import TPLayout

    cfg = open_checkpoint(make_model("olmo2")).model_config()
    with pytest.raises(ValueError, match="q/k norms span every head"):
        DecoderForCausalLM(cfg, TPLayout.build(cfg, 0, 2), None, 64, torch.float32, torch.device("cpu"))
    DecoderForCausalLM(cfg, TPLayout.build(cfg, 0, 1), None, 64, torch.float32, torch.device("cpu"))  # one rank: fine
