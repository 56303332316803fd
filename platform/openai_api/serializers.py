"""Request and response shapes of the OpenAI-compatible endpoints.

The request serializers validate every body (so the OpenAPI schema generated from them is the
validation that really runs); the response serializers document what the views return.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.utils.serializer_helpers import BindingDict

ROLES = ["system", "developer", "user", "assistant", "tool"]
SEED_RANGE = (-(2**63), 2**64 - 1)  # what the engine's torch.Generator takes: 64 bits
TOP_K_MAX = 1_000_000  # documented bound; the request's model also bounds it by its vocabulary

# Known OpenAI request fields we cannot honour: a 400 naming them (a silently ignored one would
# change the answer the client expects).
UNSUPPORTED_PARAMS = {
    "functions": "the legacy functions parameter is not supported; use tools",
    "function_call": "the legacy function_call parameter is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this model does not reason",
    "verbosity": "verbosity is not supported",
}
# a value that asks for nothing: modalities ["text"]
UNSUPPORTED_NEUTRAL = {"modalities": [["text"]]}
# Anything else a serializer does not declare (metadata, store, service_tier, prompt_cache_key...) is logged.


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
class StringOrListField(serializers.Field):
    """stop: a string or a list of strings."""

    def to_internal_value(self, data):
        if isinstance(data, str):
            return [data] if data else []
        if isinstance(data, list) and all(isinstance(s, str) for s in data):
            return [s for s in data if s]
        raise serializers.ValidationError("must be a string or a list of strings")

    def to_representation(self, value):
        return value


MAX_PROMPTS = 256  # prompts in one batched /v1/completions request
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string"},
            TOKEN_IDS,
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
            {"type": "array", "items": TOKEN_IDS, "minItems": 1},
        ]
    }
)
class PromptField(serializers.Field):
    """prompt: a string, a list of token ids, or a batch: a list of strings or of token-id lists.

    Always validated as a list of prompts (each a string or a list of token ids)."""

    max_items, noun = MAX_PROMPTS, "prompts"

    def to_internal_value(self, data):
        if _is_prompt(data):
            return [data]
        if isinstance(data, list) and data and all(_is_prompt(p) for p in data) and len({type(p) for p in data}) == 1:
            if len(data) > self.max_items:
                raise serializers.ValidationError(f"at most {self.max_items} {self.noun} per request")
            return data
        raise serializers.ValidationError(
            "must be a non-empty string, a list of token ids, or a list of "
            "non-empty strings or of token-id lists (not both)"
        )

    def to_representation(self, value):
        return value


def _is_prompt(data) -> bool:
    if isinstance(data, str):
        return bool(data)
    return (
        isinstance(data, list)
        and bool(data)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in data)
    )


TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
}


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}], "nullable": True})
class ContentField(serializers.JSONField):
    """messages[].content: a string or a list of text parts (joined with newlines, as vLLM does)."""

    def to_internal_value(self, data):
        if data is None or isinstance(data, str):
            return data or ""
        if isinstance(data, list):
            parts = []
            for part in data:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise serializers.ValidationError("only text content parts are supported")
                parts.append(part["text"])
            return "\n".join(parts)
        raise serializers.ValidationError("must be a string or a list of text parts")


class FunctionCallSerializer(serializers.Serializer):
    name = serializers.CharField()
    arguments = serializers.CharField(trim_whitespace=False, help_text="a JSON object, as a string")


class ToolCallSerializer(serializers.Serializer):
    id = serializers.CharField()
    type = serializers.ChoiceField(choices=["function"], default="function")
    function = FunctionCallSerializer()


class MessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=ROLES, help_text="developer is rendered as system")
    content = ContentField(required=False, allow_null=True)
    name = serializers.CharField(required=False)
    tool_call_id = serializers.CharField(required=False, help_text="required for role tool")
    tool_calls = ToolCallSerializer(
        many=True,
        required=False,
        allow_null=True,
        help_text="an assistant turn's calls, sent back with the tools' results",
    )

    def validate(self, data):
        if data.get("tool_calls") and data["role"] != "assistant":
            raise serializers.ValidationError({"tool_calls": "only assistant messages carry tool_calls"})
        if data["role"] == "tool" and not data.get("tool_call_id"):
            raise serializers.ValidationError({"tool_call_id": "is required for a tool message"})
        return data


class StreamOptionsSerializer(serializers.Serializer):
    include_usage = serializers.BooleanField(required=False, default=False)


class JSONSchemaFormatSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64)
    description = serializers.CharField(required=False, allow_blank=True)
    schema = serializers.JSONField(required=False, allow_null=True, help_text="a JSON schema object")
    strict = serializers.BooleanField(required=False, allow_null=True)

    def validate_schema(self, value):
        if value is not None and not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON schema object")
        return value


class ResponseFormatSerializer(serializers.Serializer):
    type = serializers.ChoiceField(choices=["text", "json_object", "json_schema"])
    json_schema = JSONSchemaFormatSerializer(required=False)

    def validate(self, data):
        if data["type"] == "json_schema" and "json_schema" not in data:
            raise serializers.ValidationError({"json_schema": "is required when type is json_schema"})
        return data


class RequestSerializer(serializers.Serializer):
    """A request body's validator, with one set of bound fields per class for every request.

    DRF deep-copies a serializer's declared fields for each instance, most of a body's validation
    (docs/architecture.md). Validating stores nothing on the fields: the results and
    errors stay on the instance, and validate_<field> is looked up on the instance too.
    """

    @property
    def fields(self):
        shared = type(self).__dict__.get("_bound_fields")
        if shared is None:
            shared = BindingDict(self)
            for name, field in self.get_fields().items():
                shared[name] = field
            type(self)._bound_fields = shared
        return shared


class SamplingSerializer(RequestSerializer):
    """Fields shared by both endpoints (OpenAI's plus vLLM's extras)."""

    model = serializers.CharField()
    max_tokens = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        help_text="default: the rest of the context on chat, 16 on completions",
    )
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=2)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1, max_value=16)
    stream = serializers.BooleanField(required=False, default=False)
    stream_options = StreamOptionsSerializer(required=False, allow_null=True)
    stop = StringOrListField(required=False, allow_null=True)
    seed = serializers.IntegerField(required=False, allow_null=True, min_value=SEED_RANGE[0], max_value=SEED_RANGE[1])
    presence_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2, max_value=2)
    frequency_penalty = serializers.FloatField(required=False, allow_null=True, min_value=-2, max_value=2)
    user = serializers.CharField(
        required=False,
        allow_blank=True,
        allow_null=True,
        max_length=256,
        help_text="recorded on the request's usage row",
    )
    logit_bias = serializers.DictField(
        child=serializers.FloatField(min_value=-100, max_value=100),
        required=False,
        allow_null=True,
        help_text="token id -> bias added to its logit, in [-100, 100]",
    )
    # vLLM's extra sampling parameters
    top_k = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=-1,
        max_value=TOP_K_MAX,
        help_text="-1 or 0: off; at most the vocabulary size",
    )
    min_p = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    repetition_penalty = serializers.FloatField(required=False, allow_null=True, min_value=0.01)
    min_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    ignore_eos = serializers.BooleanField(required=False, default=False)
    stop_token_ids = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False, allow_null=True)
    allowed_token_ids = serializers.ListField(
        child=serializers.IntegerField(min_value=0),
        required=False,
        allow_null=True,
        allow_empty=False,
        help_text="only these tokens may be generated",
    )
    bad_words = serializers.ListField(
        child=serializers.CharField(), required=False, allow_null=True, help_text="words that are never completed"
    )
    skip_special_tokens = serializers.BooleanField(required=False, default=True)
    include_stop_str_in_output = serializers.BooleanField(required=False, default=False)
    speculative = serializers.BooleanField(
        required=False,
        allow_null=True,
        help_text="false: decode this request without the engine's speculative decoding",
    )
    priority = serializers.IntegerField(
        required=False,
        default=0,
        min_value=0,
        max_value=999,
        help_text="order inside the API priority class (lower runs first)",
    )
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs / guided_* (at most one)
    response_format = ResponseFormatSerializer(required=False, allow_null=True)
    structured_outputs = serializers.DictField(
        required=False, allow_null=True, help_text="vLLM's: one of json, json_object, regex, choice, grammar"
    )
    guided_json = serializers.JSONField(required=False, allow_null=True, help_text="a JSON schema the output follows")
    # trim_whitespace=False: DRF strips strings by default, and a leading space is part of a pattern
    guided_regex = serializers.CharField(required=False, allow_null=True, trim_whitespace=False)
    guided_choice = serializers.ListField(
        child=serializers.CharField(trim_whitespace=False), required=False, allow_null=True, allow_empty=False
    )
    guided_grammar = serializers.CharField(
        required=False, allow_null=True, trim_whitespace=False, help_text="EBNF (xgrammar's dialect)"
    )

    def validate_stream_options(self, value):
        if value is not None and self.initial_data.get("stream") is not True:
            raise serializers.ValidationError("is only allowed when stream is true")
        return value

    def validate_logit_bias(self, value):
        if value and not all(key.isascii() and key.isdigit() and len(key) <= 12 for key in value):
            raise serializers.ValidationError("keys must be token ids")
        return value and {int(key): bias for key, bias in value.items()}


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                },
            },
        ]
    }
)
class ToolChoiceField(serializers.Field):
    """tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    (checked against the tools by tool_calls.validate_tools)."""

    def to_internal_value(self, data):
        return data

    def to_representation(self, value):
        return value


class ChatCompletionRequestSerializer(SamplingSerializer):
    messages = MessageSerializer(many=True, allow_empty=False)
    max_completion_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    logprobs = serializers.BooleanField(required=False, default=False)
    top_logprobs = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=20)
    tools = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        allow_null=True,
        max_length=128,
        help_text='[{"type": "function", "function": {"name", "description", "parameters"}}]',
    )
    tool_choice = ToolChoiceField(
        required=False, allow_null=True, help_text="none, auto (the default with tools), required, or a named function"
    )
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True, default=True)


class CompletionRequestSerializer(SamplingSerializer):
    prompt = PromptField(
        help_text="a string or a list of token ids; a list of either is a batch (one choice per "
        "prompt per n, indexed prompt * n + i)"
    )
    # 0 is allowed with echo: the prompt's own logprobs, nothing generated (lm-eval's loglikelihood)
    max_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    logprobs = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=5,
        help_text="with echo, also the prompt tokens' logprobs",
    )
    echo = serializers.BooleanField(required=False, default=False, help_text="prepend the prompt to each choice")
    best_of = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    suffix = serializers.CharField(required=False, allow_null=True)

    def validate(self, data):
        if data.get("max_tokens") == 0 and not data.get("echo"):
            raise serializers.ValidationError({"max_tokens": "0 is only allowed with echo"})
        return data

    def validate_suffix(self, value):
        if value:
            raise serializers.ValidationError("suffix is not supported")
        return value


class TokenizeRequestSerializer(RequestSerializer):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered with the model's template."""

    model = serializers.CharField(required=False, allow_null=True, help_text="default: the configured model")
    prompt = serializers.CharField(required=False, trim_whitespace=False, allow_blank=True)
    messages = MessageSerializer(many=True, required=False, allow_empty=False)
    add_special_tokens = serializers.BooleanField(required=False, default=True)
    return_token_strs = serializers.BooleanField(required=False, default=False)

    def validate(self, data):
        if ("prompt" in data) == ("messages" in data):
            raise serializers.ValidationError({"prompt": "give exactly one of prompt or messages"})
        return data


