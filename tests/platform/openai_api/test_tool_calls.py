"""Tool calling, the model-format side: parsers, their streams, forced choices, validation, prompts.

Pure functions: no engine, no HTTP, no database. The central property is that a stream fed any
chunking of an output sends the same content and the same calls that parse() finds in it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from errors import InvalidRequest
from openai_api.tool_calls import (
    PARSERS,
    ParsedOutput,
    choose_parser,
    forced_spec,
    forced_stream,
    parse_forced,
    validate_tools,
)

WS = " \t\n\r"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]


def parse(parser: str, text: str) -> ParsedOutput:
    return PARSERS[parser]().parse(text)


def calls(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


# ---------------------------------------------------------------- hermes


def test_hermes_one_call_is_only_a_call():
    parsed = parse("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert re.fullmatch(r"call_[0-9a-f]{24}", parsed.tool_calls[0].id)
    assert parsed.tool_calls[0].as_openai() == {
        "id": parsed.tool_calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_hermes_two_calls_with_content_before_them():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>\n'
    )
    parsed = parse("hermes", text)
    assert parsed.content == "Let me look."  # whitespace around the blocks is theirs
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_arguments_are_compact_json_of_the_object():
    raw = '{"b":[1,2.50,true,null],"a":{"x":"\\u00e9\\ud83d\\ude00\\n"},"c":1E2}'
    parsed = parse("hermes", f'<tool_call>{{"name":"f","arguments":{raw}}}</tool_call>')
    assert parsed.tool_calls[0].arguments == json.dumps(json.loads(raw), ensure_ascii=False)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',  # broken JSON
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # a name that is not a string
        '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',  # arguments that are not an object
        'Sure <tool_call>\n{"name": "f", "arguments": {}}\n junk </tool_call>',  # text inside the block
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off mid-call
    ],
)
def test_hermes_malformed_block_makes_the_whole_output_content(text):
    assert parse("hermes", text) == ParsedOutput(content=text, tool_calls=[])


@pytest.mark.parametrize("text", ["Hello there.", "", "  spaced  \n", "a <tool here", "</tool_call> stray"])
def test_hermes_output_without_calls_is_content_exactly(text):
    assert parse("hermes", text) == ParsedOutput(content=text, tool_calls=[])


def test_hermes_last_block_may_stop_before_its_end_tag():
    parsed = parse("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_')
    assert parsed.content is None and calls(parsed) == [("now", {})]


# ---------------------------------------------------------------- llama3_json and mistral


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "now", "arguments": {}}', [("now", {})]),
        (
            '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
            [("now", {}), ("get_weather", {"city": "Oslo"})],
        ),
    ],
)
def test_llama3_json_calls(text, expected):
    parsed = parse("llama3_json", text)
    assert parsed.content is None and calls(parsed) == expected


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",
        '{"answer": 42}',
        '{"name": "f", "parameters": {"a": ',
        "",
        "<|python_tag|>print(1)",
        '  {"name": "f"}',
    ],
)
def test_llama3_json_text_that_is_not_a_call_is_content(text):
    assert parse("llama3_json", text) == ParsedOutput(content=text, tool_calls=[])


def test_llama3_json_text_after_the_calls_is_content():
    parsed = parse("llama3_json", '{"name": "now", "parameters": {}} I called it.')
    assert parsed.content == " I called it." and calls(parsed) == [("now", {})]


@pytest.mark.parametrize(
    "text, content, expected",
    [
        ('[TOOL_CALLS] [{"name": "now", "arguments": {}}]', None, [("now", {})]),
        (
            'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "now", "arguments": {}}]',
            "Checking.",
            [("get_weather", {"city": "Rome"}), ("now", {})],
        ),
    ],
)
def test_mistral_calls(text, content, expected):
    parsed = parse("mistral", text)
    assert parsed.content == content and calls(parsed) == expected


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        "[TOOL_CALLS] not a list",
        "[TOOL_CALLS] []",
        '[TOOL_CALLS] [{"name": "f", "arguments": {]',
        "[TOOL",
    ],
)
def test_mistral_without_calls_or_malformed_is_content(text):
    assert parse("mistral", text) == ParsedOutput(content=text, tool_calls=[])


# ---------------------------------------------------------------- streaming


def run_stream(stream, pieces: list[str]) -> list[dict]:
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    return deltas + stream.end()


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_stream_agrees(stream, pieces: list[str], parsed: ParsedOutput) -> None:
    """OpenAI's delta shapes, and content and calls that add up to what parse() says."""
    deltas = run_stream(stream, pieces)
    content, headers, arguments = "", {}, defaultdict(str)
    for delta in deltas:
        if "content" in delta:
            assert set(delta) == {"content"} and delta["content"]
            content += delta["content"]
            continue
        assert set(delta) == {"tool_calls"} and len(delta["tool_calls"]) == 1
        call = delta["tool_calls"][0]
        if "id" in call:  # the first delta of a call: id, type, name, empty arguments
            assert call["index"] not in headers and call["index"] == len(headers)
            assert call["type"] == "function" and call["function"]["arguments"] == ""
            headers[call["index"]] = call
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            assert call["index"] in headers, "arguments before the call's header"
            arguments[call["index"]] += call["function"]["arguments"]
    assert content == (parsed.content or "")
    assert [headers[i]["function"]["name"] for i in sorted(headers)] == [c.name for c in parsed.tool_calls]
    assert [arguments[i] for i in sorted(headers)] == [c.arguments for c in parsed.tool_calls]
    assert [(c.name, c.arguments) for c in stream.tool_calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
    assert [c.id for c in stream.tool_calls] == [headers[i]["id"] for i in sorted(headers)]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
arguments_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
# Content built from pieces that look like the formats' markers, so hold-back is exercised.
content_pieces = st.sampled_from(
    [
        "Hi",
        " ",
        "\n",
        "é😀",
        "<",
        "<tool",
        "<tool_call",
        "</tool_call>",
        "[",
        "[TOOL",
        "[TOOL_CALLS",
        "<|python",
        "{",
        "}",
        '"',
        "x",
        "\t",
    ]
)
contents = st.lists(content_pieces, max_size=6).map("".join)


@st.composite
def json_text(draw, value) -> str:
    """value as JSON the way some model might write it: any of json.dumps' layouts and escapes."""
    return json.dumps(
        value,
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 1])),
        separators=draw(st.sampled_from([None, (",", ":"), (", ", ": ")])),
    )


