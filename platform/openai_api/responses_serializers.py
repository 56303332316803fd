"""Request and response shapes of the Responses API (/v1/responses).

The request serializer validates every body (types strict, through calls.validate) and is what the
OpenAPI schema shows; the items of `input` and `tools` are checked item by item in
openai_api.responses, which names the exact field of a bad one (`input[2].type`).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .serializers import JSONSchemaFormatSerializer, RequestSerializer

# Responses fields we cannot honour: a 400 naming them, unless the value asks for nothing.
UNSUPPORTED_FIELDS = {
    "reasoning": "reasoning is not supported: the served models do not reason",
    "include": "include is not supported (no reasoning, file search, web search or logprobs outputs)",
    "background": "background responses are not supported; use stream or a plain request",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "reusable prompt templates are not supported; send the input itself",
    "max_tool_calls": "max_tool_calls is not supported (only function tools, whose calls the client runs)",
    "top_logprobs": "logprobs are not supported on the Responses API; use /v1/chat/completions",
}
NEUTRAL_VALUES = {"reasoning": [{}], "include": [[]], "background": [False], "top_logprobs": [0]}

ITEM = {
    "type": "object",
    "additionalProperties": True,
    "description": "a message ({role, content}), function_call or function_call_output item",
}


@extend_schema_field({"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": ITEM, "minItems": 1}]})
class InputField(serializers.JSONField):
    """input: a string (one user message) or a list of items (checked in openai_api.responses)."""

    def to_internal_value(self, data):
        if isinstance(data, str):
            if not data:
                raise serializers.ValidationError("must not be empty")
            return data
        if isinstance(data, list):
            if not data:
                raise serializers.ValidationError("must not be empty")
            return data
        raise serializers.ValidationError("must be a string or a list of input items")


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {"type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}},
            },
        ]
    }
)
class ResponsesToolChoiceField(serializers.Field):
    """tool_choice: "none" | "auto" | "required" | {"type": "function", "name": ...} (checked in responses.py)."""

    def to_internal_value(self, data):
        return data

    def to_representation(self, value):
        return value


class TextFormatSerializer(JSONSchemaFormatSerializer):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", ...}."""

    type = serializers.ChoiceField(choices=["text", "json_object", "json_schema"])
    name = serializers.CharField(max_length=64, required=False)

    def validate(self, data):
        if data["type"] == "json_schema" and not data.get("name"):
            raise serializers.ValidationError({"name": "is required when type is json_schema"})
        if data["type"] == "json_schema" and not isinstance(data.get("schema"), dict):
            raise serializers.ValidationError({"schema": "is required when type is json_schema"})
        return data


class TextConfigSerializer(serializers.Serializer):
    format = TextFormatSerializer(required=False, allow_null=True)
    verbosity = serializers.ChoiceField(
        choices=["medium"], required=False, allow_null=True, help_text="only medium (the model's own)"
    )


class ResponseCreateRequestSerializer(RequestSerializer):
    model = serializers.CharField()
    input = InputField(help_text="a string, or a list of message, function_call and function_call_output items")
    instructions = serializers.CharField(
        required=False,
        allow_null=True,
        allow_blank=True,
        trim_whitespace=False,
        help_text="a system message before the input (not carried over by previous_response_id)",
    )
    max_output_tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1)
    temperature = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=2)
    top_p = serializers.FloatField(required=False, allow_null=True, min_value=0, max_value=1)
    tools = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        allow_null=True,
        max_length=128,
        help_text='function tools: [{"type": "function", "name", "description", "parameters"}]',
    )
    tool_choice = ResponsesToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True, default=True)
    text = TextConfigSerializer(required=False, allow_null=True)
    stream = serializers.BooleanField(required=False, default=False)
    store = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=True,
        help_text="keep the response for retrieval and previous_response_id",
    )
    previous_response_id = serializers.CharField(required=False, allow_null=True, max_length=64)
    metadata = serializers.DictField(
        child=serializers.CharField(max_length=512, allow_blank=True),
        required=False,
        allow_null=True,
        help_text="returned as given",
    )
    user = serializers.CharField(required=False, allow_blank=True, allow_null=True, max_length=256)
    truncation = serializers.ChoiceField(
        choices=["disabled"],
        required=False,
        allow_null=True,
        help_text="only disabled: a conversation longer than the context is a 400",
    )
    # the same engine extras as chat completions
    seed = serializers.IntegerField(required=False, allow_null=True, min_value=-(2**63), max_value=2**64 - 1)


# ---------------------------------------------------------------- responses (documentation)


class ResponseUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    input_tokens_details = serializers.DictField(help_text='{"cached_tokens"}')
    output_tokens = serializers.IntegerField()
    output_tokens_details = serializers.DictField(help_text='{"reasoning_tokens": 0}')
    total_tokens = serializers.IntegerField()


class ResponseObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="response")
    created_at = serializers.IntegerField()
    status = serializers.CharField(help_text="completed, incomplete or failed (in_progress while streaming)")
    background = serializers.BooleanField()
    error = serializers.DictField(allow_null=True, help_text='{"code", "message"} of a failed response')
    incomplete_details = serializers.DictField(allow_null=True, help_text='{"reason": "max_output_tokens"}')
    instructions = serializers.CharField(allow_null=True)
    max_output_tokens = serializers.IntegerField(allow_null=True)
    model = serializers.CharField()
    output = serializers.ListField(child=serializers.DictField(), help_text="message and function_call items")
    parallel_tool_calls = serializers.BooleanField()
    previous_response_id = serializers.CharField(allow_null=True)
    reasoning = serializers.DictField(allow_null=True, help_text="always null")
    store = serializers.BooleanField()
    temperature = serializers.FloatField(allow_null=True)
    text = serializers.DictField(help_text='{"format": {...}} as asked')
    tool_choice = serializers.JSONField()
    tools = serializers.ListField(child=serializers.DictField())
    top_p = serializers.FloatField(allow_null=True)
    truncation = serializers.CharField(help_text="disabled")
    usage = ResponseUsageSerializer(allow_null=True)
    user = serializers.CharField(allow_null=True)
    metadata = serializers.DictField()


class ResponseDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(help_text="response")
    deleted = serializers.BooleanField()


class InputItemListSerializer(serializers.Serializer):
    object = serializers.CharField(help_text="list")
    data = serializers.ListField(child=serializers.DictField())
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)
    has_more = serializers.BooleanField()
