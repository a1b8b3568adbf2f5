"""Tool calling: the tools into the prompt, the model's tool-call syntax back into calls, and the
structure that makes a required call parse (docs/tool_calling.md).

The syntax follows the chat template: Hermes-style `<tool_call>{json}</tool_call>` (Qwen 2 / 2.5 /
3, SmolLM3, Hermes, and the fallback), Llama 3.x's bare JSON object, Mistral's `[TOOL_CALLS][...]`,
Phi-4-mini's `functools[...]` (its template reads the tools from the system message's `tools`),
Qwen3-Coder's and Qwen3.5's XML (`<tool_call><function=NAME><parameter=P>value</parameter>...`),
Gemma 4's `<|tool_call>call:NAME{key:value,...}<tool_call|>` (strings between `<|"|>` marks),
gpt-oss's harmony messages to `functions.NAME` (`<|channel|>commentary to=functions.NAME ...
<|message|>{json}<|call|>`). A
template that does not render `tools` (SmolLM2's, for one) gets them as a Hermes-style system
prompt, and earlier calls and results as text, so any chat model can be asked."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from flover.reasoning import speaks_harmony
from flover.structured.spec import COMPACT

HERMES, LLAMA3, MISTRAL, PHI4, HARMONY = "hermes", "llama3", "mistral", "phi4", "harmony"
QWEN_XML = "qwen_xml"  # Qwen3-Coder's and Qwen3.5's <tool_call><function=NAME><parameter=P>...
GEMMA4 = "gemma4"  # <|tool_call>call:NAME{key:value,...}<tool_call|>, strings between <|"|> marks
PREFIXES = {MISTRAL: "[TOOL_CALLS]", PHI4: "functools"}  # what opens a JSON list of calls
MAX_TOOLS = 128
_NOT_JSON = (ValueError, RecursionError)  # (a model's text can nest past the parser's recursion)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def syntax_of(template_source: str | None) -> str:
    """The tool-call syntax a chat template's model writes."""
    source = template_source or ""
    if speaks_harmony(source):
        return HARMONY
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|tool|>" in source:
        return PHI4
    if "<|python_tag|>" in source or "ipython" in source:
        return LLAMA3
    if "<function=" in source and "<parameter=" in source:
        return QWEN_XML
    if "<|tool_call>call:" in source:
        return GEMMA4
    return HERMES


def renders_tools(template_source: str | None) -> bool:
    """Whether the template itself puts `tools` into the prompt."""
    return bool(template_source) and re.search(r"\btools\b", template_source) is not None


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}; ValueError naming the problem."""
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ValueError(f"tools: expected a list of 1 to {MAX_TOOLS} tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name: 1 to 64 letters, digits, _ . or -")
        if name in names:
            raise ValueError(f"tools[{i}].function.name: {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema object")
    return tools


def _arguments_object(arguments) -> dict:
    """A call's arguments for a template (HF templates take a mapping; OpenAI sends JSON text)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except _NOT_JSON:
            return {"_raw": arguments}
        return value if isinstance(value, dict) else {"_value": value}
    return arguments if isinstance(arguments, dict) else {}


def call_text(name: str, arguments, syntax: str) -> str:
    """How the model writes one call."""
    if syntax == QWEN_XML:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in _arguments_object(arguments).items()
        )
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if syntax == GEMMA4:
        return f"<|tool_call>call:{name}{gemma4_value(_arguments_object(arguments), keys_marked=False)}<tool_call|>"
    body = {"name": name, "arguments" if syntax != LLAMA3 else "parameters": _arguments_object(arguments)}
    text = json.dumps(body, ensure_ascii=False)
    if syntax in PREFIXES:
        return f"{PREFIXES[syntax]}[{text}]"
    if syntax == LLAMA3:
        return text
    return f"<tool_call>\n{text}\n</tool_call>"


def system_prompt(tools: list[dict]) -> str:
    """The tools as a Hermes-style system prompt, for templates that do not render them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are listed "
        f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a "
        "JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def prompt_messages(
    messages: list[dict], tools: list[dict] | None, template_source: str | None
) -> tuple[list[dict], dict]:
    """(messages, extra template variables) to render: with a template that renders tools, the
    messages as HF templates take them (call arguments as mappings) and `tools`; else the tools
    as a system prompt, and calls and results as plain text in the model's syntax."""
    syntax = syntax_of(template_source)
    if syntax == PHI4:
        return _phi4_messages(messages, tools), {}
    if renders_tools(template_source):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {
                    **m,
                    "tool_calls": [
                        {**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
                        for c in m["tool_calls"]
                    ],
                }
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(
                call_text(c["function"]["name"], c["function"]["arguments"], syntax) for c in m["tool_calls"]
            )
            content = f"{content}\n{calls}" if content else calls
        if m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _phi4_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Phi-4-mini's template renders a system message's `tools` (JSON text of the functions)
    between <|tool|> and <|/tool|>; earlier calls are text in its syntax."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = call_text_many([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]], PHI4)
            content = f"{content}{calls}"
        out.append({"role": m["role"], "content": content})
    if tools:
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "tools": listed}
        else:
            out.insert(
                0, {"role": "system", "content": "You are a helpful assistant with some tools.", "tools": listed}
            )
    return out


