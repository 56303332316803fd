"""Incremental detokenization with a real byte-level BPE tokenizer (the tiny models' tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import shared_tokenizer

from inference.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return shared_tokenizer()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def prompt_ids(tok) -> list[int]:
    return tok.encode("The answer is:")  # with BOS, as a real prompt starts


def stream(tok, ids, stop=(), include=False, prompt=None, skip_special=True):
    """Feed ids one at a time; returns (detokenizer, text after each token, stop string or None)."""
    detok = IncrementalDetokenizer(
        tok, prompt if prompt is not None else prompt_ids(tok), skip_special, list(stop), include
    )
    texts, stopped = [], None
    for token in ids:
        stopped = detok.add_token(token)
        texts.append(detok.text)
        if stopped:
            break
    return detok, texts, stopped


# ---- multi-byte UTF-8 -----------------------------------------------------------------------------------

MULTIBYTE = ["Café naïve", "日本語のテキスト", "party 🎉🎉 time 👩‍💻", "mixed é 日本 🎉 end", "Ωμέγα"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_are_never_emitted_half_way(tok, text):
    ids = encode(tok, text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # the test really splits characters
    _, texts, _ = stream(tok, ids)
    assert all("\ufffd" not in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text only ever grows
    assert texts[-1] == tok.decode(ids) == text


def test_leading_spaces_of_the_first_output_tokens_survive(tok):
    ids = encode(tok, " hello  world, and more")
    _, texts, _ = stream(tok, ids)
    assert texts[-1] == tok.decode(ids) == " hello  world, and more"


def test_a_prompt_ending_mid_character_does_not_garble_the_output(tok):
    emoji = encode(tok, "🎉")
    prompt = prompt_ids(tok) + emoji[:2]  # the prompt's last bytes are half an emoji
    _, texts, _ = stream(tok, encode(tok, " ok"), prompt=prompt)
    assert texts[-1] == " ok"


def test_special_tokens_are_skipped_or_kept(tok):
    ids = encode(tok, "hi") + [tok.eos_token_id]
    assert stream(tok, ids)[1][-1] == "hi"
    assert stream(tok, ids, skip_special=False)[1][-1] == "hi" + tok.eos_token


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.text(alphabet="ab é日本🎉\n.,", min_size=1, max_size=24))
def test_streamed_text_equals_the_full_decode(text):
    tok = shared_tokenizer()
    ids = encode(tok, text)
    _, texts, _ = stream(tok, ids)
    assert all("\ufffd" not in t for t in texts)
    assert texts[-1] == tok.decode(ids)


# ---- stop strings ----------------------------------------------------------------------------------------


def test_stop_string_split_across_tokens_is_detected_and_removed(tok):
    ids = encode(tok, "hello world. Bye")
    stop = "world."
    pieces = [tok.decode([i]) for i in ids]
    assert stop not in pieces and not any(stop in p for p in pieces)  # it spans several tokens
    detok, texts, stopped = stream(tok, ids, stop=[stop])
    assert stopped == stop
    assert detok.text == "hello "
    assert len(texts) < len(ids)  # found at the token that completed it, not at the end


def test_stop_string_kept_with_include_stop_str_in_output(tok):
    detok, _, stopped = stream(tok, encode(tok, "hello world. Bye"), stop=["world."], include=True)
    assert stopped == "world."
    assert detok.text == "hello world."


def test_the_first_matching_stop_string_of_several(tok):
    detok, _, stopped = stream(tok, encode(tok, "one two three four"), stop=["four", "three", "zzz"])
    assert stopped == "three"
    assert detok.text == "one two "


def test_no_stop_string_means_no_stop(tok):
    ids = encode(tok, "one two three")
    detok, texts, stopped = stream(tok, ids, stop=["four"])
    assert stopped is None and detok.text == "one two three" and len(texts) == len(ids)


def test_a_stop_string_in_the_prompt_does_not_stop_the_output(tok):
    prompt = tok.encode("say STOP now")
    detok, _, stopped = stream(tok, encode(tok, " fine"), stop=["STOP"], prompt=prompt)
    assert stopped is None and detok.text == " fine"


def test_stop_string_with_multibyte_characters(tok):
    detok, _, stopped = stream(tok, encode(tok, "abc 日本 def"), stop=["日本"])
    assert stopped == "日本"
    assert detok.text == "abc "


def test_check_stop_false_keeps_stop_strings_in_the_text(tok):
    """Before min_tokens the engine must neither stop nor cut the text at a stop string."""
    detok = IncrementalDetokenizer(tok, prompt_ids(tok), True, ["world."], False)
    for token in encode(tok, "hello world. Bye"):
        assert detok.add_token(token, check_stop=False) is None
    assert detok.text == "hello world. Bye"


# ---- visible text holds back a possible partial stop string ----------------------------------------------


def test_visible_text_holds_back_a_possible_partial_stop_string(tok):
    stop = "END!"
    ids = encode(tok, "some words then END! and more")
    detok = IncrementalDetokenizer(tok, prompt_ids(tok), True, [stop], False)
    visible = []
    for token in ids:
        stopped = detok.add_token(token)
        running_view = detok.visible_text(finished=False)
        if not stopped:
            assert running_view == detok.text[: max(0, len(detok.text) - (len(stop) - 1))]
            assert not running_view.endswith(("E", "EN", "END"))  # never shows a stop string's start
        visible.append(detok.visible_text(finished=bool(stopped)))
        if stopped:
            break
    assert visible[-1] == "some words then "
    assert all(b.startswith(a) for a, b in zip(visible, visible[1:]))  # a stream never retracts text


def test_visible_text_without_stop_strings_is_everything(tok):
    detok, _, _ = stream(tok, encode(tok, "abc def"))
    assert detok.visible_text(finished=False) == detok.text == "abc def"


def test_finished_visible_text_releases_the_held_back_tail(tok):
    detok, _, stopped = stream(tok, encode(tok, "no stop here"), stop=["xyz"])
    assert stopped is None
    assert detok.visible_text(finished=False) == "no stop he"
    assert detok.visible_text(finished=True) == "no stop here"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.text(alphabet="ab é日🎉.", min_size=1, max_size=20),
    st.text(alphabet="ab é日🎉.", min_size=1, max_size=3),
    st.booleans(),
)
def test_streaming_with_a_stop_string_matches_the_offline_answer(text, stop, include):
    tok = shared_tokenizer()
    ids = encode(tok, text)
    detok, _, stopped = stream(tok, ids, stop=[stop], include=include)
    full = tok.decode(ids)
    at = full.find(stop)
    if at == -1:
        assert stopped is None and detok.text == full
    else:
        assert stopped == stop
        assert detok.text == (full[: at + len(stop)] if include else full[:at])