class DetokenizeRequestSerializer(RequestSerializer):
    model = serializers.CharField(required=False, allow_null=True, help_text="default: the configured model")
    tokens = serializers.ListField(child=serializers.IntegerField(min_value=0))


# ---------------------------------------------------------------- responses (documentation)


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


class PromptTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField()


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    prompt_tokens_details = PromptTokensDetailsSerializer()


class ChatMessageSerializer(serializers.Serializer):
    role = serializers.CharField()
    content = serializers.CharField(allow_null=True, help_text="null when the answer is only tool calls")
    tool_calls = ToolCallSerializer(many=True, required=False, help_text="present when the model called tools")


class TopLogprobSerializer(serializers.Serializer):
    token = serializers.CharField()
    logprob = serializers.FloatField()
    bytes = serializers.ListField(child=serializers.IntegerField())


class TokenLogprobSerializer(TopLogprobSerializer):
    top_logprobs = TopLogprobSerializer(many=True)


class ChatLogprobsSerializer(serializers.Serializer):
    content = TokenLogprobSerializer(many=True)


class ChatChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    message = ChatMessageSerializer()
    logprobs = ChatLogprobsSerializer(allow_null=True)
    finish_reason = serializers.CharField(allow_null=True)


class ChatCompletionSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="chat.completion")
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = ChatChoiceSerializer(many=True)
    usage = UsageSerializer()
    system_fingerprint = serializers.CharField(allow_null=True)


