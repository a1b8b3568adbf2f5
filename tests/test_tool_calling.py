"""Tool calling (flover/tools.py): the syntaxes parsed back into calls, the tools put into a
prompt by templates that render them and by those that do not, and a real `flover serve --http`
answering the official client with `tool_calls` — required calls always parse, streamed and not,
and a whole round trip (tools -> calls -> a tool message -> an answer)."""

from __future__ import annotations

import json
import signal

import llguidance
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from flover import tools
from flover.models.tokenizer import Tokenizer
from tests.helpers import Server, free_port

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "syntax, text, content",
    [
        (
            tools.HERMES,
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
            "Sure.",
        ),
        (tools.LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', ""),
        (tools.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]', ""),
        (
            tools.PHI4,
            'functools[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            "",
        ),
        (  # (what reasoning.split_harmony leaves of a gpt-oss answer: the messages to tools as written)
            tools.HARMONY,
            "Let me check.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Oslo", "days": 2}<|call|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>',
            "Let me check.",
        ),
        (  # (Gemma 4's: bare keys, strings between <|"|> marks; what the split of its thinking leaves)
            tools.GEMMA4,
            'Sure.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>'
            '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>',
            "Sure.",
        ),
    ],
)
def test_each_syntax_is_parsed_into_calls(syntax, text, content):
    found_content, calls = tools.parse_calls(text, syntax)
    assert found_content == content and calls[0].name == "get_weather"
    if syntax == tools.HARMONY:  # (a recipient before the channel too) and a body that is not an object
        assert [c.name for c in calls] == ["get_weather", "get_time"]
        assert tools.parse_calls(text.replace('{"zone": "UTC"}', "[1]"), syntax)[1] == []
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "days": 2} and calls[0].id.startswith("call_")
    assert tools.parse_calls("just text, no call", syntax) == ("just text, no call", [])
    assert tools.parse_calls('<tool_call>\n{"name": broken', tools.HERMES)[1] == []  # no half calls


def test_the_syntax_follows_the_template():
    assert tools.syntax_of("{% if tools %}<tool_call>{% endif %}") == tools.HERMES
    assert tools.syntax_of("<|python_tag|>{{ x }}") == tools.LLAMA3
    assert tools.syntax_of("[TOOL_CALLS]") == tools.MISTRAL
    assert tools.syntax_of(PHI4_MINI_TEMPLATE) == tools.PHI4
    assert tools.syntax_of("<|start|>{{ m }}<|channel|>final<|message|>") == tools.HARMONY
    with pytest.raises(ValueError, match="harmony tool calls; only .auto. and .none."):
        tools.required_structure([WEATHER], "required", True, tools.HARMONY)
    assert tools.syntax_of(None) == tools.HERMES and not tools.renders_tools(None)
    assert tools.syntax_of("{{- '<|tool_call>call:' + function['name'] + '{' -}}") == tools.GEMMA4
    with pytest.raises(ValueError, match="Gemma 4 tool calls; only .auto. and .none."):
        tools.required_structure([WEATHER], "required", True, tools.GEMMA4)


def test_gemma4_values_read_back_as_its_template_writes_them():
    """Every kind of value its format_argument macro writes (nested mappings, lists, booleans,
    numbers, strings holding commas, braces and quotes) reads back; a call cut off, a string not
    closed or an unbalanced object ends the calls, the complete ones before it counted."""
    args = {"q": 'a, {b} "c"', "n": -2.5, "ok": False, "none": None, "tags": ["x", 1, [True]], "o": {"k": {"d": "e"}}}
    text = tools.call_text("search", args, tools.GEMMA4)
    assert text.startswith("<|tool_call>call:search{n:-2.5,") and text.endswith("<tool_call|>")
    (call,) = tools.parse_calls(text, tools.GEMMA4)[1]
    assert call.name == "search" and json.loads(call.arguments) == args
    for cut in (text[:-3], text + '<|tool_call>call:more{a:<|"|>open', text + "<|tool_call>call:more{a:{b:1}"):
        assert [c.name for c in tools.parse_calls(cut, tools.GEMMA4)[1]] == ([] if cut == text[:-3] else ["search"])
    deep = "<|tool_call>call:f{a:" + "[" * 5000
    assert tools.parse_calls(deep, tools.GEMMA4) == (deep, [])


