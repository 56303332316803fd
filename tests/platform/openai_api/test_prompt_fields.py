"""/v1/completions' prompt and /v1/embeddings' input: one validator, each with its own limit."""

import pytest
from rest_framework import serializers

from openai_api.embeddings_serializers import MAX_INPUTS, EmbeddingInputField
from openai_api.serializers import MAX_PROMPTS, PromptField


@pytest.mark.parametrize(
    ("field", "limit", "noun"), [(PromptField(), MAX_PROMPTS, "prompts"), (EmbeddingInputField(), MAX_INPUTS, "inputs")]
)
def test_each_field_takes_up_to_its_own_limit_and_names_it_past_it(field, limit, noun):
    assert field.to_internal_value(["tile"] * limit) == ["tile"] * limit
    assert field.to_internal_value([[1, 2]] * limit) == [[1, 2]] * limit
    with pytest.raises(serializers.ValidationError, match=f"at most {limit} {noun} per request"):
        field.to_internal_value(["tile"] * (limit + 1))


@pytest.mark.parametrize("field", [PromptField(), EmbeddingInputField()])
def test_one_input_becomes_a_list_and_mixed_or_empty_ones_are_refused(field):
    assert field.to_internal_value("tile") == ["tile"]
    assert field.to_internal_value([5, 6]) == [[5, 6]]
    for bad in ("", [], ["tile", [5]], [-1], [True], [""], 3):
        with pytest.raises(serializers.ValidationError, match="must be a non-empty string"):
            field.to_internal_value(bad)
