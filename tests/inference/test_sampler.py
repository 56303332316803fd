"""The batched sampler with hand-made logits and fake requests (no model)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from inference.request import Request
from inference.sampler import Sampler
from inference.sampling_params import SamplingParams

VOCAB = 8
EOS = 0
_ids = itertools.count()


def make_seq(prompt=(5, 6), output=(), **params) -> Request:
    seq = Request(f"s{next(_ids)}", None, list(prompt), SamplingParams(**params))
    for token in output:
        seq.append_token(token)
    return seq


def logits_from_probs(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def sample_support(row_logits: torch.Tensor, rows: int = 400, **params) -> set[int]:
    """Sample one token for each of `rows` seeded copies of the same request; the tokens seen."""
    sampler = Sampler(row_logits.shape[-1], [EOS])
    seqs = [make_seq(seed=i, **params) for i in range(rows)]
    tokens, _ = sampler(row_logits.expand(rows, -1).clone(), seqs)
    return set(tokens)


def sample_counts(row_logits: torch.Tensor, rows: int = 4000, **params) -> list[float]:
    sampler = Sampler(row_logits.shape[-1], [EOS])
    seqs = [make_seq(seed=i, **params) for i in range(rows)]
    tokens, _ = sampler(row_logits.expand(rows, -1).clone(), seqs)
    return [tokens.count(t) / rows for t in range(row_logits.shape[-1])]


# ---- greedy and temperature --------------------------------------------------------------------------


def test_greedy_is_argmax_for_every_row():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    seqs = [make_seq(temperature=0.0) for _ in range(16)]
    tokens, logprobs = Sampler(50, [EOS])(logits, seqs)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 16


def test_greedy_reads_bfloat16_logits_as_they_are_and_mixed_batches_still_widen():
    torch.manual_seed(1)
    logits = torch.randn(32, 300).bfloat16()
    logits[3, [7, 200]] = 50.0  # a tie: the first index wins, as argmax
    greedy = [make_seq(temperature=0.0) for _ in range(32)]
    tokens, _ = Sampler(300, [EOS])(logits, greedy)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[3] == 7
    # With a sampled row or logprobs in the batch the logits are widened, and greedy rows keep their picks.
    mixed = (
        [make_seq(temperature=0.0, logprobs=2)]
        + [make_seq(temperature=0.0) for _ in range(30)]
        + [make_seq(temperature=1.0, seed=5)]
    )
    mixed_tokens, entries = Sampler(300, [EOS])(logits, mixed)
    assert mixed_tokens[:31] == tokens[:31]
    assert entries[0][tokens[0]].logprob == pytest.approx(float(torch.log_softmax(logits[0].float(), -1)[tokens[0]]))


def test_greedy_ignores_the_generator_and_top_filters():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    seq = make_seq(temperature=0.0, top_k=1, top_p=0.1, seed=3)
    assert Sampler(4, [EOS])(logits, [seq])[0] == [1]


def test_random_sampling_follows_the_temperature_scaled_distribution():
    probs = [0.05, 0.5, 0.3, 0.15]
    logits = logits_from_probs(probs)
    freqs = sample_counts(logits, temperature=1.0)
    for seen, expected in zip(freqs, probs):
        assert abs(seen - expected) < 0.03
    hot = sample_counts(logits, temperature=2.0)
    flattened = [p**0.5 / sum(q**0.5 for q in probs) for p in probs]
    for seen, expected in zip(hot, flattened):
        assert abs(seen - expected) < 0.03


def test_a_very_low_temperature_behaves_like_greedy():
    logits = torch.tensor([0.0, 1.0, 1.2, 0.5])
    assert sample_support(logits, temperature=1e-3) == {2}


# ---- top-k / top-p / min-p restrict the support --------------------------------------------------------


def test_top_k_keeps_only_the_k_most_likely_tokens():
    torch.manual_seed(1)
    logits = torch.randn(30) * 0.3  # flat enough that every kept token shows up
    allowed = set(logits.topk(3).indices.tolist())
    assert sample_support(logits, top_k=3) == allowed
    assert len(sample_support(logits)) > 10  # without top_k the support is wide


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = logits_from_probs([0.05, 0.5, 0.3, 0.15])
    assert sample_support(logits, top_p=0.75) == {1, 2}  # 0.5 + 0.3 >= 0.75
    assert sample_support(logits, top_p=0.85) == {1, 2, 3}
    assert sample_support(logits, top_p=0.4) == {1}  # the most likely token always stays


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = logits_from_probs([0.05, 0.5, 0.3, 0.15])
    assert sample_support(logits, min_p=0.2) == {1, 2, 3}  # threshold 0.1
    assert sample_support(logits, min_p=0.5) == {1, 2}  # threshold 0.25


def test_filters_combine():
    logits = logits_from_probs([0.05, 0.4, 0.25, 0.2, 0.1])
    assert sample_support(logits, top_k=3, top_p=0.6) == {1, 2}
    assert sample_support(logits, top_k=3, min_p=0.6) == {1, 2}  # threshold 0.24


def test_each_row_uses_its_own_filters_in_one_batch():
    logits = logits_from_probs([0.05, 0.4, 0.25, 0.2, 0.1]).expand(600, -1).clone()
    seqs = []
    for i in range(200):
        seqs += [make_seq(seed=i, top_k=1), make_seq(seed=i, top_p=0.6), make_seq(seed=i)]
    tokens, _ = Sampler(5, [EOS])(logits, seqs)
    assert set(tokens[0::3]) == {1}
    assert set(tokens[1::3]) == {1, 2}
    assert set(tokens[2::3]) == {0, 1, 2, 3, 4}


# ---- per-request seeds ------------------------------------------------------------------------------------


def test_a_seeded_row_is_reproducible_whatever_else_is_in_the_batch():
    torch.manual_seed(2)
    steps = [torch.randn(VOCAB) for _ in range(6)]
    sampler = Sampler(VOCAB, [EOS])

    alone = make_seq(seed=1234)
    alone_tokens = [sampler(step[None].clone(), [alone])[0][0] for step in steps]

    batched = make_seq(seed=1234)
    batched_tokens = []
    for i, step in enumerate(steps):
        others = [make_seq(temperature=0.0), make_seq(seed=i), make_seq(top_k=2), make_seq(seed=99, top_p=0.5)]
        position = i % (len(others) + 1)  # the row moves around the batch
        rows = others[:position] + [batched] + others[position:]
        logits = torch.randn(len(rows), VOCAB)
        logits[position] = step
        batched_tokens.append(sampler(logits, rows)[0][position])
    assert batched_tokens == alone_tokens


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, 64)  # uniform: two streams agreeing 8 times is (1/64)^8
    sampler = Sampler(64, [EOS])
    a, b = make_seq(seed=1), make_seq(seed=2)
    stream_a = [sampler(logits.clone(), [a])[0][0] for _ in range(8)]
    stream_b = [sampler(logits.clone(), [b])[0][0] for _ in range(8)]
    assert stream_a != stream_b


# ---- penalties ------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    base = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 4.0]])
    seq = make_seq(prompt=[1, 2], output=[2, 3], repetition_penalty=2.0)  # seen: 1, 2, 3 (prompt too)
    logits = base.clone()
    Sampler(VOCAB, [EOS])._apply_penalties(logits, [seq])
    expected = base.clone()
    expected[0, 1] = -2.0  # -1.0 * 2
    expected[0, 2] = 1.0  # 2.0 / 2
    expected[0, 3] = -4.0  # -2.0 * 2
    assert torch.allclose(logits, expected)


def test_presence_and_frequency_penalties_use_output_counts_only():
    base = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 4.0]])
    seq = make_seq(prompt=[4, 4, 5], output=[2, 3, 3, 3], presence_penalty=0.5, frequency_penalty=0.25)
    logits = base.clone()
    Sampler(VOCAB, [EOS])._apply_penalties(logits, [seq])
    expected = base.clone()
    expected[0, 2] -= 0.25 * 1 + 0.5
    expected[0, 3] -= 0.25 * 3 + 0.5
    assert torch.allclose(logits, expected)  # prompt tokens 4 and 5 are untouched


def test_all_penalties_together_in_a_mixed_batch():
    base = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -0.5, 4.0]] * 2)
    penalised = make_seq(
        prompt=[7], output=[7, 7, 1], repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=1.0
    )
    plain = make_seq(prompt=[7], output=[7, 7, 1])
    logits = base.clone()
    Sampler(VOCAB, [EOS])._apply_penalties(logits, [penalised, plain])
    expected = base.clone()
    expected[0, 7] = 4.0 / 1.5 - (1.0 * 2 - 0.5)
    expected[0, 1] = -1.0 * 1.5 - (1.0 * 1 - 0.5)
    assert torch.allclose(logits, expected)
    assert torch.equal(logits[1], base[1])


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]] * 2)
    repeated = make_seq(prompt=[3], output=[1], temperature=0.0, frequency_penalty=0.5)
    fresh = make_seq(prompt=[3], output=[2], temperature=0.0, frequency_penalty=0.5)
    tokens, _ = Sampler(4, [EOS])(logits, [repeated, fresh])
    assert tokens == [2, 1]


# ---- min_tokens --------------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0, 1.0]])  # EOS best, stop token 2 next
    sampler = Sampler(5, [EOS])
    early = make_seq(output=[4], temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert sampler(logits.clone(), [early])[0] == [3]
    reached = make_seq(output=[4, 4, 4], temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert sampler(logits.clone(), [reached])[0] == [EOS]


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids():
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0, 1.0]])
    seq = make_seq(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert Sampler(5, [EOS])(logits, [seq])[0] == [EOS]
    masked = make_seq(temperature=0.0, min_tokens=2, stop_token_ids=[0, 2], ignore_eos=True)
    assert Sampler(5, [EOS])(logits.clone(), [masked])[0] == [3]


def test_min_tokens_masks_for_random_sampling_too():
    logits = logits_from_probs([0.6, 0.1, 0.1, 0.1, 0.1])
    assert EOS not in sample_support(logits, rows=300, min_tokens=1)


# ---- logprobs ---------------------------------------------------------------------------------------------


def test_logprobs_top_n_include_the_sampled_token_with_its_rank():
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0, 1.0, 6.5]])
    expected = torch.log_softmax(logits[0], dim=-1)
    # min_tokens masks EOS (rank 1), so greedy samples token 2 (rank 2); logprobs are the raw ones
    seq = make_seq(temperature=0.0, min_tokens=1, logprobs=1)
    tokens, entries = Sampler(6, [EOS])(logits, [seq])
    assert tokens == [2]
    entry = entries[0]
    assert set(entry) == {0, 2}
    assert (entry[0].rank, entry[2].rank) == (1, 2)
    assert entry[0].logprob == pytest.approx(float(expected[0]))
    assert entry[2].logprob == pytest.approx(float(expected[2]))


def test_logprobs_sampled_token_outside_the_top_n():
    logits = torch.tensor([[9.0, 0.0, 8.0, 7.0, 1.0, 6.5]])
    expected = torch.log_softmax(logits[0], dim=-1)  # before the sampler masks logits in place
    seq = make_seq(temperature=0.0, min_tokens=1, stop_token_ids=[2, 3], logprobs=2)
    tokens, entries = Sampler(6, [EOS])(logits, [seq])
    assert tokens == [5]
    entry = entries[0]
    assert {t: lp.rank for t, lp in entry.items()} == {5: 4, 0: 1, 2: 2}
    assert list(entry)[0] == 5  # the sampled token comes first
    for token, lp in entry.items():
        assert lp.logprob == pytest.approx(float(expected[token]))


def test_logprobs_when_the_sampled_token_is_in_the_top_n():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    seq = make_seq(temperature=0.0, logprobs=3)
    tokens, entries = Sampler(4, [EOS])(logits, [seq])
    assert tokens == [1]
    assert {t: lp.rank for t, lp in entries[0].items()} == {1: 1, 3: 2, 2: 3}
    assert sum(math.exp(lp.logprob) for lp in entries[0].values()) < 1.0


def test_logprobs_zero_gives_only_the_sampled_token_and_rows_without_logprobs_get_none():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0], [1.0, 5.0, 3.0, 4.0]])
    with_lp = make_seq(temperature=0.0, logprobs=0)
    without = make_seq(temperature=0.0)
    _, entries = Sampler(4, [EOS])(logits, [with_lp, without])
    assert list(entries[0]) == [1] and entries[0][1].rank == 1
    assert entries[1] is None


def test_logprobs_of_a_randomly_sampled_token():
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]]).expand(50, -1).clone()
    seqs = [make_seq(seed=i, logprobs=1) for i in range(50)]
    tokens, entries = Sampler(4, [EOS])(logits, seqs)
    ranks = {0: 4, 1: 3, 2: 2, 3: 1}
    for token, entry in zip(tokens, entries):
        assert entry[token].rank == ranks[token]
        assert entry[3].rank == 1
    assert len(set(tokens)) > 1


# ---- one bad row must not fail the batch ---------------------------------------------------------------


def test_stop_token_ids_beyond_the_vocabulary_do_not_break_min_tokens_masking():
    logits = torch.tensor([[9.0, 0.0, 8.0, 1.0]] * 2)
    odd = make_seq(temperature=0.0, min_tokens=2, stop_token_ids=[2, 10_000])
    neighbour = make_seq(temperature=0.0)
    tokens, _ = Sampler(4, [EOS])(logits, [odd, neighbour])
    assert tokens == [3, EOS]  # EOS and token 2 masked for the odd row only


def test_more_logprobs_than_the_vocabulary_returns_the_whole_vocabulary():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    _, entries = Sampler(4, [EOS])(logits, [make_seq(temperature=0.0, logprobs=20)])
    assert {t: lp.rank for t, lp in entries[0].items()} == {1: 1, 3: 2, 2: 3, 0: 4}


def test_the_callers_logits_are_never_written():
    """Penalties and min_tokens masking work on a copy (a retry after a failure needs the originals)."""
    with torch.inference_mode():  # as the engine's step makes them
        logits = torch.randn(2, VOCAB)
    before = logits.clone()
    seqs = [
        make_seq(output=(3, 3), repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5, temperature=0.0),
        make_seq(min_tokens=4, stop_token_ids=[2], temperature=0.0),
    ]
    Sampler(VOCAB, [EOS])(logits, seqs)
    assert torch.equal(logits, before)


def test_a_vanishing_temperature_is_greedy_not_nan():
    """1e-100 would overflow logits / temperature to -inf everywhere (all-negative logits) -> NaN."""
    logits = torch.tensor([[-3.0, -1.0, -2.0, -5.0, -4.0, -6.0, -7.0, -8.0]])
    assert sample_support(logits, rows=50, temperature=1e-100) == {1}


def test_masks_that_ban_every_token_fail_loudly_instead_of_sampling_token_0():
    sampler = Sampler(VOCAB, [EOS])
    logits = torch.zeros(2, VOCAB)
    banned_all = make_seq(allowed_token_ids=[EOS], min_tokens=2)  # the only allowed token may not come yet
    with pytest.raises(ValueError, match="no token satisfies the request's constraints"):
        sampler(logits, [make_seq(temperature=0), banned_all])
    assert sampler(logits[:1], [make_seq(temperature=0, allowed_token_ids=[3])])[0] == [3]


def test_allowed_token_ids_and_structured_outputs_are_refused_together():
    with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids cannot be combined with structured_outputs"):
        SamplingParams(allowed_token_ids=[3], structured_outputs={"regex": "a"})
