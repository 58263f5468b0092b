#!/usr/bin/env bash
# Set up a virtual environment with everything ladle and its tests need, lint, run the tests.
# torch is pinned to 2.13.0: on these machines that is the CPU build on local disk; an unpinned
# torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
# NixlConnector (prefill/decode disaggregation) on NIXL's UCX backend: the CUDA 12 build's
# Python package runs on CPU too; --no-deps keeps the CPU torch (its deps pull a CUDA torch).
.venv/bin/pip install -q --disable-pip-version-check --no-deps nixl-cu12==1.5.1
# The playground's browser test drives Debian's chromium through Playwright (Playwright cannot
# download its own browsers here).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
        >/dev/null 2>&1 || echo "chromium could not be installed; the browser test will skip"
fi
# The TLS test makes its CA and certificate with the openssl command.
if ! command -v openssl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl) \
        >/dev/null 2>&1 || echo "openssl could not be installed; the TLS test will skip"
fi
.venv/bin/ruff check ladle tests benchmarks
# Two workers, a test file each at a time (module and session fixtures stay per file / per
# worker), one thread per process: most server tests wait on HTTP with a core idle, so this runs
# the suite in ~24 min instead of ~35 on 2 cores (LADLE_TEST_WORKERS=0: serial).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -q -p no:cacheprovider \
    -n "${LADLE_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
# With no arguments (CI): the server's chat, completions, streaming, tools, logprobs and
# structured-output tests once more against a tensor-parallel server (-tp 2 over gloo; issue 12)
# and against an int8 (W8A8) server (issue 21).
if [ $# -eq 0 ]; then
    for serve_args in "-tp 2" "--quantization int8"; do
        LADLE_TEST_SERVE_ARGS="$serve_args" .venv/bin/python -m pytest -q -p no:cacheprovider \
            tests/test_server.py tests/test_server_structured.py
    done
fi