class CompletionLogprobsSerializer(serializers.Serializer):
    tokens = serializers.ListField(child=serializers.CharField())
    token_logprobs = serializers.ListField(child=serializers.FloatField(allow_null=True))
    top_logprobs = serializers.ListField(child=serializers.DictField(child=serializers.FloatField()))
    text_offset = serializers.ListField(child=serializers.IntegerField())


class CompletionChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField()
    logprobs = CompletionLogprobsSerializer(allow_null=True)
    finish_reason = serializers.CharField(allow_null=True)


class CompletionSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="text_completion")
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = CompletionChoiceSerializer(many=True)
    usage = UsageSerializer()
    system_fingerprint = serializers.CharField(allow_null=True)


class ModelSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="model")
    created = serializers.IntegerField()
    owned_by = serializers.CharField()
    max_model_len = serializers.IntegerField(allow_null=True)


class ModelListSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="list")
    data = ModelSerializer(many=True)


class HealthSerializer(serializers.Serializer):
    status = serializers.CharField(help_text="ok or unavailable")
    engine = serializers.BooleanField()
    redis = serializers.BooleanField()
    workers = serializers.ListField(child=serializers.CharField())


class TokenizeSerializer(serializers.Serializer):
    count = serializers.IntegerField()
    max_model_len = serializers.IntegerField(allow_null=True)
    tokens = serializers.ListField(child=serializers.IntegerField())
    token_strs = serializers.ListField(child=serializers.CharField(), allow_null=True)


class DetokenizeSerializer(serializers.Serializer):
    prompt = serializers.CharField()


class TokenizerInfoSerializer(serializers.Serializer):
    tokenizer_class = serializers.CharField()
    bos_token = serializers.CharField(allow_null=True)
    eos_token = serializers.CharField(allow_null=True)
    pad_token = serializers.CharField(allow_null=True)
    unk_token = serializers.CharField(allow_null=True)
    model_max_length = serializers.IntegerField(allow_null=True)
    chat_template = serializers.CharField(allow_null=True)
