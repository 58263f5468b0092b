"""The web playground at / in a real browser: headless Chromium (Debian's `chromium` package)
driven by Playwright for Python against a real `ladle serve ladle-demo --api-key ...`. The page
asks for the key, streams a reply, shows tokens/s, and its stop button aborts a long reply (the
server's running count returns to 0). Also: --disable-playground and the page's files."""

from __future__ import annotations

import re
import shutil

import pytest
from fastapi.testclient import TestClient
from test_server import API_KEY, MODEL, RemoteServer

from ladle.entrypoints.api_server import build_app
from ladle.entrypoints.common import ServerState

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_pages_served_and_disable_playground():
    """The app's routes alone (no engine is needed to serve static files)."""
    on = TestClient(build_app(ServerState(engine=None, served_model_names=[MODEL])))
    page = on.get("/")
    assert page.status_code == 200 and "<script src=\"/playground/app.js\">" in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = on.get(f"/playground/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    # No CDN or other network use: every reference stays on this server.
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
    off = TestClient(build_app(ServerState(engine=None, served_model_names=[MODEL],
                                           enable_playground=False)))
    assert off.get("/").status_code == 404
    assert off.get("/playground/app.js").status_code == 404


@pytest.fixture(scope="module")
def server():
    s = RemoteServer("--api-key", API_KEY, "--max-model-len", "2048", "--dtype", "float32",
                     "--disable-access-log")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def browser():
    """Headless Debian Chromium through Playwright (which cannot download browsers here); one
    per module, closed before the next module runs (its sync API holds an event loop)."""
    if CHROMIUM is None:
        pytest.skip("no Chromium installed (apt-get install -y chromium; scripts/test.sh does "
                    "it): the playground's browser tests cannot run")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser):
    page = browser.new_page()
    page.set_default_timeout(60_000)
    yield page
    page.close()


def running(server) -> float:
    return server.metrics()["ladle:num_requests_running"]


def test_chat_streams_and_stop_aborts(server, page, tmp_path):
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)  # two cores shared with the server
    page.goto(server.url + "/")
    # The server has --api-key: the page asks for it, then lists the models.
    expect(page.locator("#key-box")).to_be_visible()
    page.fill("#api-key", API_KEY)
    page.click("#save-key")
    expect(page.locator("#model option")).to_have_text([MODEL])

    page.fill("#system", "You are a poet.")
    page.fill("#max_tokens", "12")
    page.fill("#seed", "1")
    page.fill("#message", "Write a line about the sea.")
    page.press("#message", "Enter")
    reply = page.locator(".turn.assistant").last
    expect(reply.locator(".content")).not_to_have_text("")
    stats = reply.locator(".stats")
    expect(stats).to_contain_text("finish: length")
    assert re.search(r"12 tokens · TTFT \d+ ms · \d+(\.\d)? tokens/s", stats.inner_text())

    # A long reply, stopped while it streams: the request is aborted in the engine.
    page.fill("#max_tokens", "1500")
    page.fill("#message", "Now a very long story.")
    page.click("#send")
    reply = page.locator(".turn.assistant").last
    expect(reply.locator(".stats")).to_have_text(re.compile(r"^([3-9]|\d\d+) tokens"))
    assert running(server) == 1
    page.click("#stop")
    expect(reply.locator(".stats")).to_contain_text("stopped")
    assert re.search(r"\d+(\.\d)? tokens/s", reply.locator(".stats").inner_text())
    server.wait_idle()
    expect(page.locator("#send")).to_be_enabled()
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 0


def test_completion_mode_continues_text_with_the_real_model(gemma_server, page, tmp_path):
    """The first minute of a new user: the real model in the playground's completion mode."""
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)
    page.goto(gemma_server.url + "/")
    expect(page.locator("#model option")).to_have_text(["gemma-3-270m"])
    page.select_option("#mode", "completion")
    expect(page.locator("#system-label")).to_be_hidden()
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "8")
    prompt = "The Eiffel Tower is located in the city of"
    page.fill("#message", prompt)
    page.press("#message", "Enter")
    turn = page.locator(".turn.completion").last
    expect(turn.locator(".prompt")).to_have_text(prompt)
    expect(turn.locator(".stats")).to_contain_text("finish:")
    assert turn.locator(".content").inner_text().startswith(" Paris"), turn.inner_text()
    assert re.search(r"\d+ tokens · TTFT \d+ ms", turn.locator(".stats").inner_text())
    page.screenshot(path=str(tmp_path / "completion.png"), full_page=True)
