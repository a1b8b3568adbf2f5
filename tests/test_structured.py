"""Structured output in the engine (flover/structured/): on tiny random models (random weights
would write anything, so every constrained output is a real test of the mask), every output
matches its structure; unconstrained requests fused with constrained ones are untouched; bad
structures are refused before anything is queued."""

from __future__ import annotations

import json
import re

import llguidance
import pytest

from flover import LLM, SamplingParams
from flover.structured.spec import Structured

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
STRUCTURES = {
    "json": Structured("json"),
    "json_schema": Structured("json_schema", SCHEMA),
    "regex": Structured("regex", r"[0-9]{3}-[a-z]{2,5}"),
    "choice": Structured("choice", ("yes", "no", "maybe not")),
    "grammar": Structured("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/'),
}


BOUNDED = ("json_schema", "regex", "choice")  # a match is at most a few dozen tokens: it must end


def accepted(llm: LLM, structured: Structured, tokens: list[int], complete: bool) -> bool:
    """A fresh matcher takes the tokens (what the grammar itself says) and, for a complete text,
    is then at an end."""
    matcher = llguidance.LLMatcher(llm.engine.grammars.tokenizer, structured.grammar(), log_level=0)
    eos = set(llm.engine.model_config.eos_token_ids)
    body = tokens[:-1] if tokens and tokens[-1] in eos else tokens
    return matcher.consume_tokens(body) and (matcher.is_accepting() or not complete)


def check_text(kind: str, text: str) -> None:
    if kind == "json":
        assert isinstance(json.loads(text), dict), text
    elif kind == "json_schema":
        value = json.loads(text)
        assert list(value) == ["name", "age", "tags"] and 0 <= value["age"] <= 150, text  # the schema's order
        assert isinstance(value["name"], str) and set(value["tags"]) <= {"a", "b", "c"}, text
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
    elif kind == "choice":
        assert text in ("yes", "no", "maybe not"), text
    else:
        assert re.fullmatch(r"\(([0-9]{1,3})(,[0-9]{1,3})*\)", text), text


@pytest.mark.parametrize("dtype", ["float32", "float64"])  # the native step's sampler, and PyTorch's
def test_every_constrained_output_matches_its_structure_greedy_and_sampled(llama_dir, dtype):
    llm = LLM(llama_dir, dtype=dtype, max_slots=8, max_seq_len=160)
    prompts, params, kinds = [], [], []
    for i, (kind, structured) in enumerate(STRUCTURES.items()):
        for sampled in (False, True):
            prompts.append([3 + i, 5, 7 + sampled])
            params.append(
                SamplingParams(
                    max_new_tokens=120,
                    structured=structured,
                    seed=i,
                    temperature=0.9 if sampled else 0.0,
                    top_p=0.95 if sampled else 1.0,
                )
            )
            kinds.append(kind)
    outs = llm.generate(prompts, params)
    for kind, p, out in zip(kinds, params, outs):
        # random weights may write an unbounded string or list until max_new_tokens: then the
        # text is a prefix of a match
        assert out.finish_reason == "stop" or (kind not in BOUNDED and out.finish_reason == "length"), (kind, out)
        complete = out.finish_reason == "stop"
        assert accepted(llm, p.structured, out.token_ids, complete), (kind, out.text)
        if complete:
            check_text(kind, out.text)
    assert sum(o.finish_reason == "stop" for o in outs) >= 7


def test_unconstrained_requests_fused_with_constrained_ones_get_the_tokens_they_get_alone(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_slots=6, max_seq_len=128)
    free = [
        SamplingParams(max_new_tokens=30, ignore_eos=True),
        SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
    ]
    alone = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], free)]
    constrained = [
        SamplingParams(max_new_tokens=60, structured=STRUCTURES[kind], temperature=t, seed=2)
        for kind in BOUNDED
        for t in (0.0, 1.0)
    ][:4]
    outs = llm.generate([[1, 2, 3], [4, 5, 6]] + [[9, 9, i] for i in range(4)], free + constrained)
    assert [o.token_ids for o in outs[:2]] == alone
    assert all(o.finish_reason == "stop" for o in outs[2:])


