"""vLLM users' launch lines start ladle and mean what they mean on vLLM: the flags, the same
settings from --config FILE.yaml, CORS, --root-path, TLS, the server's chat template and default
template kwargs, generation-config defaults, special-token tool/think markers, a plugin tool
parser loaded by path, and tool_choice "required" cut by max_tokens. Three real servers."""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from safetensors import safe_open
from test_server import API_KEY, RemoteServer

from ladle.entrypoints.cli import human_readable_int, parse_serve_args
from ladle.models.demo import demo_chat_template, ensure_demo_model
from ladle.tokenizer import generation_defaults, load_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "Plan my morning."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}]
MARK = "SERVER-WIDE TEMPLATE"


def vllm_line(template: Path) -> list[str]:
    """Acceptance 1's launch line, as a vLLM user writes it."""
    return ["--served-model-name", "m", "--gpu-memory-utilization", "0.5", "--max-model-len",
            "4k", "--trust-remote-code", "--enforce-eager", "--disable-log-requests",
            "--chat-template", str(template), "--default-chat-template-kwargs",
            '{"enable_thinking": false}', "--generation-config", "vllm", "--allowed-origins",
            '["*"]', "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text("{{- '" + MARK + "\\n' -}}" + demo_chat_template())
    return path


@pytest.fixture(scope="module")
def server(template):
    """Acceptance 1's line, behind --root-path /llm, with an API key, a reasoning parser and
    a few of vLLM's response flags."""
    s = RemoteServer("--model", ensure_demo_model(), *vllm_line(template), "--root-path", "/llm",
                     "--api-key", API_KEY, "--max-num-seqs", "8", "--reasoning-parser", "qwen3",
                     "--disable-uvicorn-access-log", "--enable-force-include-usage",
                     "--return-tokens-as-token-ids", "--enable-log-requests", model=None)
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/llm/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


# ---- parsing, no server -----------------------------------------------------------------------
def test_sizes_and_aliases_parse_as_on_vllm(tmp_path):
    assert [human_readable_int(v) for v in ("4096", "32k", "32K", "1m", "1.5k")] == [
        4096, 32000, 32768, 1000000, 1500]
    args = parse_serve_args(["--model", "ladle-demo", "--max-model-len", "auto",
                             "--kv-cache-memory-bytes", "1GiB", "--num-gpu-blocks-override",
                             "64", "--disable-uvicorn-access-log", "--enable-log-requests"])
    assert (args.model, args.max_model_len, args.kv_cache_memory, args.num_kv_blocks) == (
        "ladle-demo", -1, "1GiB", 64)
    assert args.disable_access_log and args.enable_log_requests
    assert not parse_serve_args(["--disable-log-requests"]).enable_log_requests
    with pytest.raises(SystemExit):
        parse_serve_args(["--gpu-memory-utilization", "1.5"])
    with pytest.raises(SystemExit):
        parse_serve_args(["--not-a-vllm-flag"])
    config = tmp_path / "c.yaml"
    config.write_text("model: ladle-demo\nmax_model_len: 2k\nenable-prefix-caching: false\n"
                      "served-model-name: [a, b]\n")
    args = parse_serve_args(["--config", str(config), "--max-model-len", "1k"])
    assert (args.model, args.max_model_len, args.enable_prefix_caching,
            args.served_model_name) == ("ladle-demo", 1000, False, ["a", "b"])  # CLI wins
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse_serve_args(["--config", str(config)])


def test_generation_config_sources(tmp_path):
    model = ensure_demo_model()
    assert generation_defaults(model) == {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert generation_defaults(model, "vllm") == {}
    assert generation_defaults(model, "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert generation_defaults(model, "auto", {"temperature": 0.2})["temperature"] == 0.2
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.5}')
    assert generation_defaults(model, str(tmp_path)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="max_new_tokens"):
        generation_defaults(model, "vllm", {"max_new_tokens": 5})


def test_chat_template_content_format():
    from ladle.entrypoints.common import ServerState
    from ladle.entrypoints.serving_chat import resolve_content_format, template_messages
    from ladle.protocol.chat import ChatCompletionRequest

    loops = "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}"
    assert resolve_content_format("auto", loops + "{% endfor %}") == "openai"
    assert resolve_content_format("auto", "{{ messages[0].content }}") == "string"
    assert resolve_content_format("string", loops) == "string"
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    server = ServerState(engine=None, served_model_names=["m"])
    assert template_messages(server, request)[0]["content"] == "a\nb"
    server.chat_template_content_format = "openai"
    assert template_messages(server, request)[0]["content"] == [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


# ---- server A: the launch line ----------------------------------------------------------------
def test_the_vllm_launch_line_serves_behind_the_root_path(server, client):
    assert [m.id for m in client.models.list().data] == ["m"]
    reply = client.chat.completions.create(model="m", messages=MSG, max_tokens=5)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens == 5
    # A proxy that strips the prefix and one that forwards it both reach the routes, and
    # the API key is enforced either way.
    for path in ("/v1/models", "/llm/v1/models"):
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200
        assert httpx.get(server.url + path).status_code == 401
    log = server.log()
    assert "--trust-remote-code: accepted, no effect" in log
    assert "--enforce-eager: accepted, no effect" in log


def test_cors_preflight_gets_the_configured_headers(server):
    r = httpx.options(server.url + "/llm/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"]
    r = httpx.get(server.url + "/llm/v1/models", headers={**AUTH, "Origin": "https://x.example"})
    assert r.headers["access-control-allow-origin"] == "*"


def _prompt_text(server, **body) -> str:
    r = httpx.post(server.url + "/llm/tokenize", headers=AUTH,
                   json={"model": "m", "messages": MSG, **body})
    tokens = r.json()["tokens"]
    return httpx.post(server.url + "/llm/detokenize", headers=AUTH,
                      json={"model": "m", "tokens": tokens}).json()["prompt"]


def test_server_chat_template_and_default_kwargs(server, client):
    prompt = _prompt_text(server)
    assert prompt.startswith(MARK)  # --chat-template
    assert prompt.endswith("<think>\n\n</think>\n\n")  # --default-chat-template-kwargs
    thinking = _prompt_text(server, chat_template_kwargs={"enable_thinking": True})
    assert thinking.endswith("<|im_start|>assistant\n")  # the request's own kwargs win
    # reasoning_effort flips the template's thinking switch; "none" turns it off.
    on = client.chat.completions.create(model="m", messages=MSG, max_tokens=6, seed=3,
                                        reasoning_effort="high")
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content
    hidden = client.chat.completions.create(model="m", messages=MSG, max_tokens=6, seed=3,
                                            reasoning_effort="high",
                                            extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.reasoning_content is None
    off = client.chat.completions.create(model="m", messages=MSG, max_tokens=6, seed=3,
                                         reasoning_effort="none")
    assert off.choices[0].message.content and not off.choices[0].message.reasoning_content
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model="m", messages=MSG, reasoning_effort="extreme")


def test_generation_config_vllm_ignores_the_checkpoints_defaults(client):
    """The checkpoint says temperature 0.7, top_k 20, top_p 0.8; with --generation-config vllm
    a request that leaves them out samples like one that asks for ladle's defaults (1.0)."""
    def tokens(**kw):
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=8, seed=11,
                                           logprobs=True, **kw)
        return [t.token for t in r.choices[0].logprobs.content]

    plain = tokens()
    assert plain == tokens(temperature=1.0, top_p=1.0, extra_body={"top_k": -1})
    assert plain != tokens(temperature=0.7, top_p=0.8, extra_body={"top_k": 20})


LLAMA_CALL = (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", '
              r'"days": [1-7]\}\}')


def test_llama3_json_calls_stream_their_arguments(client):
    body = {"guided_regex": LLAMA_CALL, "chat_template_kwargs": {"enable_thinking": False}}
    kw = dict(model="m", messages=MSG, tools=TOOLS, max_tokens=60, seed=2, extra_body=body)
    whole = client.chat.completions.create(**kw)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["days"]
    pieces = [p for c in client.chat.completions.create(stream=True, **kw) if c.choices
              for p in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert sum(1 for p in pieces if p.function.arguments) >= 3  # several fragments
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_required_calls_cut_by_max_tokens_keep_the_complete_ones(client):
    """Issue 9 item 8: the calls complete before the cut are tool_calls, finish_reason length;
    the cut call is neither a call nor raw JSON in the content."""
    tokenizer = load_tokenizer(ensure_demo_model())
    kw = dict(model="m", messages=MSG, tools=TOOLS, tool_choice="required",
              extra_body={"chat_template_kwargs": {"enable_thinking": False},
                          "return_token_ids": True})
    for seed in range(40):  # a seed whose output holds two or more calls
        full = client.chat.completions.create(max_tokens=400, seed=seed, **kw)
        if len(full.choices[0].message.tool_calls) >= 2:
            break
    else:
        pytest.skip("no seed gave two calls")
    ids = full.choices[0].token_ids
    first_end = next(m for m in range(1, len(ids))
                     if re.search(r"\}\s*\}\s*,", tokenizer.decode(ids[:m])))
    cut = dict(max_tokens=first_end + 2, seed=seed, **kw)  # inside the second call
    for reply in (client.chat.completions.create(**cut), None):
        if reply is None:  # the same request streamed, reassembled
            chunks = list(client.chat.completions.create(stream=True, **cut))
            calls = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            got = [(p.function.name, p.function.arguments) for p in calls]
        else:
            message = reply.choices[0].message
            content, finish = message.content or "", reply.choices[0].finish_reason
            got = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        first = full.choices[0].message.tool_calls[0].function
        assert got == [(first.name, first.arguments)]
        assert finish == "length" and content == ""


# ---- server B: the same settings from --config ------------------------------------------------
def test_the_same_settings_from_a_config_file(template, tmp_path):
    config = tmp_path / "ladle.yaml"
    config.write_text(
        f"model: {ensure_demo_model()}\nserved-model-name: m\ngpu-memory-utilization: 0.5\n"
        f"max-model-len: 4k\ntrust-remote-code: true\nenforce-eager: true\n"
        f"disable-log-requests: true\nchat-template: {template}\n"
        "default-chat-template-kwargs: {enable_thinking: false}\ngeneration-config: vllm\n"
        "override-generation-config: {temperature: 0.2}\nallowed-origins: ['*']\n"
        "enable-auto-tool-choice: true\ntool-call-parser: llama3_json\nmax-num-seqs: 8\n"
        f"api-key: {API_KEY}\nresponse-role: narrator\nrevision: main\n")
    s = RemoteServer("--config", str(config), "--disable-log-stats", model=None)
    try:
        c = s.client(timeout=120)
        assert [m.id for m in c.models.list().data] == ["m"]
        r = httpx.post(s.url + "/v1/chat/completions", headers=AUTH, json={
            "model": "m", "messages": MSG, "max_tokens": 2})
        assert r.json()["choices"][0]["message"]["role"] == "narrator"  # --response-role
        assert "--revision: no effect: the model is a local directory" in s.log()

        def tokens(**kw):
            r = c.chat.completions.create(model="m", messages=MSG, max_tokens=8, seed=5,
                                          logprobs=True, **kw)
            return [t.token for t in r.choices[0].logprobs.content]

        # --override-generation-config: temperature 0.2 is the default now.
        assert tokens() == tokens(temperature=0.2)
        assert tokens() != tokens(temperature=1.0)
        r = httpx.options(s.url + "/v1/models", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
        assert r.headers["access-control-allow-origin"] == "*"
        assert "sampling defaults from --generation-config vllm: {'temperature': 0.2}" in s.log()
    finally:
        assert s.stop() == 0, s.log()


# ---- server C: TLS, special-token markers, a plugin parser, gpu-memory-utilization ------------
PLUGIN = '''
from ladle.parsers.tool import ToolParserManager
from ladle.parsers.tool.hermes import HermesToolParser


@ToolParserManager.register_module("my_calls")
class MyCalls(HermesToolParser):
    """The hermes format under a plugin's name."""
'''
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"days": [1-7]\}\}\n</tool_call>')


def _special_markers_checkpoint(root: Path) -> Path:
    """ladle-demo whose tokenizer marks <tool_call>, </tool_call>, <think>, </think> special."""
    path = root / "special-markers"
    shutil.copytree(ensure_demo_model(), path)
    markers = {"<tool_call>", "</tool_call>", "<think>", "</think>"}
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    for entry in cfg["added_tokens_decoder"].values():
        if entry["content"] in markers:
            entry["special"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = json.loads((path / "tokenizer.json").read_text())
    for entry in tok["added_tokens"]:
        if entry["content"] in markers:
            entry["special"] = True
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tokenizer = load_tokenizer(path)
    ids = tokenizer.convert_tokens_to_ids(sorted(markers))
    assert tokenizer.decode(ids, skip_special_tokens=True) == ""  # skipping would lose them
    return path


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _certificates(root: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a certificate for 127.0.0.1 signed by it."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=ladle test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=127.0.0.1")
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext")
    return root / "ca.pem", root / "server.key", root / "server.pem"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command "
                    "(scripts/test.sh installs it)")
def test_tls_special_markers_plugin_and_memory_fraction(tmp_path):
    model = _special_markers_checkpoint(tmp_path)
    ca, key, cert = _certificates(tmp_path)
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(PLUGIN)
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                 if line.startswith("MemTotal:"))
    with safe_open(model / "model.safetensors", "pt") as f:  # float32 below: 4 bytes each
        weights = 4 * sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    fraction = (weights + 24 * 2**20) / total  # about 24 MiB left for the KV cache
    context = ssl.create_default_context(cafile=str(ca))
    s = RemoteServer(
        "--model", str(model), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--tool-parser-plugin", str(plugin), "--tool-call-parser", "my_calls",
        "--enable-auto-tool-choice", "--reasoning-parser", "qwen3", "--dtype", "float32",
        "--max-model-len", "1024", "--gpu-memory-utilization", f"{fraction:.8f}",
        "--api-key", API_KEY, model=None, scheme="https", verify=context)
    try:
        with pytest.raises(httpx.RemoteProtocolError):  # plain http is not served
            httpx.get(s.url.replace("https", "http") + "/health", timeout=30)
        with pytest.raises(httpx.ConnectError):  # nor https to a client without the CA
            httpx.get(s.url + "/health", timeout=30)
        http = httpx.Client(verify=context)  # closed below: shutdown waits for open connections
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                          http_client=http)
        # Reasoning (forced to end by the budget), then a call the plugin parser reads; the
        # markers are special tokens of this tokenizer and still reach the parsers.
        reply = c.chat.completions.create(
            model=str(model), messages=MSG, tools=TOOLS, max_tokens=120, seed=4,
            extra_body={"chat_template_kwargs": {"enable_thinking": True},
                        "thinking_token_budget": 6, "guided_regex": HERMES_CALL})
        message = reply.choices[0].message
        assert message.reasoning_content and reply.choices[0].finish_reason == "tool_calls"
        assert [t.function.name for t in message.tool_calls] == ["get_weather"]
        assert "<tool_call>" not in (message.content or "")
        assert "keep special tokens" in s.log()
        # --gpu-memory-utilization: the KV cache got the fraction less the weights.
        m = re.search(r"KV cache: (\d+) blocks of 16 tokens \(([\d.]+) MiB\)", s.log())
        num_blocks, mib = int(m.group(1)), float(m.group(2))
        per_block = mib * 2**20 / num_blocks
        expected = (fraction * total - weights) / per_block
        assert abs(num_blocks - expected) <= 0.1 * expected + 2, (num_blocks, expected)
        http.close()
    finally:
        assert s.stop() == 0, s.log()


def test_response_flags_apply_to_chat_and_completions(server, client):
    """--enable-force-include-usage, --return-tokens-as-token-ids, --enable-log-requests."""
    for create in (lambda **kw: client.chat.completions.create(messages=MSG, **kw),
                   lambda **kw: client.completions.create(prompt="Hello", **kw)):
        chunks = list(create(model="m", max_tokens=3, stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    reply = client.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True)
    assert all(re.fullmatch(r"token_id:\d+", t.token) for t in reply.choices[0].logprobs.content)
    reply = client.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True,
                                           extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.token.startswith("token_id:") for t in reply.choices[0].logprobs.content)
    assert re.search(r"chatcmpl-\S+: \d+ prompt tokens", server.log())
