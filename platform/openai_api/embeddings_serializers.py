"""Request and response shapes of /v1/embeddings (OpenAI's createEmbedding)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from .serializers import TOKEN_IDS, PromptField, RequestSerializer

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
ENCODING_FORMATS = ["float", "base64"]


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "minLength": 1},
            TOKEN_IDS,
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
            {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": MAX_INPUTS},
        ]
    }
)
class EmbeddingInputField(PromptField):
    """input: a string, a list of token ids, or several: a list of strings or of token-id lists.

    Always validated as a list of inputs (each a non-empty string or a non-empty list of token ids),
    as /v1/completions' prompt is."""

    max_items, noun = MAX_INPUTS, "inputs"


class EmbeddingRequestSerializer(RequestSerializer):
    model = serializers.CharField()
    input = EmbeddingInputField()
    encoding_format = serializers.ChoiceField(
        choices=ENCODING_FORMATS, default="float", help_text="base64: each embedding's float32 little-endian bytes"
    )
    dimensions = serializers.IntegerField(
        min_value=1, required=False, help_text="only for models trained for truncated embeddings"
    )
    user = serializers.CharField(required=False, allow_blank=True)


@extend_schema_field({"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]})
class EmbeddingVectorField(serializers.JSONField):
    pass


class EmbeddingSerializer(serializers.Serializer):
    object = serializers.CharField(default="embedding")
    index = serializers.IntegerField()
    embedding = EmbeddingVectorField()


class EmbeddingUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class EmbeddingListSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = EmbeddingSerializer(many=True)
    model = serializers.CharField()
    usage = EmbeddingUsageSerializer()
