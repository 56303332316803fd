"""chat.services and chat.selectors: branches, quota reservation and settlement, exports."""

import json

import pytest

from chat import params as chat_params
from chat import selectors, services
from chat.models import Conversation, Message
from errors import PlanViolation, QuotaExceeded
from quotas import selectors as quota_selectors
from usage.models import UsageRecord

PANEL = {"model": "tiny", "system_prompt": "Be brief.", "params": {"temperature": 0, "max_tokens": 8}}

pytestmark = pytest.mark.django_db


def finish(reply, text="Hello there", completion_tokens=3, reason="stop", gen=None):
    """The reply's generation as a worker would write it: the first token 10 ms after arrival, the end at 110 ms."""
    gen = gen or reply.gen
    arrived_ms = int(gen.arrived_at * 1000)
    gen.arrived_at = arrived_ms / 1000
    gen.result.add(
        {
            "type": "delta",
            "index": 0,
            "text": text,
            "token_ids": [7] * completion_tokens,
            "finish_reason": reason,
            "entry_id": f"{arrived_ms + 10}-0",
        }
    )
    gen.result.add(
        {
            "type": "finish",
            "finish_reasons": [reason],
            "metrics": {"ttft_ms": 4.0},
            "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": 0},
            "entry_id": f"{arrived_ms + 110}-0",
        }
    )
    return services.finish_reply(reply.message_id, gen)


def test_send_creates_conversation_turn_and_a_streaming_answer_with_reserved_quota(user, chat_settings):
    reply = services.send_message(user, "What is a paged KV cache?", PANEL)
    conversation = Conversation.objects.get(pk=reply.conversation_id)
    assert conversation.title == "What is a paged KV cache?"
    assert conversation.system_prompt == "Be brief."
    assert conversation.params["max_tokens"] == 8
    assistant = Message.objects.get(pk=reply.message_id)
    assert (assistant.role, assistant.status, assistant.parent_id) == ("assistant", "streaming", reply.user_message_id)
    assert conversation.current_leaf_id == assistant.pk
    assert reply.prompt_token_ids and reply.sampling_params == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 0,
        "repetition_penalty": 1.1,
        "max_tokens": 8,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }  # top_p, top_k, repetition_penalty: the panel's defaults
    usage = quota_selectors.quota_status(user).usage
    assert (usage.concurrent, usage.tokens_today) == (1, len(reply.prompt_token_ids) + 8)


def test_finish_reply_saves_settles_and_records_usage_exactly_once(user, chat_settings):
    reply = services.send_message(user, "hi", PANEL)
    assert finish(reply)
    second_follower = services.generation_for(Message.objects.get(pk=reply.message_id))
    assert not finish(reply, text="again", completion_tokens=99, gen=second_follower)  # changes nothing
    message = Message.objects.get(pk=reply.message_id)
    assert (message.status, message.content, message.completion_tokens) == ("complete", "Hello there", 3)
    assert (message.ttft_ms, message.latency_ms, message.tokens_per_s) == (10.0, 110.0, pytest.approx(30.0))
    record = UsageRecord.objects.get(user=user)
    assert (record.source, record.request_id, record.completion_tokens) == ("playground", message.request_id, 3)
    assert (record.ttft_ms, record.engine_ttft_ms, record.latency_ms) == (10.0, 4.0, 110.0)
    usage = quota_selectors.quota_status(user).usage
    assert (usage.concurrent, usage.tokens_today) == (0, len(reply.prompt_token_ids) + 3)


def test_an_aborted_reply_is_saved_as_stopped(user, chat_settings):
    reply = services.send_message(user, "hi", PANEL)
    finish(reply, text="Hel", completion_tokens=1, reason="abort")
    assert Message.objects.get(pk=reply.message_id).status == "stopped"


def test_a_quota_refusal_leaves_nothing_behind(user, chat_settings):
    chat_settings.QUOTA_DEFAULT_PLAN = {"tokens_per_day": 5}
    with pytest.raises(QuotaExceeded) as refused:
        services.send_message(user, "hello", PANEL)
    assert refused.value.code == "insufficient_quota"
    assert not Conversation.objects.exists() and not Message.objects.exists()


