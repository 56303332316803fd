"""Headless Debian Chromium (driven by Playwright) against the live stack in its own processes:
the web server (uvicorn), a `manage.py engine` worker on the tiny model, a private redis-server and an SQLite file
(tests/platform/live_stack.py), started with the dev settings so that static files are served.

Walks what a person does: sign up, chat and watch tokens arrive, stop, regenerate, find the
conversation in history, create an API key, log out and in. Screenshots go to var/test-screenshots/
(docs/screenshots/ under `make screenshots`, tests/platform/browser_output.py).
"""

import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from inference import protocol
from tests.inference.worker_helpers import wait_for
from tests.platform.browser_output import CHROMIUM, browser_stack_model, headless_chromium
from tests.platform.browser_output import save_screenshot as shot
from tests.platform.live_stack import LiveStack

PASSWORD = "a-Long-pass-123"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which(CHROMIUM), reason="Debian chromium is not installed (make browser)"),
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """Dev settings (DEBUG=1: WhiteNoise serves platform/static without collectstatic), a roomier engine."""
    # A long heartbeat TTL: the stop test freezes the engine for as long as the click takes.
    env = {
        "DJANGO_SETTINGS_MODULE": "tessera.settings.dev",
        "DEBUG": "1",
        "QUOTA_MAX_TOKENS_PER_REQUEST": "600",
        "ENGINE_HEARTBEAT_TTL": "120",
    }
    engine_args = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "num_kv_blocks": 256}
    model, model_env = browser_stack_model(tiny_model_dir)
    with LiveStack.start(
        model, tmp_path_factory.mktemp("chat-browser"), env={**env, **model_env}, engine_args=engine_args
    ) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as chromium:
        yield chromium


@pytest.fixture
def page(browser, stack):
    context = browser.new_context(base_url=stack.base_url, viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(20_000)
    yield page
    context.close()


def sign_up(page, username: str, screenshot: bool = False) -> None:
    page.goto("/accounts/signup/")
    page.fill("#id_username", username)
    page.fill("#id_password1", PASSWORD)
    page.fill("#id_password2", PASSWORD)
    if screenshot:
        shot(page, "signup")
    page.click("button[type=submit]")
    page.wait_for_url("**/chat/")


@contextmanager
def frozen_mid_answer(stack, send):
    """send(), then freeze the engine worker once the request's first text delta is in Redis; yields
    the request id, and lets the engine go on when the block ends (the abort is then applied)."""
    r = stack.redis()
    before = set(r.scan_iter(match=protocol.output_stream("*")))
    send()
    [key] = wait_for(lambda: set(r.scan_iter(match=protocol.output_stream("*"))) - before, timeout=20)
    request_id = key.decode().removeprefix(protocol.output_stream(""))
    wait_for_text_delta(r, request_id)
    engine = stack.processes["engine0"]
    os.killpg(engine.pid, signal.SIGSTOP)
    try:
        assert not [e for e in output_events(r, request_id) if e["type"] in protocol.TERMINAL_EVENTS]
        yield request_id
    finally:
        os.killpg(engine.pid, signal.SIGCONT)


def wait_for_text_delta(r, request_id: str, timeout_ms: int = 20_000) -> None:
    """Block on the output stream (no polling gap) until a delta with text is in it."""
    last = "0-0"
    while True:
        entries = r.xread({protocol.output_stream(request_id): last}, block=timeout_ms)
        assert entries, f"no output for {request_id} within {timeout_ms} ms"
        for last, fields in entries[0][1]:
            if any(e["type"] == "delta" and e["text"] for e in protocol.decode(fields[b"events"])):
                return


def output_events(r, request_id: str) -> list[dict]:
    return [
        event
        for _, fields in r.xrange(protocol.output_stream(request_id))
        for event in protocol.decode(fields[b"events"])
    ]


def wait_idle(page) -> None:
    page.wait_for_selector(".msg.streaming", state="detached")
    page.wait_for_selector("#send", state="visible")


def test_chat_stop_regenerate_history_and_keys_in_a_real_browser(page, stack):
    sign_up(page, "walter", screenshot=True)
    page.wait_for_selector("#ws-status.online")

    # Send a message and watch the answer grow while it streams.
    page.fill("#p-max_tokens", "120")
    page.fill("#p-temperature", "0")
    page.fill("#prompt", "Tell me about tiles")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant.streaming")
    body = page.locator(".msg.assistant .body").last
    wait_for(lambda: len(body.inner_text()) > 0, timeout=20)
    early = len(body.inner_text())
    wait_idle(page)
    assert len(body.inner_text()) > early  # tokens kept arriving after the first ones
    assert "completion tokens" in page.locator(".msg.assistant .stats").last.inner_text()
    assert "/chat/c/" in page.url
    shot(page, "playground")

    # A long answer, stopped mid-way with the stop button. The engine is frozen (SIGSTOP) as soon
    # as the answer's first delta is in Redis, so the click lands while it streams whatever the load.
    page.fill("#p-max_tokens", "500")
    page.fill("#prompt", "Now a very long story please")
    with frozen_mid_answer(stack, lambda: page.click("#send")) as request_id:
        page.wait_for_selector("#stop", state="visible")
        wait_for(lambda: len(page.locator(".msg.assistant .body").last.inner_text()) > 0, timeout=20)
        assert page.locator(".msg.assistant.streaming").count() == 1
        page.click("#stop")
        wait_for(lambda: stack.redis().exists(protocol.aborted_key(request_id)), timeout=20)
    wait_idle(page)
    assert "stopped" in page.locator(".msg.assistant .stats").last.inner_text()
    wait_for(lambda: all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stack.worker_stats()), timeout=5)
    saved = stack.sql("SELECT status, finish_reason FROM chat_message WHERE role='assistant' ORDER BY id DESC LIMIT 1")
    assert saved == [("stopped", "abort")]

    # Regenerate the last answer: a second version appears, with branch navigation.
    page.fill("#p-max_tokens", "20")
    page.locator(".msg.assistant").last.get_by_role("button", name="Regenerate").click()
    page.wait_for_selector(".msg.assistant .branch-nav")
    wait_idle(page)
    assert "2/2" in page.locator(".msg.assistant .branch-nav").last.inner_text()

    # History: the conversation is listed and found by search.
    page.click("nav >> text=History")
    page.fill("input[name=q]", "tiles")
    page.keyboard.press("Enter")
    page.wait_for_selector("#conversation-table >> text=Tell me about tiles")
    shot(page, "history")
    page.click("#conversation-table >> text=Tell me about tiles")
    page.wait_for_selector(".msg.assistant")
    assert page.locator(".msg").count() == 4  # two turns on the branch on screen

    # API keys: create one, see it once.
    page.click("nav >> text=API keys")
    page.fill("#id_name", "browser-test")
    page.click("text=Create key")
    key = page.locator("[data-testid=new-key]").inner_text()
    assert key.startswith("tsk-")
    shot(page, "api-keys")
    page.reload()
    assert key not in page.content() and "browser-test" in page.content()

    page.click("nav >> text=Usage")
    page.wait_for_selector("#quota")
    shot(page, "usage")
    page.goto("/history/requests/")
    page.wait_for_selector("#request-table")
    shot(page, "requests")

    # Log out, then log back in.
    page.click("text=Log out")
    page.wait_for_url("**/accounts/login/")
    page.fill("#id_username", "walter")
    page.fill("#id_password", PASSWORD)
    shot(page, "login")
    page.click("button[type=submit]")
    page.wait_for_url("**/chat/")