@st.composite
def call_object(draw, key: str = "arguments"):
    name, arguments = draw(names), draw(arguments_objects)
    pairs = [("name", name), (key, arguments)]
    if draw(st.booleans()):
        pairs.reverse()  # arguments first: the header waits for the name
    if draw(st.booleans()):
        pairs.insert(1, ("id", draw(json_values)))  # a key the parsers read past
    text = "{" + ", ".join(f"{json.dumps(k)}: {draw(json_text(v))}" for k, v in pairs) + "}"
    return text, (name, json.dumps(arguments, ensure_ascii=False))


def expected_content(pieces: list[str], has_calls: bool) -> str | None:
    """Content as the parsers define it: whitespace just before a call, or ending the output, is dropped."""
    if not has_calls:
        return "".join(pieces)
    content = ""
    for piece in pieces[:-1]:
        content = (content + piece).rstrip(WS)
    return (content + pieces[-1]).rstrip(WS) or None


@st.composite
def hermes_outputs(draw):
    pieces, text, expected = [draw(contents)], "", []
    text += pieces[0]
    for _ in range(draw(st.integers(0, 3))):
        block = "<tool_call>" + draw(st.sampled_from(["\n", "", " "]))
        for k in range(draw(st.integers(1, 2))):  # some models put two objects in one block
            obj, call = draw(call_object())
            block += ("\n" if k else "") + obj
            expected.append(call)
        block += draw(st.sampled_from(["\n", ""])) + "</tool_call>"
        text += block
        pieces.append(draw(contents))
        text += pieces[-1]
    assume(text.count("<tool_call>") == len(pieces) - 1)
    return text, expected_content(pieces, bool(expected)), expected


@st.composite
def llama3_outputs(draw):
    text = draw(st.sampled_from(["", " ", "\n"])) + draw(st.sampled_from(["", "<|python_tag|>"]))
    expected = []
    for k in range(draw(st.integers(1, 3))):
        obj, call = draw(call_object(draw(st.sampled_from(["parameters", "arguments"]))))
        text += (draw(st.sampled_from([";", "; ", " ;\n"])) if k else "") + obj
        expected.append(call)
    tail = draw(st.sampled_from(["", " Done", "\nDone."])) + draw(contents)
    if tail and not tail.strip(WS):
        tail = ""
    return text + tail, tail.rstrip(WS) or None, expected


