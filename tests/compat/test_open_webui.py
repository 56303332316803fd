"""Open WebUI (`open-webui`) in front of Tessera: its OpenAI connection and its RAG embeddings point at
Tessera's /v1 with an API key, and headless Chromium drives its own UI: the model list, a streamed chat,
the stop button, a document upload. What Tessera saw is read from its /metrics; screenshots of each step
go to var/compat/screenshots/open-webui/."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect
from prometheus_client.parser import text_string_to_metric_families

from tessera.embedded_redis import free_port
from tests.compat.venvs import VENVS, client_venv, installed_version, wait_until_serving
from tests.platform.browser_output import CHROMIUM, headless_chromium

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(not shutil.which(CHROMIUM), reason="Debian chromium is not installed (make browser)"),
]

REQUIREMENTS = ["open-webui==0.12.4"]
SCREENSHOTS = VENVS / "screenshots" / "open-webui"
ADMIN = {"email": "admin@example.com", "password": "compat-Pass-123"}
DOCUMENT = "Tessera compat notes: the platform's engine workers are called kestrels.\n"
# The stream has to outlast a click: a reply capped here takes SmolLM2 tens of seconds on two cores.
MAX_TOKENS = 300
# The test session's Redis (its settings export REDIS_URL), database and import path are Tessera's: Open WebUI
# reads REDIS_URL and DATABASE_URL too, and keeps its own state in DATA_DIR without them.
NOT_INHERITED = ("REDIS_URL", "DATABASE_URL", "PYTHONPATH", "DJANGO_SETTINGS_MODULE")


def open_webui_env(tessera, data_dir: Path) -> dict[str, str]:
    v1 = tessera.base_url + "/v1"
    return {
        **{key: value for key, value in os.environ.items() if key not in NOT_INHERITED},
        "DATA_DIR": str(data_dir),
        "WEBUI_SECRET_KEY": "compat-secret",
        "WEBUI_ADMIN_EMAIL": ADMIN["email"],  # the admin account is created at start: no sign-up page
        "WEBUI_ADMIN_PASSWORD": ADMIN["password"],
        "OPENAI_API_BASE_URL": v1,
        "OPENAI_API_KEY": tessera.api_key,
        "ENABLE_OLLAMA_API": "false",
        "RAG_EMBEDDING_ENGINE": "openai",
        "RAG_OPENAI_API_BASE_URL": v1,
        "RAG_OPENAI_API_KEY": tessera.api_key,
        "RAG_EMBEDDING_MODEL": tessera.embedding_model,
        # No downloads (embedding, reranking and whisper models, version checks) and no telemetry.
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
        "ANONYMIZED_TELEMETRY": "false",
        # Native function calling sends ~7000 tokens of built-in tool definitions, past the 2048 of
        # the compat stack's SmolLM2 (Tessera answers context_length_exceeded): the legacy mode sends none.
        "DEFAULT_MODEL_PARAMS": json.dumps({"function_calling": "legacy", "max_tokens": MAX_TOKENS}),
        # Side requests to the same small model (titles, tags, follow-ups, search queries) only add load.
        "ENABLE_TITLE_GENERATION": "false",
        "ENABLE_TAGS_GENERATION": "false",
        "ENABLE_FOLLOW_UP_GENERATION": "false",
        "ENABLE_RETRIEVAL_QUERY_GENERATION": "false",
    }


@pytest.fixture(scope="module")
def open_webui(tessera, tmp_path_factory):
    """`open-webui serve` on a free port, its output in a file; the process group is killed at the end."""
    bin_dir = client_venv("open-webui", REQUIREMENTS)
    work = tmp_path_factory.mktemp("open-webui")
    (work / "data").mkdir()
    port = free_port()
    log = (work / "open-webui.log").open("w")
    argv = [str(bin_dir / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(
        argv,
        cwd=work,
        env=open_webui_env(tessera, work / "data"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until_serving(f"http://127.0.0.1:{port}/health", process, work / "open-webui.log", "Open WebUI")
        yield f"http://127.0.0.1:{port}", installed_version(bin_dir, "open-webui")
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()


@pytest.fixture(scope="module")
def page(open_webui):
    """One signed-in admin page for the module's checks, each starting from a new chat."""
    url, _ = open_webui
    with headless_chromium() as browser:
        page = browser.new_context(base_url=url, viewport={"width": 1280, "height": 800}).new_page()
        page.set_default_timeout(30_000)
        page.goto("/auth")
        page.get_by_placeholder("Enter Your Email").fill(ADMIN["email"])
        page.get_by_placeholder("Enter Your Password").fill(ADMIN["password"])
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("button", name="Okay, Let's Go!").click()  # the release notes shown at first sign-in
        yield page


def shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


def metric(tessera, name: str, **labels: str) -> float:
    """The sum of Tessera's /metrics samples called name whose labels include these."""
    with urllib.request.urlopen(tessera.base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items())