def test_max_tokens_over_the_plan_is_refused(user, chat_settings):
    with pytest.raises(PlanViolation):
        services.send_message(user, "hello", {**PANEL, "params": {"max_tokens": 10_000}})


def test_invalid_parameters_are_named(user, chat_settings):
    with pytest.raises(services.ChatError, match="temperature"):
        services.send_message(user, "hello", {"params": {"temperature": 9}})
    with pytest.raises(chat_params.InvalidParams, match="stop"):
        chat_params.clean({"stop": ["a", "b", "c", "d", "e"]})
    assert chat_params.clean({"seed": "", "stop": "###"})["stop"] == ["###"]


def test_edit_resends_as_a_new_branch_and_keeps_the_old_one(user, chat_settings):
    first = services.send_message(user, "Name a colour", PANEL)
    finish(first, text="Blue")
    conversation = Conversation.objects.get(pk=first.conversation_id)
    second = services.send_message(user, "Another", PANEL, conversation)
    finish(second, text="Red")

    original = Message.objects.get(pk=first.user_message_id)
    edited = services.edit_message(user, original, "Name a fruit", PANEL)
    finish(edited, text="Apple")
    conversation.refresh_from_db()
    branch = selectors.current_branch(conversation)
    assert [m["content"] for m in branch] == ["Name a fruit", "Apple"]
    assert branch[0]["siblings"] == [original.pk, edited.user_message_id] and branch[0]["sibling_index"] == 1

    services.select_branch(conversation, original)  # back to the old branch, with its continuation
    assert [m["content"] for m in selectors.current_branch(conversation)] == ["Name a colour", "Blue", "Another", "Red"]


def test_regenerate_adds_a_sibling_answer_to_the_same_turn(user, chat_settings):
    first = services.send_message(user, "Say hi", PANEL)
    finish(first, text="Hi")
    regen = services.regenerate(user, Message.objects.get(pk=first.message_id), PANEL)
    assert regen.user_message_id == first.user_message_id
    finish(regen, text="Hello")
    conversation = Conversation.objects.get(pk=first.conversation_id)
    branch = selectors.current_branch(conversation)
    assert [m["content"] for m in branch] == ["Say hi", "Hello"]
    assert branch[1]["siblings"] == [first.message_id, regen.message_id]


def test_regenerate_refuses_a_streaming_answer(user, chat_settings):
    reply = services.send_message(user, "Say hi", PANEL)
    with pytest.raises(services.ChatError):
        services.regenerate(user, Message.objects.get(pk=reply.message_id), PANEL)


def test_the_prompt_contains_the_branch_and_the_system_prompt(user, chat_settings):
    from chat import prompting

    first = services.send_message(user, "alpha question", PANEL)
    finish(first, text="beta answer")
    conversation = Conversation.objects.get(pk=first.conversation_id)
    second = services.send_message(user, "gamma question", PANEL, conversation)
    text = prompting.tokenizer().decode(second.prompt_token_ids)
    for part in ("Be brief.", "alpha question", "beta answer", "gamma question"):
        assert part in text


def test_save_progress_only_touches_streaming_messages(user, chat_settings):
    reply = services.send_message(user, "hi", PANEL)
    services.save_progress(reply.message_id, "partial")
    assert Message.objects.get(pk=reply.message_id).content == "partial"
    finish(reply, text="final")
    services.save_progress(reply.message_id, "late write")
    assert Message.objects.get(pk=reply.message_id).content == "final"


def test_a_nul_in_the_model_output_is_saved_as_u_fffd(user, chat_settings):
    # PostgreSQL's text cannot hold NUL (make test runs on it); the streamed text keeps it as is.
    reply = services.send_message(user, "hi", PANEL)
    services.save_progress(reply.message_id, "par\x00tial")
    assert Message.objects.get(pk=reply.message_id).content == "par\ufffdtial"
    assert finish(reply, text="fi\x00nal")
    assert Message.objects.get(pk=reply.message_id).content == "fi\ufffdnal"