def call_text_many(calls: list[tuple[str, object]], syntax: str) -> str:
    """Several calls in one list, for syntaxes that write them so."""
    bodies = [json.dumps({"name": n, "arguments": _arguments_object(a)}, ensure_ascii=False) for n, a in calls]
    return f"{PREFIXES[syntax]}[{', '.join(bodies)}]"


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", re.S)


def _json_values(text: str) -> list:
    """The JSON values written one after another in `text` (a list's items if it is one list),
    as far as they are complete: the ones before a value cut off (max_tokens) still count."""
    decoder, values, at = json.JSONDecoder(), [], 0
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
            return value if isinstance(value, list) else [value]
        except _NOT_JSON:
            at = 1  # a list cut off: its complete items
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            value, at = decoder.raw_decode(text, at)
        except _NOT_JSON:
            break
        values.append(value)
    return values


def parse_calls(text: str, syntax: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """(the text before the calls, the calls) from a model's answer: every complete call (as
    vLLM's parsers: a call cut off by max_tokens is left out, the ones before it count); no
    calls where none parse. `tools`: the request's (the XML syntax types its values by them)."""
    found: list[tuple[int, object]] = []
    if syntax == HARMONY:
        return _harmony_calls(text)
    if syntax == QWEN_XML:
        return _xml_calls(text, tools or [])
    if syntax == GEMMA4:
        return _gemma4_calls(text)
    if syntax in PREFIXES and f"{PREFIXES[syntax]}[" in text:
        start = text.index(f"{PREFIXES[syntax]}[")
        found = [(start, v) for v in _json_values(text[start + len(PREFIXES[syntax]) :])]
    elif syntax == LLAMA3:
        found = [(0, v) for v in _json_values(text.replace("<|python_tag|>", ""))]
    else:
        for match in _HERMES_CALL.finditer(text):
            try:
                found.append((match.start(), json.loads(match.group(1))))
            except _NOT_JSON:
                if match.group(2):  # a closed call that is not JSON: the answer is not calls
                    return text, []
                break  # the last call, cut off
    calls = []
    for _, value in found:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return text, []
        arguments = value.get("arguments", value.get("parameters", {}))
        calls.append(
            ToolCall(
                value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            )
        )
    if not calls:
        return text, []
    return text[: found[0][0]].strip(), calls


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_calls(text: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """Qwen3-Coder's / Qwen3.5's calls: each complete <tool_call><function=NAME> block, its
    <parameter=P> values typed as the function's parameters schema says (a string parameter
    keeps its text; another is read as JSON where it parses, else kept as text), as vLLM's
    qwen3_coder parser does."""
    schemas = {
        t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
        for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    calls, first = [], None
    for match in _XML_CALL.finditer(text):
        name = match.group(1).strip()
        properties = schemas.get(name, {})
        arguments = {}
        for key, value in _XML_PARAMETER.findall(match.group(2)):
            arguments[key.strip()] = _xml_value(value, properties.get(key.strip()))
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        first = match.start() if first is None else first
    return (text, []) if not calls else (text[:first].strip(), calls)


def _xml_value(text: str, schema) -> object:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and "null" not in kind):
        return text
    try:
        return json.loads(text)
    except _NOT_JSON:
        return text


# -- Gemma 4's calls: <|tool_call>call:NAME{key:value,...}<tool_call|> ------------------------
QUOTE = '<|"|>'  # (a special token of its vocabulary: strings hold anything but it, unescaped)
_GEMMA4_CALL = re.compile(r"<\|tool_call>call:([A-Za-z0-9_.-]+)(?=\{)")
MAX_NESTING = 64


def gemma4_value(value, keys_marked: bool = True) -> str:
    """A value as Gemma 4's template writes it (its format_argument macro)."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        key = (lambda k: f"{QUOTE}{k}{QUOTE}") if keys_marked else str
        return "{" + ",".join(f"{key(k)}:{gemma4_value(v, keys_marked)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(gemma4_value(v, keys_marked) for v in value) + "]"
    return "null" if value is None else json.dumps(value)


def _gemma4_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Each complete call (its argument object read whole and closed by <tool_call|>); a call cut
    off, or one whose arguments do not read, ends the calls (the ones before it count)."""
    calls, first = [], None
    for match in _GEMMA4_CALL.finditer(text):
        try:
            arguments, end = _gemma4_read(text, match.end(), 0)
        except ValueError:
            break
        if not isinstance(arguments, dict) or not text.startswith("<tool_call|>", end):
            break
        calls.append(ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False)))
        first = match.start() if first is None else first
    return (text, []) if not calls else (text[:first].strip(), calls)