def wait_until(condition, what: str, timeout: float = 60.0):
    """condition()'s first true value, polled; fails naming what did not happen."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.5)
    return value


def more_than(read, value: float, what: str) -> float:
    """read() polled until it exceeds value; its new value."""
    return wait_until(lambda: (now := read()) > value and now, what)


def finished_chats(tessera) -> float:
    """Requests the chat engine finished itself (stop or length): aborted ones are not among them."""
    return metric(tessera, "vllm:request_success_total", model_name=tessera.chat_model)


def aborted_chats(tessera) -> float:
    return metric(tessera, "tessera_engine_aborts_total", model=tessera.chat_model)


def embedding_calls(tessera) -> float:
    return metric(tessera, "tessera_http_requests_total", route="/v1/embeddings", method="POST", status="200")


def send(page, text: str):
    """A new chat with text sent; the assistant reply's locator."""
    page.goto("/")
    page.locator("#chat-input").fill(text)
    page.keyboard.press("Enter")
    return page.locator(".chat-assistant #response-content-container").last


def test_the_model_selector_lists_tessera_models(page, open_webui, tessera, compat_report):
    page.goto("/")
    page.locator("#model-selector-model-button").click()
    expect(page.get_by_role("option", name=tessera.chat_model)).to_be_visible()
    listed = page.get_by_role("option").all_inner_texts()
    assert {name.strip() for name in listed} == {tessera.chat_model, tessera.embedding_model}, listed
    shot(page, "1-model-selector")
    page.get_by_role("option", name=tessera.chat_model).click()
    expect(page.locator("#model-selector-model-button")).to_have_text(tessera.chat_model)
    compat_report("open-webui", open_webui[1], "model selector (GET /v1/models)", "passed: both Tessera models")


def test_a_chat_streams_in_the_ui(page, open_webui, tessera, compat_report):
    finished = finished_chats(tessera)
    reply = send(page, "Tell me about the moon in three paragraphs.")
    expect(reply).to_have_text(re.compile(r"\S"))
    first = reply.inner_text()
    expect(reply).not_to_have_text(first, use_inner_text=True)  # more text arrived after the first shown
    shot(page, "2-chat-streaming")
    expect(page.get_by_role("button", name="Regenerate").last).to_be_visible(timeout=180_000)
    final = reply.inner_text()
    assert len(final) > len(first), (first, final)
    more_than(lambda: finished_chats(tessera), finished, "Tessera counts the chat finished")
    shot(page, "3-chat-done")
    compat_report(
        "open-webui",
        open_webui[1],
        "a chat in the UI (stream=True)",
        f"passed: text grew from {len(first)} to {len(final)} characters as it streamed, finished by Tessera",
    )


def test_the_stop_button_ends_the_stream_in_tessera(page, open_webui, tessera, compat_report):
    aborts, finished = aborted_chats(tessera), finished_chats(tessera)
    reply = send(page, "Write a very long story about a dragon and a knight.")
    expect(reply).to_have_text(re.compile(r"[\s\S]{60}"))
    stop = page.get_by_role("button", name="Stop", exact=True)
    stop.click()
    expect(stop).to_be_hidden()
    # Open WebUI closed its stream to Tessera: the engine aborted the request, it did not finish it.
    more_than(lambda: aborted_chats(tessera), aborts, "Tessera counts an abort")
    assert finished_chats(tessera) == finished
    stopped = reply.inner_text()
    page.wait_for_timeout(2_000)  # a window to see that nothing more arrives: there is no event for "none"
    assert reply.inner_text() == stopped
    shot(page, "4-chat-stopped")
    compat_report(
        "open-webui",
        open_webui[1],
        "the stop button mid-stream",
        f"passed: reply stopped at {len(stopped)} characters, Tessera aborted the request",
    )


def test_a_document_is_embedded_by_tessera_and_retrieved(page, open_webui, tessera, compat_report, tmp_path):
    document = tmp_path / "tessera-notes.txt"
    document.write_text(DOCUMENT)
    before = embedding_calls(tessera)
    page.goto("/")
    with page.expect_response(lambda r: r.request.method == "POST" and "/api/v1/files/" in r.url) as upload:
        page.locator("input[type=file][multiple]").set_input_files(document)
    file_id = upload.value.json()["id"]
    assert wait_until(lambda: processed(page, file_id), "Open WebUI has processed the file") == "completed"
    uploaded = more_than(lambda: embedding_calls(tessera), before, "Tessera answers the file's embeddings")
    shot(page, "5-document-attached")
    page.locator("#chat-input").fill("What are the platform's engine workers called?")
    page.keyboard.press("Enter")
    # The question is embedded by Tessera too, and the chunk found with it is shown as the reply's source.
    expect(page.get_by_role("button", name="1 Source")).to_be_visible(timeout=120_000)
    queried = more_than(lambda: embedding_calls(tessera), uploaded, "Tessera answers the question's embedding")
    shot(page, "6-document-answer")
    compat_report(
        "open-webui",
        open_webui[1],
        "a text document attached to a chat (RAG, openai embedding engine)",
        f"passed: processed, {uploaded - before:.0f} + {queried - uploaded:.0f} /v1/embeddings calls "
        "(file, question), 1 source retrieved",
    )


def processed(page, file_id: str) -> str | None:
    """The file's processing status from Open WebUI's API once it is final (completed or failed)."""
    token = page.evaluate("() => localStorage.token")
    answer = page.request.get(f"/api/v1/files/{file_id}/process/status", headers={"Authorization": f"Bearer {token}"})
    status = answer.json().get("status")
    return status if status in ("completed", "failed") else None