def test_a_nul_in_the_message_is_refused(user, chat_settings):
    with pytest.raises(services.ChatError, match="NUL"):
        services.send_message(user, "a\x00b", PANEL)


def test_search_rename_and_exports(user, other_user, chat_settings):
    reply = services.send_message(user, "Tell me about *tiles*", PANEL)
    finish(reply, text="Tessera are **tiles**.")
    conversation = Conversation.objects.get(pk=reply.conversation_id)
    services.rename_conversation(conversation, "  Mosaics  ")
    other = services.send_message(other_user, "tiles too", PANEL)
    finish(other)

    assert list(selectors.conversations_for(user, "mosaic")) == [conversation]
    assert list(selectors.conversations_for(user, "tessera")) == [conversation]  # message text
    assert list(selectors.conversations_for(user, "nothing-like-this")) == []
    exported = selectors.export_json(conversation)
    assert json.dumps(exported) and exported["title"] == "Mosaics"
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    markdown = selectors.export_markdown(conversation)
    assert markdown.startswith("# Mosaics") and "## Assistant\n\nTessera are **tiles**." in markdown


def test_conversations_are_listed_newest_first(user, chat_settings):
    a = services.send_message(user, "first", PANEL)
    finish(a)
    b = services.send_message(user, "second", PANEL)
    finish(b)
    assert [c.title for c in selectors.conversations_for(user)] == ["second", "first"]


def test_selectors_never_return_another_users_objects(user, other_user, chat_settings):
    reply = services.send_message(user, "mine", PANEL)
    assert selectors.conversation_for(other_user, reply.conversation_id) is None
    assert selectors.message_for(other_user, reply.message_id) is None
    assert selectors.conversation_for(user, "not-a-uuid") is None


def test_a_second_send_while_an_answer_streams_is_refused(user, chat_settings):
    reply = services.send_message(user, "one", PANEL)
    conversation = Conversation.objects.get(pk=reply.conversation_id)
    with pytest.raises(services.ChatError, match="still being generated"):
        services.send_message(user, "two", PANEL, conversation)


def test_only_served_models_can_be_chosen(user, chat_settings):
    with pytest.raises(services.ChatError, match="not being served"):
        services.send_message(user, "hello", {**PANEL, "model": "gpt-9"})
    assert not Conversation.objects.exists()


def test_a_conversation_is_tokenized_for_the_model_that_will_run_it(user, chat_settings, tiny_model_dir, tmp_path):
    """Requests are routed by model, so the prompt must use that model's own chat template."""
    import shutil

    import redis

    from generation import tokenization
    from inference import protocol

    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    template = other / "chat_template.jinja"
    template.write_text("OTHER " + template.read_text())
    r = redis.Redis.from_url(chat_settings.REDIS_URL)
    beat = protocol.Heartbeat(
        worker_id="chat-other",
        model="other",
        served_model_names=["other", "other-alias"],
        config={"model_path": str(other)},
    )
    r.hset(protocol.heartbeat_key("chat-other"), mapping=beat.fields())
    r.expire(protocol.heartbeat_key("chat-other"), 30)
    r.sadd(protocol.WORKERS_SET, "chat-other")
    try:
        reply = services.send_message(user, "Hello", {"model": "other-alias", "params": {"max_tokens": 4}})
        ours = services.send_message(user, "Hello", {"model": "tiny", "params": {"max_tokens": 4}})
    finally:
        r.delete(protocol.heartbeat_key("chat-other"))
        r.srem(protocol.WORKERS_SET, "chat-other")
    messages = [{"role": "user", "content": "Hello"}]
    assert reply.model == "other-alias"
    assert reply.prompt_token_ids == tokenization.chat_prompt_ids(str(other), messages)
    assert ours.prompt_token_ids == tokenization.chat_prompt_ids(tiny_model_dir, messages)
    assert reply.prompt_token_ids != ours.prompt_token_ids, "the two templates must differ for this to mean anything"