# Phi-4-mini-instruct's chat template: the tools come from the system message's own `tools`
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def tokenizer_with(template: str, model_dir: str) -> Tokenizer:
    return Tokenizer(HFTokenizer.from_file(f"{model_dir}/tokenizer.json"), {"eos_token": "<|im_end|>"}, template)


def test_tools_reach_the_prompt_with_and_without_the_templates_help(llama_dir):
    """A template without `tools` (like SmolLM2's) gets them as a system prompt and earlier calls
    and results as text; a template that renders `tools` gets them, and call arguments as
    mappings (what Hugging Face templates index)."""
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    plain = tokenizer_with("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}", llama_dir)
    text = plain.render_chat(messages, [WEATHER])
    assert text.startswith("[system]You may call one or more functions") and '"name": "get_weather"' in text
    assert (
        '[assistant]<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
        in text
    )
    assert "[tool]<tool_response>\nsunny\n</tool_response>" in text
    aware = tokenizer_with(
        "{{ tools | map(attribute='function.name') | join(',') }}|{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}{% endfor %}",
        llama_dir,
    )
    assert aware.render_chat(messages, [WEATHER, TIME]) == "get_weather,get_time|get_weather(Oslo)"


def test_phi4_mini_gets_its_tools_in_the_system_message_and_its_calls_as_functools(llama_dir):
    """Phi-4-mini's template reads no `tools` variable: they go into the system message (a
    default one where there is none) as JSON text of the functions, as Microsoft's examples do;
    earlier calls come back as `functools[...]`."""
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
            ],
        },
    ]
    phi4 = tokenizer_with(PHI4_MINI_TEMPLATE, llama_dir)
    text = phi4.render_chat(messages, [WEATHER, TIME])
    listed = json.dumps([WEATHER["function"], TIME["function"]], ensure_ascii=False)
    assert text.startswith(f"<|system|>You are a helpful assistant with some tools.<|tool|>{listed}<|/tool|><|end|>")
    assert (
        '<|assistant|>functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]<|end|>' in text
    )
    own = phi4.render_chat([{"role": "system", "content": "Be brief."}, *messages[:1]], [WEATHER])
    assert own.startswith(f"<|system|>Be brief.<|tool|>{json.dumps([WEATHER['function']])}<|/tool|><|end|><|user|>")
    content, calls = tools.parse_calls(
        "functools[" + json.dumps({"name": "get_time", "arguments": {"zone": "CET"}}) + "]", tools.PHI4
    )
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("syntax", [tools.HERMES, tools.LLAMA3, tools.MISTRAL, tools.PHI4])
def test_required_calls_compile_for_every_syntax(syntax, llama_dir):
    tok = llguidance.LLTokenizer(HFTokenizer.from_file(f"{llama_dir}/tokenizer.json").to_str())
    for choice, parallel in (("required", True), ("required", False), ({"function": {"name": "get_time"}}, True)):
        spec = tools.required_structure([WEATHER, TIME], choice, parallel, syntax)
        grammar = llguidance.LLMatcher.grammar_from_lark(spec["value"])
        assert llguidance.LLMatcher.validate_grammar(grammar, tok) == "", (syntax, choice)
    assert tools.required_structure([WEATHER], "auto", True, syntax) is None
    with pytest.raises(ValueError, match="no tool is named"):
        tools.required_structure([WEATHER], {"function": {"name": "nope"}}, True, syntax)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """`flover serve --http` on a tiny model with room for a tools prompt (its 512-token
    vocabulary spells JSON a few characters a token)."""
    from flover.testing.tiny_model import make_tiny_model
    from tests.helpers import TEST_PRESET

    model_dir = make_tiny_model(
        "llama", {**TEST_PRESET, "max_position_embeddings": 2048}, tmp_path_factory.mktemp("llama-2k")
    )
    port = free_port()
    server = Server(str(model_dir), "--max-slots", "4", "--max-seq-len", "2048", "--http", f"127.0.0.1:{port}")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield client, client.models.list().data[0].id
    server.stop(signal.SIGKILL)