def test_model_and_user_text_cannot_inject_html(page, stack):
    sign_up(page, "mallory")
    page.wait_for_selector("#ws-status.online")
    payload = (
        '<img src=x onerror="window.__pwned=1"> **bold** and `code`\n\n```\n<script>window.__pwned=2</script>\n```'
    )
    page.fill("#p-max_tokens", "5")
    page.fill("#prompt", payload)
    page.click("#send")
    wait_idle(page)
    user_body = page.locator(".msg.user .body").first
    assert "<img src=x" in user_body.inner_text()  # shown as text
    assert user_body.locator("img").count() == 0 and user_body.locator("script").count() == 0
    assert user_body.locator("strong").inner_text() == "bold"  # the safe subset still renders
    assert user_body.locator("pre code").count() == 1
    assert page.evaluate("window.__pwned") is None


MARKDOWN_JS = Path(__file__).resolve().parents[3] / "platform" / "static" / "js" / "markdown.js"
HOSTILE = [
    '<img src=x onerror="window.__pwned=1">',
    "<script>window.__pwned=2</script>",
    "[click](javascript:window.__pwned=3)",
    '[x](https://example.com/" onmouseover="window.__pwned=4)',
    "```html\n<iframe src=javascript:alert(1)></iframe>\n```",
    "`<b onclick=x>`",
    "# <svg onload=alert(1)>",
    "- <a href=javascript:alert(1)>item</a>",
    "> <style>body{display:none}</style>",
    "**<i>bold</i>** *<u>it</u>*",
]


def test_the_markdown_renderer_escapes_before_it_formats(browser):
    page = browser.new_page()
    try:
        page.set_content("<div id=out></div>")
        page.add_script_tag(content=MARKDOWN_JS.read_text())
        for source in HOSTILE:
            page.evaluate("src => { document.getElementById('out').innerHTML = TesseraMarkdown.render(src); }", source)
            tags = page.evaluate("() => [...document.querySelectorAll('#out *')].map(e => e.tagName.toLowerCase())")
            assert set(tags) <= {"p", "br", "pre", "code", "strong", "em", "h1", "ul", "li", "blockquote", "a"}, source
            hrefs = page.evaluate("() => [...document.querySelectorAll('#out a')].map(a => a.getAttribute('href'))")
            assert all(h.startswith("https://") for h in hrefs), source
            handlers = page.evaluate(
                "() => [...document.querySelectorAll('#out *')].flatMap(e => [...e.attributes].map(a => a.name))"
            )
            assert not [h for h in handlers if h.startswith("on")], source
        assert page.evaluate("window.__pwned") is None
        html = page.evaluate(
            "() => TesseraMarkdown.render('# Title\\n\\nSome `x < y` and **b**\\n\\n```py\\nif a < b:\\n```')"
        )
        assert html == (
            "<h1>Title</h1><p>Some <code>x &lt; y</code> and <strong>b</strong></p>"
            '<pre><code class="language-py">if a &lt; b:</code></pre>'
        )
    finally:
        page.close()