@st.composite
def mistral_outputs(draw):
    before = draw(contents)
    items = [draw(call_object()) for _ in range(draw(st.integers(1, 3)))]
    array = "[" + draw(st.sampled_from([",", ", ", ",\n"])).join(obj for obj, _ in items) + "]"
    after = draw(contents)
    text = before + "[TOOL_CALLS]" + draw(st.sampled_from(["", " "])) + array + after
    assume(text.count("[TOOL_CALLS]") == 1)
    return text, expected_content([before, after], True), [call for _, call in items]


OUTPUTS = {"hermes": hermes_outputs(), "llama3_json": llama3_outputs(), "mistral": mistral_outputs()}
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("parser", list(PARSERS))
@FAST
@given(data=st.data())
def test_any_chunking_of_well_formed_output_streams_what_parse_finds(parser, data):
    text, content, expected = data.draw(OUTPUTS[parser])
    parsed = parse(parser, text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_agrees(PARSERS[parser]().stream(), split(text, cuts), parsed)


malformed_blocks = st.sampled_from(
    [
        '<tool_call>\n{"name": 3}</tool_call>',
        "<tool_call>oops</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        "<tool_call>\n{",
        '[TOOL_CALLS] [{"name": "f"}]',
        "[TOOL_CALLS] nope",
        "{not json",
        "{}",
    ]
)


@pytest.mark.parametrize("parser", list(PARSERS))
@FAST
@given(data=st.data())
def test_any_chunking_of_text_without_calls_streams_it_all_as_content(parser, data):
    """Plain text, or a first block broken before any call was sent: the whole output is content."""
    text = data.draw(contents) + data.draw(st.just("") | malformed_blocks) + data.draw(contents)
    parsed = parse(parser, text)
    assume(not parsed.tool_calls)
    assert parsed.content == text
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_agrees(PARSERS[parser]().stream(), split(text, cuts), parsed)


def test_a_possible_marker_is_held_back_until_decided():
    stream = PARSERS["hermes"]().stream()
    assert stream.feed("Hi <tool") == [{"content": "Hi"}]
    assert stream.feed("kit") == [{"content": " <toolkit"}]
    mistral = PARSERS["mistral"]().stream()
    assert mistral.feed("x [TOOL") == [{"content": "x"}]
    assert mistral.feed("_CALLS] [") == []


def test_arguments_stream_before_the_call_is_complete():
    stream = PARSERS["hermes"]().stream()
    deltas = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]}
    assert stream.feed('is"}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}]
    assert stream.end() == []
    assert [(c.name, c.arguments) for c in stream.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_call_broken_after_its_header_went_out_is_flagged_not_raised():
    stream = PARSERS["hermes"]().stream()
    deltas = run_stream(stream, ['<tool_call>{"name": "f", "arguments": {"a": 1', "x}}</tool_call>"])
    assert stream.malformed and stream.tool_calls[0].name == "f"
    assert "".join(d.get("content", "") for d in deltas) == "x}}</tool_call>"
    assert parse("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1x}}</tool_call>').tool_calls == []


# ---------------------------------------------------------------- choosing a parser


def fake_tokenizer(vocab=(), template=""):
    return SimpleNamespace(get_vocab=lambda: {token: i for i, token in enumerate(vocab)}, chat_template=template)


@pytest.mark.parametrize(
    "tokenizer, expected",
    [
        (fake_tokenizer(["a", "[TOOL_CALLS]"]), "mistral"),
        (fake_tokenizer(["a", "<|python_tag|>"]), "llama3_json"),
        (fake_tokenizer(template="{% if message.role == 'ipython' %}"), "llama3_json"),
        (fake_tokenizer(template={"default": "x", "tool_use": "<|python_tag|>"}), "llama3_json"),
        (fake_tokenizer(["<tool_call>"], "<|im_start|>"), "hermes"),
        (SimpleNamespace(), "hermes"),
    ],
)
def test_choose_parser_by_tokenizer(tokenizer, expected):
    assert choose_parser(tokenizer) == expected


def test_choose_parser_override_wins_and_unknown_names_say_the_choices():
    assert choose_parser(fake_tokenizer(["[TOOL_CALLS]"]), "hermes") == "hermes"
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        choose_parser(None, "pythonic")


def test_the_tiny_test_tokenizer_is_hermes(tiny_model_dir):
    from inference.loader import load_tokenizer

    assert choose_parser(load_tokenizer(tiny_model_dir)) == "hermes"


# ---------------------------------------------------------------- forced choices


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_forced_spec_shapes():
    assert forced_spec(TOOLS, "none") is None and forced_spec(TOOLS, "auto") is None
    assert forced_spec(TOOLS, named("get_weather")) == {"json": WEATHER["function"]["parameters"]}
    assert forced_spec(TOOLS, named("now")) == {"json": {"type": "object"}}
    spec = forced_spec(TOOLS, "required")["json"]
    assert spec["type"] == "array" and spec["minItems"] == 1 and "maxItems" not in spec
    assert spec["items"]["anyOf"][1] == {
        "type": "object",
        "properties": {"name": {"const": "now"}, "parameters": {"type": "object"}},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    assert forced_spec(TOOLS, "required", parallel_tool_calls=False)["json"]["maxItems"] == 1


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), (named("get_weather"), True)])
def test_the_grammar_compiles_forced_specs_and_its_output_parses_back(choice, parallel):
    from inference.structured_output import StructuredOutputs, build_grammar, check_syntax

    spec = StructuredOutputs(**forced_spec(TOOLS, choice, parallel))
    check_syntax(spec)
    xgrammar_testing = pytest.importorskip("xgrammar.testing")
    accepts = getattr(xgrammar_testing, "_is_grammar_accept_string", None)
    if accepts is None:
        pytest.skip("this xgrammar has no string-acceptance helper")
    grammar = build_grammar(spec)
    if choice == "required":
        two = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
        assert accepts(grammar, two) is parallel
        assert not accepts(grammar, '[{"name": "other", "parameters": {}}]') and not accepts(grammar, "[]")
        assert calls(parse_forced(two, choice)) == [("get_weather", {"city": "Paris"}), ("now", {})]
    else:
        assert accepts(grammar, '{"city": "Paris"}') and not accepts(grammar, '{"town": "Paris"}')
        assert parse_forced('{"city": "Paris"}', choice).tool_calls[0].arguments == '{"city": "Paris"}'


def test_parse_forced():
    one = parse_forced('{"city":"Paris"}', named("get_weather"))
    assert one.content is None and [(c.name, c.arguments) for c in one.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    many = parse_forced(
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]', "required"
    )
    assert many.content is None and calls(many) == [("now", {}), ("get_weather", {"city": "Oslo"})]
    assert parse_forced("", "required") == ParsedOutput(content=None, tool_calls=[])


def test_named_forced_stream_sends_the_header_first_then_arguments():
    stream = forced_stream(named("get_weather"))
    first = stream.feed('{"ci')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.feed('ty": "Rome"}') and stream.end() == []
    assert stream.tool_calls[0].arguments == '{"city": "Rome"}'


@FAST
@given(data=st.data())
def test_any_chunking_of_a_forced_output_streams_what_parse_forced_finds(data):
    if data.draw(st.booleans()):
        choice = named("f")
        arguments = data.draw(arguments_objects)
        text, expected = data.draw(json_text(arguments)), [("f", json.dumps(arguments, ensure_ascii=False))]
    else:
        choice = "required"
        items = [(data.draw(names), data.draw(arguments_objects)) for _ in range(data.draw(st.integers(1, 3)))]
        text = data.draw(json_text([{"name": n, "parameters": a} for n, a in items]))
        expected = [(n, json.dumps(a, ensure_ascii=False)) for n, a in items]
    parsed = parse_forced(text, choice)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_agrees(forced_stream(choice), split(text, cuts), parsed)


# ---------------------------------------------------------------- validation


def refused_param(tools, choice, parallel) -> str | None:
    """The param validate_tools names when it refuses the request; None when it accepts it."""
    try:
        validate_tools(tools, choice, parallel)
    except InvalidRequest as refusal:
        return refusal.param
    return None


VALID_TOOL_REQUESTS = [
    *[(TOOLS, choice, None) for choice in (None, "none", "auto", "required", named("now"))],
    (None, None, None),
    ([], "none", True),  # the neutral values of a request that offers no tools
    (
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "strict": True,
                    "description": "d",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ],
        "auto",
        False,
    ),
]