def test_greedy_constrained_requests_draft_and_get_the_tokens_they_get_without_drafts(llama_dir):
    # drafts: forced tokens (JSON keys, the regex's "-") or n-grams (two rows an iteration: drafting
    # pays), each draft row under the mask after the draft tokens before it
    prompts = [[3 + i, 5, 7 + j] for i in range(len(STRUCTURES)) for j in range(2)]
    params = [SamplingParams(max_new_tokens=120, structured=s) for s in STRUCTURES.values() for _ in range(2)]
    tokens = {}
    for speculate in (0, 8):
        llm = LLM(llama_dir, dtype="float32", max_slots=2, max_seq_len=200, speculate=speculate)
        # n-gram drafts (the rejected ones) depend on the iterations' measured cost: pinned, so
        # that they run on every machine and every run (a tiny model's iterations are all fixed cost)
        llm.engine.scheduler.iteration_cost.leader_knee = 64.0
        tokens[speculate] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens[8] == tokens[0]
    assert llm.engine.accepted_tokens > 0 and llm.engine.draft_tokens > llm.engine.accepted_tokens


def test_a_structure_longer_than_max_tokens_ends_with_length(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    out = llm.generate([1, 2], SamplingParams(max_new_tokens=3, structured=STRUCTURES["json_schema"]))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize(
    "structured, problem",
    [
        (dict(kind="regex", value="[a-"), "does not compile"),
        (dict(kind="json_schema", value={"type": "frobnicate"}), "does not compile"),
        (dict(kind="grammar", value="start: undefined_rule"), "does not compile"),
        (dict(kind="json_schema", value="{not json"), "not JSON"),
        (dict(kind="choice", value=[]), "choice"),
        (dict(kind="xml"), "not one of"),
        (dict(kind="json", value="x"), "no value"),
        ({"kind": "regex", "value": "a", "extra": 1}, "must be a map"),
    ],
)
def test_a_bad_structure_is_refused_naming_the_problem_and_changes_nothing(llama_dir, structured, problem):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    with pytest.raises(ValueError, match=problem):
        llm.engine.add_request([1, 2], SamplingParams(max_new_tokens=4, structured=structured))
    assert not llm.engine.has_unfinished()
    out = llm.generate([1, 2], SamplingParams(max_new_tokens=4, structured=Structured("choice", ("ok",))))[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_compiled_grammars_are_cached_by_their_canonical_structure(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    grammars = llm.engine.grammars
    first = grammars.compile(Structured("json_schema", SCHEMA))
    assert grammars.compile(Structured("json_schema", json.dumps(SCHEMA))) is first  # the same schema as text
    assert grammars.compile(Structured("regex", "[0-9]+")) is not first


def test_a_complete_structure_ends_the_request_even_when_eos_is_ignored(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    out = llm.generate(
        [1, 2], SamplingParams(max_new_tokens=30, ignore_eos=True, structured=Structured("choice", ("yes", "no")))
    )[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no") and len(out.token_ids) < 30


def test_structured_requests_through_the_daemon_and_a_bad_one_refused_while_others_run(server):
    """A real `flover serve` and client: structures on the wire (the map, or a Structured the
    client turns into it), compiled off the loop; a schema that does not compile is answered
    `invalid_request` naming the problem, and the requests beside it finish."""
    from flover.client import FloverError

    with server.client() as c:
        regex = c.generate(
            input_ids=[1, 2, 3], max_new_tokens=40, structured={"kind": "regex", "value": r"[0-9]{3}-[a-z]{2,5}"}
        )
        assert regex["finish_reason"] == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", regex["text"])
        schema = c.generate(
            input_ids=[4, 5], max_new_tokens=80, temperature=0.7, seed=3, structured=STRUCTURES["json_schema"]
        )
        assert schema["finish_reason"] == "stop"
        check_text("json_schema", schema["text"])
        with pytest.raises(FloverError, match="does not compile"):
            c.generate(input_ids=[1, 2], max_new_tokens=8, structured={"kind": "regex", "value": "[a-"})
        ok = c.generate(input_ids=[1, 2], max_new_tokens=8, ignore_eos=True)
        assert ok["finish_reason"] == "length"


@pytest.fixture(scope="module")
def http_api(make_model):
    import signal

    from tests.helpers import Server, free_port

    port = free_port()
    server = Server(make_model("llama"), "--max-slots", "8", "--max-seq-len", "256", "--http", f"127.0.0.1:{port}")
    yield f"http://127.0.0.1:{port}"
    server.stop(signal.SIGKILL)


def test_openai_client_parses_a_pydantic_model_and_json_objects_and_choices(http_api):
    """The official client: `chat.completions.parse` with a pydantic model (OpenAI's strict
    json_schema), `json_object`, vLLM's guided_choice / guided_regex; a schema that cannot compile
    is a 400 naming the problem; two ways at once are refused."""
    from typing import Literal

    import openai
    import pydantic

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog", "bird"]
        age: int = pydantic.Field(ge=0, le=30)
        indoor: bool
        name: str = pydantic.Field(max_length=6)

    client = openai.OpenAI(base_url=f"{http_api}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions
    parse = chat.parse if hasattr(chat, "parse") else client.beta.chat.completions.parse
    for i in range(6):
        answer = parse(
            model=model,
            messages=[{"role": "user", "content": f"pet number {i}"}],
            response_format=Pet,
            max_tokens=80,
            temperature=0.8 if i % 2 else 0.0,
            seed=i,
        )
        pet = answer.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.age <= 30 and len(pet.name) <= 6, answer
    text = chat.create(
        model=model,
        messages=[{"role": "user", "content": "a json object"}],
        max_tokens=120,
        response_format={"type": "json_object"},
        temperature=0,
    ).choices[0]
    if text.finish_reason == "stop":  # random weights may write one long string until max_tokens
        assert isinstance(json.loads(text.message.content), dict)
    choice = (
        chat.create(
            model=model,
            messages=[{"role": "user", "content": "yes or no?"}],
            max_tokens=10,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        .choices[0]
        .message.content
    )
    assert choice in ("yes", "no")
    done = client.completions.create(
        model=model, prompt="a code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"}
    ).choices[0]
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", done.text) and done.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        chat.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}},
        )
    with pytest.raises(openai.BadRequestError, match="one way"):
        chat.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )


def test_logit_bias_adds_to_the_logits_of_its_tokens_only(llama_dir):
    """OpenAI's logit_bias: +100 on a token makes it the greedy choice, -100 bans the greedy
    one; a biased request beside an unbiased one changes none of its tokens; ids past the
    vocabulary are refused."""
    llm = LLM(llama_dir, dtype="float32", max_seq_len=64)
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = llm.generate([1, 2, 3], plain)[0].token_ids
    forced, banned, other = llm.generate(
        [[1, 2, 3], [1, 2, 3], [1, 2, 3]],
        [
            SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={77: 100}),
            SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={alone[0]: -100}, temperature=0.7, seed=1),
            plain,
        ],
    )
    assert forced.token_ids == [77] * 8 and alone[0] not in banned.token_ids and other.token_ids == alone
    with pytest.raises(ValueError, match="vocabulary size"):
        llm.engine.add_request([1], SamplingParams(logit_bias={10**6: 1}))


def test_logit_bias_over_http(http_api, llama_dir):
    import httpx
    from tokenizers import Tokenizer

    body = {"prompt": "x", "max_tokens": 4, "temperature": 0, "logit_bias": {"77": 100}}
    answer = httpx.post(f"{http_api}/v1/completions", json=body, timeout=60).json()
    forced = Tokenizer.from_file(f"{llama_dir}/tokenizer.json").decode([77] * 4)
    assert answer["choices"][0]["text"] == forced, answer
    bad = httpx.post(f"{http_api}/v1/completions", json={**body, "logit_bias": {"x": 1}}, timeout=60)
    assert bad.status_code == 400 and "logit_bias" in bad.text


def test_prompt_files_carry_structures_and_a_bad_one_is_an_error_record(llama_dir, tmp_path):
    from tests.helpers import flover_run, read_records

    lines = [
        json.dumps(
            {
                "id": "code",
                "input_ids": [1, 2],
                "max_new_tokens": 30,
                "structured": {"kind": "regex", "value": "[0-9]{3}-[a-z]{2,5}"},
            }
        ),
        json.dumps({"id": "bad", "input_ids": [1, 2], "structured": {"kind": "regex", "value": "[a-"}}),
        json.dumps({"id": "pick", "input_ids": [3], "structured": {"kind": "choice", "value": ["red", "blue"]}}),
    ]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    run = flover_run(llama_dir, prompts, out)
    assert run.returncode == 0, run.stderr
    by_id = {r["id"]: r for r in read_records(out)}
    assert re.fullmatch("[0-9]{3}-[a-z]{2,5}", by_id["code"]["text"]) and by_id["pick"]["text"] in ("red", "blue")
    assert by_id["bad"]["error"]["code"] == "invalid_request" and "does not compile" in by_id["bad"]["error"]["message"]
