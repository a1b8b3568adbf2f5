"""Thinking apart from the answer (flover/reasoning.py), and a chat template's own variables
(`chat_template_kwargs`): alone, and through a real daemon and HTTP front."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import pytest

from flover.reasoning import (
    ReasoningStream,
    answer_stream,
    split_answer,
    split_reasoning,
    template_format,
    template_thinks,
)
from tests.helpers import Server, free_port

ANSWERS = [
    "<think>a plan</think>\n\nThe answer.",
    "  <think>\nstep 1\nstep 2\n</think>The answer.",
    "<think>cut off before the end",
    "No thinking here.",
    "<thin is not the tag",
    "   ",
    "<think></think>",
    "",
    # cut at a tag (max_tokens): an answer that is exactly the opening tag, or part of a tag
    "<think>",
    "  <think>",
    "\n<think>\n",
    "<thi",
    "<",
    "<think>x</thi",
    "<think>x</think>",
    "<think>x</think>  ",
    "<think></think>",
]


def fed_in_pieces(stream, text: str, size: int) -> tuple[str, str]:
    """(thinking, answer): `text` fed to `stream` `size` characters at a time, then finished."""
    thinking = answer = ""
    for at in range(0, len(text), size):
        t, a = stream.feed(text[at : at + size])
        thinking, answer = thinking + t, answer + a
    t, a = stream.finish()
    return thinking + t, answer + a


@pytest.mark.parametrize("text", ANSWERS)
def test_a_stream_split_token_by_token_gives_the_whole_answers_split(text):
    for size in (1, 2, 3, 7, 100):
        whole_thinking, whole_answer = split_reasoning(text)
        assert fed_in_pieces(ReasoningStream(), text, size) == (whole_thinking or "", whole_answer), (text, size)


def test_the_split_of_whole_answers():
    assert split_reasoning("<think>") == ("", "") and split_reasoning("<thi") == (None, "<thi")
    assert split_reasoning("<think>x</thi") == ("x</thi", "")
    assert split_reasoning(ANSWERS[0]) == ("a plan", "The answer.")
    assert split_reasoning(ANSWERS[2]) == ("cut off before the end", "")
    assert split_reasoning(ANSWERS[3]) == (None, "No thinking here.")
    assert split_reasoning("The answer <think>x</think>") == (None, "The answer <think>x</think>")
    assert template_thinks("...<think>...</think>...") and not template_thinks("{{ messages }}")


THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def front_with_template(make_model, tmp_path_factory, template: str, max_seq_len: int = 256):
    """A daemon and HTTP front on the llama test checkpoint with `template` as its chat template."""
    model = tmp_path_factory.mktemp("front") / "model"
    shutil.copytree(make_model("llama"), model)
    (model / "chat_template.jinja").write_text(template)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    port = free_port()
    server = Server(str(model), "--max-seq-len", str(max_seq_len), "--http", f"127.0.0.1:{port}")
    yield server, f"http://127.0.0.1:{port}"
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def thinking_front(make_model, tmp_path_factory):
    """A daemon and HTTP front on a checkpoint whose chat template knows thinking blocks."""
    yield from front_with_template(make_model, tmp_path_factory, THINKING_TEMPLATE)


def chat(url: str, **body) -> httpx.Response:
    messages = [{"role": "user", "content": "Think first."}]
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 40, **body}, timeout=60)


def streamed_fields(url: str, body: dict) -> tuple[str, str]:
    """(thinking, answer): a chat completion streamed, its deltas' reasoning_content and content added up."""
    thinking, answer = "", ""
    body = {"messages": [{"role": "user", "content": "Think first."}], "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                thinking += delta.get("reasoning_content") or ""
                answer += delta.get("content") or ""
    return thinking, answer


FORCED = {"guided_regex": "<think>[a-d]{3}</think>\\n[e-h]{4}"}  # the model can only write this shape


def test_thinking_comes_back_apart_from_the_answer(thinking_front):
    _, url = thinking_front
    message = chat(url, **FORCED).json()["choices"][0]["message"]
    assert len(message["reasoning_content"]) == 3 and set(message["reasoning_content"]) <= set("abcd")
    assert len(message["content"]) == 4 and set(message["content"]) <= set("efgh")


@pytest.mark.parametrize("shape", ["<think>", "  <think>", "<think>ab</thi"])
def test_an_answer_cut_at_a_tag_is_the_same_streamed_or_not(thinking_front, shape):
    """max_tokens on a thinking model cuts answers right at a tag: the streamed deltas add up to
    the whole answer's fields (a bare <think> was content when streamed, nothing when not)."""
    _, url = thinking_front
    forced = {"guided_regex": shape.replace("<", "[<]"), "max_tokens": 40}
    whole = chat(url, **forced).json()["choices"][0]["message"]
    thinking, answer = streamed_fields(url, forced)
    assert (thinking, answer) == (whole.get("reasoning_content") or "", whole["content"] or ""), (shape, whole)
    assert answer == ""


def test_streamed_thinking_and_answer_arrive_in_their_own_fields(thinking_front):
    _, url = thinking_front
    whole = chat(url, **FORCED, seed=3, temperature=1.0).json()["choices"][0]["message"]
    thinking, answer, roles = "", "", 0
    body = {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 40, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, **FORCED, "seed": 3, "temperature": 1.0}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                roles += "role" in delta
                thinking += delta.get("reasoning_content") or ""
                answer += delta.get("content") or ""
    assert (thinking, answer) == (whole["reasoning_content"], whole["content"]) and roles == 1


def test_chat_template_kwargs_reach_the_template(thinking_front):
    _, url = thinking_front
    messages = [{"role": "user", "content": "Think first."}]  # (chat()'s)
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    off = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.status_code == 200 and off.json()["count"] > plain["count"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": off.json()["tokens"]}).json()["prompt"]
    assert text.endswith("<think>\n\n</think>\n\n")
    # the daemon renders the chat with them too: the prompt grows by the same tokens
    usage = chat(url, max_tokens=1, chat_template_kwargs={"enable_thinking": False}).json()["usage"]
    assert usage["prompt_tokens"] == off.json()["count"]
    for bad in ({"messages": 1}, {"x": {"nested": 1}}, {"not a name": 1}, [1]):
        refused = chat(url, chat_template_kwargs=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs", bad


def test_chat_template_kwargs_over_the_zeromq_socket(thinking_front):
    from flover.client import Client, FloverError

    server, url = thinking_front
    messages = [{"role": "user", "content": "Think first."}]
    off = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    with Client(server.addr) as client:
        final = client.generate(messages=messages, chat_template_kwargs={"enable_thinking": False}, max_new_tokens=1)
        assert final["usage"]["prompt_tokens"] == off.json()["count"]
        for bad in ({"add_generation_prompt": False}, {"x": [1]}):
            with pytest.raises(FloverError, match="chat_template_kwargs") as refused:
                client.generate(messages=messages, chat_template_kwargs=bad, max_new_tokens=1)
            assert refused.value.code == "invalid_request"
        with pytest.raises(FloverError, match="go with `messages`"):
            client.generate("a prompt", chat_template_kwargs={"enable_thinking": False}, max_new_tokens=1)


# gpt-oss's harmony answers (the prompt ends with <|start|>assistant)
HARMONY_ANSWERS = [
    "<|channel|>analysis<|message|>a plan<|end|><|start|>assistant<|channel|>final<|message|>The answer.<|return|>",
    "<|channel|>analysis<|message|>cut off in the thinking",
    "<|channel|>final<|message|>No thinking here.<|return|>",
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
    '<|message|>{"a": 1}<|call|>',
    "plain text with a < and <| in it",
    "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>",
    "",
]


@pytest.mark.parametrize("text", HARMONY_ANSWERS)
def test_a_harmony_stream_split_piece_by_piece_gives_the_whole_answers_split(text):
    for size in (1, 2, 3, 7, 100):
        whole_thinking, whole_answer = split_answer(text, "harmony")
        assert fed_in_pieces(answer_stream("harmony"), text, size) == (whole_thinking or "", whole_answer), (text, size)


def test_the_harmony_split_of_whole_answers():
    """analysis -> thinking, final -> answer, a message to a tool stays as written (for the tool
    parser), text outside any message is answer; markers never reach either field otherwise."""
    assert split_answer(HARMONY_ANSWERS[0], "harmony") == ("a plan", "The answer.")
    assert split_answer(HARMONY_ANSWERS[1], "harmony") == ("cut off in the thinking", "")
    assert split_answer(HARMONY_ANSWERS[2], "harmony") == (None, "No thinking here.")
    thinking, answer = split_answer(HARMONY_ANSWERS[3], "harmony")
    assert thinking == "x" and answer.startswith("<|start|>assistant<|channel|>commentary to=functions.f")
    assert answer.endswith('<|message|>{"a": 1}<|call|>')
    assert split_answer(HARMONY_ANSWERS[4], "harmony") == (None, HARMONY_ANSWERS[4])
    assert split_answer(HARMONY_ANSWERS[5], "harmony") == ("onetwo", "")
    assert template_format(HARMONY_TEMPLATE) == "harmony" and template_format(THINKING_TEMPLATE) == "think"
    assert template_format("{{ messages }}") == "" and template_format(None) == ""


# gpt-oss's shape in small: its markers, the answer opened by <|start|>assistant
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def test_a_harmony_models_text_keeps_its_special_tokens(make_model):
    """Its channels are special tokens: decoding keeps them where the template speaks harmony (so
    the front can split the answer), and drops them elsewhere as before."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from flover.models.tokenizer import Tokenizer

    backend = HFTokenizer.from_file(f"{make_model('llama')}/tokenizer.json")
    backend.add_special_tokens([AddedToken(m, special=True) for m in HARMONY_MARKERS])
    text = "<|channel|>final<|message|>hello<|return|>"
    ids = backend.encode(text, add_special_tokens=False).ids
    assert Tokenizer(backend, {}, HARMONY_TEMPLATE).decode(ids) == text
    assert Tokenizer(backend, {}, THINKING_TEMPLATE).decode(ids) == "finalhello"


@pytest.fixture(scope="module")
def harmony_front(make_model, tmp_path_factory):
    """A daemon and HTTP front on a checkpoint whose template speaks harmony (its markers plain
    added tokens here, so that a guided regex can write them)."""
    yield from front_with_template(make_model, tmp_path_factory, HARMONY_TEMPLATE)


HARMONY_FORCED = {
    "guided_regex": "<\\|channel\\|>analysis<\\|message\\|>[a-d]{3}<\\|end\\|><\\|start\\|>assistant"
    "<\\|channel\\|>final<\\|message\\|>[e-h]{4}"
}


def test_harmony_thinking_and_answer_come_back_apart_whole_and_streamed(harmony_front):
    _, url = harmony_front
    forced = {**HARMONY_FORCED, "max_tokens": 200, "seed": 5, "temperature": 1.0}  # (the markers take many tokens)
    message = chat(url, **forced).json()["choices"][0]["message"]
    assert len(message["reasoning_content"]) == 3 and set(message["reasoning_content"]) <= set("abcd")
    assert len(message["content"]) == 4 and set(message["content"]) <= set("efgh")
    assert streamed_fields(url, forced) == (message["reasoning_content"], message["content"])


# Qwen3.5's shape (llama.cpp's models/templates/Qwen3.5-4B.jinja): its generation prompt opens the
# thinking block ('<think>\n'), or writes it empty and closed when thinking is off; tools in its
# XML call syntax
OPENING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


# a tool with a string and an integer parameter (a string value that looks like a number stays a string)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def opening_front(make_model, tmp_path_factory):
    yield from front_with_template(make_model, tmp_path_factory, OPENING_TEMPLATE, max_seq_len=512)  # (tools)


def test_a_template_that_opens_the_thinking_block():
    assert template_format(OPENING_TEMPLATE) == "think_open" and template_format(THINKING_TEMPLATE) == "think"
    assert split_answer("a plan\n</think>\n\nThe answer.", "think_open") == ("a plan\n", "The answer.")
    assert split_answer("cut off while thinking", "think_open") == ("cut off while thinking", "")
    stream, fields = answer_stream("think_open"), ["", ""]
    for piece in ["a pl", "an\n</th", "ink>\n", "\nThe answer."]:
        for i, part in enumerate(stream.feed(piece)):
            fields[i] += part
    assert tuple(fields) == ("a plan\n", "The answer.")


def test_thinking_opened_by_the_prompt_and_xml_tool_calls_over_http(opening_front):
    """Qwen3.5's way: the answer starts inside the thinking block the prompt opened (whole and
    streamed), plain when the request turns thinking off; its XML tool calls become tool_calls,
    each value typed by the tool's parameters."""
    _, url = opening_front
    forced = {"guided_regex": "[a-d]{3}</think>\\n\\n[e-h]{4}", "temperature": 0, "max_tokens": 40}
    message = chat(url, **forced).json()["choices"][0]["message"]
    assert len(message["reasoning_content"]) == 3 and len(message["content"]) == 4
    assert streamed_fields(url, forced) == (message["reasoning_content"], message["content"])
    off = {"guided_regex": "[e-h]{4}", "chat_template_kwargs": {"enable_thinking": False}}
    message = chat(url, **off).json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None and len(message["content"]) == 4
    call = "<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n42\\n</parameter>\\n<parameter=days>\\n2\\n"
    call += "</parameter>\\n</function>\\n</tool_call>"
    body = {"tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 120}
    answer = chat(url, guided_regex=call, **body).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    (found,) = answer["message"]["tool_calls"]
    assert found["function"]["name"] == "get_weather"
    assert json.loads(found["function"]["arguments"]) == {"city": "42", "days": 2}  # a string stays a string


# Gemma 4's shape (llama.cpp's models/templates/google-gemma-4-31B-it.jinja): answers open a
# thinking channel when thinking is on; the generation prompt writes it empty and closed otherwise
CHANNEL_TEMPLATE = (
    "{% if tools %}<|turn>system\n{% for t in tools %}<|tool>{{ t | tojson }}<tool|>{% endfor %}<turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{{ '<|tool_call>call:' + c['function']['name'] + '{}<tool_call|>' }}"
    "{% endfor %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}"
    "{% if not enable_thinking | default(false) %}{{ '<|channel>thought\\n<channel|>' }}{% endif %}{% endif %}"
)


def test_gemma4_thinking_channel_split_whole_and_piece_by_piece():
    assert template_format(CHANNEL_TEMPLATE) == "channel"
    answer = "<|channel>thought\na plan<channel|>The answer."
    assert split_answer(answer, "channel") == ("\na plan", "The answer.")
    assert split_answer("The answer.", "channel") == (None, "The answer.")
    assert split_answer("<think>x</think>y", "channel") == (None, "<think>x</think>y")
    stream, fields = answer_stream("channel"), ["", ""]
    for piece in ["<|chan", "nel>thou", "ght\na pl", "an<chan", "nel|>The answer."]:
        for i, part in enumerate(stream.feed(piece)):
            fields[i] += part
    assert tuple(fields) == ("\na plan", "The answer.")


def test_a_gemma4_models_text_keeps_its_channel_tokens_only(make_model):
    """Its channel and tool-call markers are special tokens: decoding keeps those the template
    uses (so the front can split the answer) and drops the other special tokens (its turn end)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from flover.models.tokenizer import Tokenizer

    backend = HFTokenizer.from_file(f"{make_model('llama')}/tokenizer.json")
    backend.add_special_tokens([AddedToken(m, special=True) for m in ("<|channel>", "<channel|>", "<turn|>")])
    ids = backend.encode("<|channel>thought a<channel|>b<turn|>", add_special_tokens=False).ids
    assert Tokenizer(backend, {}, CHANNEL_TEMPLATE).decode(ids) == "<|channel>thought a<channel|>b"
    assert Tokenizer(backend, {}, THINKING_TEMPLATE).decode(ids) == "thought ab"


@pytest.fixture(scope="module")
def channel_front(make_model, tmp_path_factory):
    yield from front_with_template(make_model, tmp_path_factory, CHANNEL_TEMPLATE, max_seq_len=512)  # (tools)


def test_gemma4_thinking_over_http_whole_and_streamed(channel_front):
    """With enable_thinking the answer's channel becomes reasoning_content (whole and streamed
    alike); without it the prompt closed the channel and the answer is all content."""
    _, url = channel_front
    forced = {"guided_regex": "<\\|channel>thought\\n[a-d]{3}<channel\\|>[e-h]{4}", "temperature": 0}
    forced["chat_template_kwargs"] = {"enable_thinking": True}
    message = chat(url, **forced).json()["choices"][0]["message"]
    assert len(message["reasoning_content"].strip()) == 3 and len(message["content"]) == 4
    assert streamed_fields(url, forced) == (message["reasoning_content"], message["content"])
    message = chat(url, guided_regex="[e-h]{4}").json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None and len(message["content"]) == 4
    call = '<\\|tool_call>call:get_weather\\{city:<\\|"\\|>42<\\|"\\|>,days:2\\}<tool_call\\|>'
    answer = chat(url, guided_regex=call, tools=[WEATHER], max_tokens=80).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    (found,) = answer["message"]["tool_calls"]
    assert found["function"]["name"] == "get_weather"
    assert json.loads(found["function"]["arguments"]) == {"city": "42", "days": 2}  # (a string stays a string)