def test_valid_tool_requests_pass():
    assert [refused_param(*request) for request in VALID_TOOL_REQUESTS] == [None] * len(VALID_TOOL_REQUESTS)


@pytest.mark.parametrize(
    "tools, choice, parallel, param",
    [
        ({"type": "function"}, None, None, "tools"),
        ([{"type": "retrieval"}], None, None, "tools[0].type"),
        ([{"type": "function"}], None, None, "tools[0].function"),
        ([NOW, {"type": "function", "function": {"name": "has space"}}], None, None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            None,
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            None,
            None,
            "tools[0].function.description",
        ),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None, "tools[0].function.strict"),
        ([NOW, NOW], None, None, "tools[1].function.name"),
        (TOOLS, "always", None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {}}, None, "tool_choice"),
        (TOOLS, {"type": "function", "name": "now"}, None, "tool_choice"),
        (TOOLS, named("missing"), None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        ([], "required", None, "tool_choice"),
        (None, named("now"), None, "tool_choice"),
        (TOOLS, "auto", "yes", "parallel_tool_calls"),
        (
            [NOW, {"type": "function", "function": {"name": "f", "parameters": {"type": "teapot"}}}],
            "required",
            None,
            "tools[1].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/gone"}}}],
            named("f"),
            None,
            "tools[0].function.parameters",
        ),
    ],
)
def test_invalid_tool_requests_name_the_param(tools, choice, parallel, param):
    with pytest.raises(InvalidRequest) as caught:
        validate_tools(tools, choice, parallel)
    assert caught.value.param == param and caught.value.status == 400


