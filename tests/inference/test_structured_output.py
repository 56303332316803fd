"""Grammar compilation and token masks with the real model's tokenizer (SmolLM2's 49k vocabulary).

Random logits stand in for a model that tries to go anywhere: whatever it prefers, the masked
argmax walk must end in text the grammar accepts, and end only where the grammar may end.
"""

import json
import re

import pytest
import torch

from inference.gguf_files import bundled_model
from inference.loader import load_tokenizer
from inference.structured_output import GrammarCompiler, StructuredOutputs, TokenMasker, check_syntax

# Bounded, so a random walk ends. (Not maxLength: xgrammar 0.2.9 lets raw control characters into
# length-bounded strings; the serving layer has no reason to care, but this test would.)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,10}$"},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(bundled_model()))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    yield compiler
    compiler.shutdown()


def walk(compiler, tokenizer, spec, seed: int, batch: int = 1, max_steps: int = 200, boost=()) -> list[str]:
    """Masked argmax over random logits, `batch` rows at once, until every row's grammar ends.

    boost: token ids made likelier (closing quotes and brackets), so free-form JSON ends in time.
    """
    grammar = compiler.compile(spec)
    matchers = [compiler.matcher(grammar) for _ in range(batch)]
    masker = TokenMasker(compiler.vocab_size)
    outputs = [[] for _ in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        live = [m if not m.is_terminated() else None for m in matchers]
        if not any(live):
            break
        logits = torch.randn(batch, compiler.vocab_size, generator=gen)
        logits[:, list(boost)] += 3.0
        masker.apply(logits, live)
        for row, token in enumerate(logits.argmax(-1).tolist()):
            if live[row] is not None:
                assert matchers[row].accept_token(token), "the mask allowed a token the grammar rejects"
                if token != tokenizer.eos_token_id:
                    outputs[row].append(token)
    assert all(m.is_terminated() for m in matchers), "the walk did not finish the grammar"
    return [tokenizer.decode(ids) for ids in outputs]


@pytest.mark.parametrize("seed", range(8))
def test_every_json_schema_walk_is_valid_json_of_the_schema(compiler, tokenizer, seed):
    for text in walk(compiler, tokenizer, StructuredOutputs(json=SCHEMA), seed, batch=4):
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok"}
        assert re.fullmatch("[a-z ]{1,10}", value["name"])
        assert isinstance(value["age"], int) and isinstance(value["ok"], bool)


def test_json_object_walks_give_objects(compiler, tokenizer):
    closing = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip() in ('"', "}", "]", '"}', '"]')]
    for text in walk(compiler, tokenizer, StructuredOutputs(json_object=True), seed=1, batch=4, boost=closing):
        assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar(compiler, tokenizer):
    (date,) = walk(compiler, tokenizer, StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}"), seed=0)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
    choices = ["red", "green", "a (b)?"]
    assert set(walk(compiler, tokenizer, StructuredOutputs(choice=choices), seed=2, batch=6)) <= set(choices)
    ebnf = 'root ::= "yes" | "no" | "maybe"'
    assert set(walk(compiler, tokenizer, StructuredOutputs(grammar=ebnf), seed=3, batch=4)) <= {"yes", "no", "maybe"}


def test_rows_without_a_matcher_are_untouched(compiler):
    masker = TokenMasker(compiler.vocab_size)
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    matcher = compiler.matcher(compiler.compile(StructuredOutputs(choice=["yes"])))
    masker.apply(logits, [None, matcher, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).sum() > compiler.vocab_size - 10  # almost every token is banned


def test_a_spec_compiles_once(compiler):
    spec = StructuredOutputs(json=dict(SCHEMA))
    assert compiler.submit(spec) is compiler.submit(StructuredOutputs(json=json.dumps(SCHEMA, sort_keys=True)))


@pytest.mark.parametrize(
    "spec, problem",
    [
        (StructuredOutputs(regex="(unclosed"), "regex"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar"),
        (StructuredOutputs(json='{"type": "object", "properties": 5}'), "json"),
    ],
)
def test_what_cannot_compile_is_a_value_error_naming_the_kind(compiler, spec, problem):
    with pytest.raises(ValueError, match=f"structured_outputs.{problem} could not be compiled: [^[]"):
        compiler.compile(spec)
    with pytest.raises(ValueError, match=f"structured_outputs.{problem} could not be compiled: [^[]"):
        check_syntax(spec)  # the web tier's check, without a vocabulary


@pytest.mark.parametrize(
    "kwargs", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"regex": ""}, {"json": 5}, {"choice": ["a", 3]}]
)
def test_a_spec_names_exactly_one_valid_kind(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputs(**kwargs)
