"""openai-harmony, the reference for ladle's harmony rendering and parsing, run here without its
o200k vocabulary (which it downloads, and nothing can be downloaded here).

The text openai-harmony renders does not depend on the vocabulary: it encodes each piece of text
and decodes the tokens back, and the special tokens have fixed ids. So a stand-in vocabulary
does: all 256 bytes (every text round-trips), then filler tokens up to rank 199997 (the special
tokens keep their ids). openai-harmony checks the vocabulary file's SHA-256 against the one
compiled into its binary, so `build_reference` copies the installed package and writes the
stand-in's hash over that one in the copy's binary. The copy runs in a subprocess (this file, run
as a script) so it never meets the real package in one interpreter.

    ref = build_reference(tmp_dir)          # None: openai-harmony missing or not patchable
    out = run_reference(ref, {"render": [[message dict, ...], ...], "parse": [text, ...]})
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

O200K_SHA256 = b"446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_ORDINARY_TOKENS = 199998  # o200k_harmony's specials start at <|startoftext|> = 199998


def build_reference(out_dir: Path) -> Path | None:
    spec = importlib.util.find_spec("openai_harmony")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    binaries = list(package.glob("openai_harmony*.so"))
    if len(binaries) != 1 or binaries[0].read_bytes().count(O200K_SHA256) != 1:
        return None
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines += [f"{base64.b64encode(f'~filler{r}'.encode()).decode()} {r}"
              for r in range(256, NUM_ORDINARY_TOKENS)]
    vocab = ("\n".join(lines) + "\n").encode()
    (out_dir / "o200k_base.tiktoken").write_bytes(vocab)
    copy = out_dir / "openai_harmony"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    binary = copy / binaries[0].name
    digest = hashlib.sha256(vocab).hexdigest().encode()
    binary.write_bytes(binary.read_bytes().replace(O200K_SHA256, digest))
    return out_dir


def run_reference(ref: Path, job: dict) -> dict:
    env = {**os.environ, "TIKTOKEN_ENCODINGS_BASE": str(ref), "PYTHONPATH": str(ref)}
    done = subprocess.run([sys.executable, __file__, str(ref)], input=json.dumps(job),
                          capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"openai-harmony reference failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def _main() -> None:
    sys.path.insert(0, sys.argv[1])
    import openai_harmony as h

    assert Path(h.__file__).parent == Path(sys.argv[1]) / "openai_harmony", h.__file__
    enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    job = json.load(sys.stdin)
    out: dict = {"render": [], "parse": []}
    for messages in job.get("render", []):
        conversation = h.Conversation.from_messages([h.Message.from_dict(m) for m in messages])
        ids = enc.render_conversation_for_completion(conversation, h.Role.ASSISTANT)
        out["render"].append(enc.decode_utf8(ids))
    for text in job.get("parse", []):
        ids = enc.encode(text, allowed_special="all")
        parsed = enc.parse_messages_from_completion_tokens(ids, h.Role.ASSISTANT)
        out["parse"].append([m.to_dict() for m in parsed])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    _main()