def check_call(call, tools_given) -> dict:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools_given}
    assert call.type == "function" and call.function.name in schemas and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == set(schemas[call.function.name]["required"])
    return arguments


def test_required_and_named_calls_always_parse_streamed_and_not(api):
    client, model = api
    ask = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]
    for seed in range(4):
        # (one call each: random weights could go on writing parallel calls until max_tokens)
        answer = client.chat.completions.create(
            model=model,
            messages=ask,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0.8,
            seed=seed,
        ).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.tool_calls, answer
        for call in answer.message.tool_calls:
            check_call(call, [WEATHER, TIME])
    named = client.chat.completions.create(
        model=model,
        messages=ask,
        tools=[WEATHER, TIME],
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
    ).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    assert check_call(named.message.tool_calls[0], [TIME])["zone"] in ("UTC", "CET")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ask,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls[0].index == 0 and json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo", "Lima")


def test_a_round_trip_tools_then_a_tool_message_then_an_answer(api):
    client, model = api
    messages = [{"role": "user", "content": "Weather in Lima for 2 days?"}]
    first = (
        client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    messages += [
        {"role": "assistant", "content": first.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "rain"})},
    ]
    final = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0
    ).choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls") and (
        final.message.content or final.message.tool_calls
    )
    plain = client.chat.completions.create(
        model=model, messages=messages[:1], tools=[WEATHER], tool_choice="none", max_tokens=8
    ).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model=model,
            messages=messages[:1],
            tools=[WEATHER],
            max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "unknown"}},
        )


def test_complete_calls_count_when_max_tokens_cuts_the_next_and_parallel_false_keeps_one():
    from flover.server import openai_api as oa

    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'
    text = f'{call}\n{call}\n<tool_call>\n{{"name":"get_weather","argu'
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "tool_choice": "required"}
    plan = oa.plan(body, "chat", "m", lambda _: None, tools.HERMES)
    message, finish = oa.chat_message(plan, text, "length")
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"] * 2
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    single = oa.plan({**body, "parallel_tool_calls": False}, "chat", "m", lambda _: None, tools.HERMES)
    assert len(oa.chat_message(single, text, "length")[0]["tool_calls"]) == 1
    # the other syntaxes: the complete items of a list cut off
    mistral = '[TOOL_CALLS][{"name":"a","arguments":{}},{"name":"b","arguments":{}},{"name":"c","argu'
    assert [c.name for c in tools.parse_calls(mistral, tools.MISTRAL)[1]] == ["a", "b"]
    assert tools.parse_calls('{"name":"a","parameters":{"x":1}}', tools.LLAMA3)[1][0].arguments == '{"x": 1}'
    assert tools.parse_calls("just prose, 42 of it", tools.LLAMA3)[1] == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # passes isdigit(), fails int()
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 7}}}, "tool_choice"),
    ],
)
def test_malformed_fields_are_400s_naming_them(body, param):
    from flover.server import openai_api as oa

    with pytest.raises(oa.ApiError) as e:
        oa.plan({"messages": [{"role": "user", "content": "hi"}], **body}, "chat", "m", lambda _: None, tools.HERMES)
    assert e.value.status == 400 and e.value.param == param


def test_a_call_nesting_past_the_parser_is_content_not_a_crash():
    text = "<tool_call>\n" + "[" * 1200
    assert tools.parse_calls(text, tools.HERMES) == (text, [])
    assert tools.parse_calls("[" * 5000, tools.LLAMA3) == ("[" * 5000, [])
    assert tools.parse_calls("[TOOL_CALLS]" + "[" * 5000, tools.MISTRAL)[1] == []