def test_a_schema_only_the_model_reads_is_not_compiled():
    """Under "auto" no grammar is built, so a schema the grammar library cannot compile is the model's business."""
    teapot = [{"type": "function", "function": {"name": "f", "parameters": {"type": "teapot"}}}]
    assert refused_param(teapot, "required", None) == "tools[0].function.parameters"  # compiled: refused
    assert forced_spec(teapot, "auto") is None  # no grammar for "auto"...
    assert refused_param(teapot, "auto", None) is None  # ...so nothing to refuse


# ---------------------------------------------------------------- tools in the prompt

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]


def rendered(path: str, messages: list[dict], tools=None) -> str:
    from generation import tokenization

    return tokenization.tokenizer_for(path).decode(tokenization.chat_prompt_ids(path, messages, tools))


def test_prompt_without_tools_is_unchanged(tiny_model_dir):
    from generation import tokenization

    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    tok = tokenization.tokenizer_for(tiny_model_dir)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, messages[1]], add_generation_prompt=True, tokenize=False
    )
    assert tokenization.chat_prompt_ids(tiny_model_dir, messages) == tok.encode(text, add_special_tokens=False)


def test_a_template_without_tools_gets_them_in_the_hermes_convention(tiny_model_dir):
    text = rendered(tiny_model_dir, [{"role": "system", "content": "Be brief."}, *ROUND_TRIP], TOOLS)
    assert text.count("<|system|>") == 1 and "Be brief.\n\n# Tools" in text
    assert '"name": "get_weather"' in text and "<tools>" in text and '"name": "now"' in text
    call_block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|assistant|>\n{call_block}" in text
    assert "<|user|>\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>" in text
    # What the prompt teaches is what the hermes parser reads back.
    assert calls(parse("hermes", call_block)) == [("get_weather", {"city": "Paris"})]


def test_hermes_tools_prompt_makes_a_system_turn_when_there_is_none(tiny_model_dir):
    text = rendered(tiny_model_dir, [{"role": "user", "content": "Hi"}], [NOW])
    assert text.index("<|system|>") < text.index("<|user|>") and '"name": "now"' in text


def test_a_template_that_knows_tools_gets_them_and_argument_objects(tiny_model_dir, tmp_path):
    folder = tmp_path / "tools-template"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for tool in tools or [] %}[tool {{ tool.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for call in m.tool_calls or [] %}(call {{ call.function.name }} {{ call.function.arguments.city }}"
        " {{ call.id }}){% endfor %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    text = rendered(str(folder), ROUND_TRIP, TOOLS)
    assert text.startswith("[tool get_weather][tool now]")
    assert "(call get_weather Paris call_1)" in text and "<tool>sunny<tool>windy" in text


def test_tool_call_arguments_that_are_not_json_are_a_400_on_that_field(tiny_model_dir):
    from generation import tokenization

    bad = {**WEATHER_CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    with pytest.raises(InvalidRequest) as caught:
        tokenization.chat_prompt_ids(tiny_model_dir, [ROUND_TRIP[0], {"role": "assistant", "tool_calls": [bad]}])
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
