"""logit_bias, allowed_token_ids and bad_words: the engine against HF transformers' logits edited by hand.

The reference runs HF's model on the engine's own tokens, edits the next-token logits the way each
parameter is documented (add the bias; keep only the allowed ids; ban a bad word's last token once
its other tokens were just produced) and takes the argmax: greedy outputs must be equal token for token.
"""

import pytest
import torch

from inference import SamplingParams
from inference.request import Request
from inference.sampler import Sampler, banned_bad_word_tokens
from inference.sampling_params import bad_words_token_ids

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 10


def generate(tiny_llm, **params) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return tiny_llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids


def reference(tiny_hf_model, edit) -> list[int]:
    """Greedy HF decoding where edit(logits, output so far) changes each step's logits."""
    output = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = tiny_hf_model(torch.tensor([PROMPT + output])).logits[0, -1].float()
        output.append(int(edit(logits, output).argmax()))
    return output


def test_logit_bias_is_added_to_the_logits(tiny_llm, tiny_hf_model):
    plain = generate(tiny_llm)
    # the first greedy token down, the second one up: the path must change exactly as the reference says
    bias = {plain[0]: -5.0, plain[1]: 3.0}

    def add_bias(logits, _):
        for token, amount in bias.items():
            logits[token] += amount
        return logits

    biased = generate(tiny_llm, logit_bias={str(t): b for t, b in bias.items()})  # JSON's string keys
    assert biased == reference(tiny_hf_model, add_bias)
    assert biased != plain and biased[0] != plain[0]


def test_a_bias_of_100_forces_the_token(tiny_llm):
    assert generate(tiny_llm, logit_bias={42: 100}) == [42] * MAX_TOKENS


def test_allowed_token_ids_masks_every_other_token(tiny_llm, tiny_hf_model):
    plain = generate(tiny_llm)
    allowed = sorted({20, 21, 22, 23, plain[3]} - {plain[0]})

    def keep_allowed(logits, _):
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    restricted = generate(tiny_llm, allowed_token_ids=allowed)
    assert restricted == reference(tiny_hf_model, keep_allowed)
    assert set(restricted) <= set(allowed) and restricted != plain


def test_bad_words_are_never_completed(tiny_llm, tiny_hf_model):
    tokenizer = tiny_llm.llm_engine.tokenizer
    plain = generate(tiny_llm)
    word = tokenizer.decode(plain[2:4]).strip()  # a piece of text the model would write
    sequences = bad_words_token_ids(tokenizer, [word])
    assert sequences, word

    def ban(logits, output):
        logits[banned_bad_word_tokens(sequences, output)] = float("-inf")
        return logits

    censored = generate(tiny_llm, bad_words=[word])
    assert censored == reference(tiny_hf_model, ban)
    assert censored != plain
    for ids in sequences:
        assert not any(censored[i : i + len(ids)] == ids for i in range(len(censored))), (word, ids, censored)


def test_a_bad_word_bans_its_last_token_only_after_its_other_tokens():
    sampler = Sampler(8, [0])
    logits = torch.zeros(2, 8)
    logits[:, 5] = 10.0  # 5 wins unless banned
    seqs = []
    for output in ([3], [4]):
        seq = Request(f"r{output[0]}", None, [1, 2], SamplingParams(temperature=0, bad_words=["x"]))
        seq.params.bad_words_token_ids = [[3, 5]]
        seq.append_token(output[0])
        seqs.append(seq)
    tokens, _ = sampler(logits, seqs)
    assert tokens[0] != 5 and tokens[1] == 5


@pytest.mark.parametrize(
    "params, field",
    [
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_invalid_values_name_their_field(params, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**params)


@pytest.mark.parametrize(
    "params, field", [({"logit_bias": {10**6: 1}}, "logit_bias"), ({"allowed_token_ids": [10**6]}, "allowed_token_ids")]
)
def test_token_ids_outside_the_vocabulary_are_refused_by_the_engine(tiny_llm, params, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} has token ids outside the vocabulary"):
        tiny_llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, **params))