def _gemma4_read(text: str, at: int, depth: int) -> tuple[object, int]:
    """(the value at `at`, where it ends); ValueError where none reads."""
    if depth > MAX_NESTING:
        raise ValueError("nested too deep")
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("a string not closed")
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", at) or text.startswith("[", at):
        mapping, close, items, at = text[at] == "{", "}" if text[at] == "{" else "]", [], at + 1
        while not text.startswith(close, at):
            if items:
                if not text.startswith(",", at):
                    raise ValueError("items not separated")
                at += 1
            key = None
            if mapping:
                key, at = _gemma4_key(text, at)
            value, at = _gemma4_read(text, at, depth + 1)
            items.append((key, value))
        return (dict(items) if mapping else [v for _, v in items]), at + 1
    m = re.compile(r"[^,}\]<]+").match(text, at)
    if m is None:
        raise ValueError("no value")
    word = m.group(0).strip()
    literals = {"true": True, "false": False, "null": None, "None": None}
    if word in literals:
        return literals[word], m.end()
    try:
        return json.loads(word), m.end()
    except _NOT_JSON:
        return word, m.end()


def _gemma4_key(text: str, at: int) -> tuple[str, int]:
    """A mapping's key (bare, or between quote marks) and the colon after it."""
    if text.startswith(QUOTE, at):
        key, at = _gemma4_read(text, at, 0)
    else:
        m = re.compile(r"[^:{}\[\],<]+").match(text, at)
        if m is None:
            raise ValueError("no key")
        key, at = m.group(0).strip(), m.end()
    if not text.startswith(":", at):
        raise ValueError("a key without a value")
    return key, at + 1


# a harmony message that ends in a call: its header (the recipient before or after the channel),
# its body, <|call|>
_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>([^<]*))?<\|channel\|>([^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)<\|call\|>", re.DOTALL
)
_HARMONY_FUNCTION = re.compile(r"\bto=functions\.([\w.-]+)")


def _harmony_calls(text: str) -> tuple[str, list[ToolCall]]:
    """gpt-oss's calls: each complete message to `functions.NAME` whose body is a JSON object."""
    calls, first = [], None
    for match in _HARMONY_CALL.finditer(text):
        function = _HARMONY_FUNCTION.search(f"{match.group(1) or ''} {match.group(2)}")
        if function is None:  # (a call to another recipient: not a function's)
            continue
        try:
            arguments = json.loads(match.group(3))
        except _NOT_JSON:
            return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append(ToolCall(function.group(1), json.dumps(arguments, ensure_ascii=False)))
        first = match.start() if first is None else first
    return (text, []) if not calls else (text[:first].strip(), calls)


def required_structure(tools: list[dict], choice, parallel: bool, syntax: str) -> dict | None:
    """The `structured` map that makes the answer a call (tool_choice "required" or a named
    function): each call's arguments follow its function's parameters schema. None for "auto"
    and "none"."""
    if choice in (None, "auto", "none"):
        return None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice: expected {"type": "function", "function": {"name": ...}}')
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise ValueError(f"tool_choice: no tool is named {name!r}")
        parallel = False
    elif choice != "required":
        raise ValueError(
            'tool_choice: expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if syntax == HARMONY:  # (its calls open with special tokens, which a grammar here does not write)
        raise ValueError('tool_choice: this model writes harmony tool calls; only "auto" and "none" are supported')
    if syntax == QWEN_XML:  # (its parameters are XML around each value, no JSON schema to hold them to)
        raise ValueError('tool_choice: this model writes XML tool calls; only "auto" and "none" are supported')
    if syntax == GEMMA4:  # (its values are not JSON: strings between <|"|> marks, bare keys)
        raise ValueError('tool_choice: this model writes Gemma 4 tool calls; only "auto" and "none" are supported')
    key = "parameters" if syntax == LLAMA3 else "arguments"
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: t["function"].get("parameters", {"type": "object"}),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {**({"anyOf": one_of} if len(one_of) > 1 else one_of[0]), "x-guidance": COMPACT}
    body = "%json " + json.dumps(schema)
    if syntax in PREFIXES:
        more = ' ("," call)*' if parallel else ""
        grammar = f'start: "{PREFIXES[syntax]}[" call{more} "]"\ncall: {body}'
    elif syntax == LLAMA3:
        grammar = f"start: call\ncall: {body}"
    else:
        more = ' ("\\n" call)*' if parallel else ""
        grammar = f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: {body}'
    return {"kind": "grammar", "value": grammar}
