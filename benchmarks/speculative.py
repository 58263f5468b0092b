"""Speculative decoding on a random-weight checkpoint shaped like Qwen3-0.6B (bfloat16), single
stream, in one script:
  (a) the cost of one verification step with 1 + k tokens relative to a plain decode step,
      k = 0..8 (drafts that are always rejected, so every step verifies all k), and the
      per-draft acceptance rate at which that step cost breaks even;
  (b) an oracle drafter that proposes the true continuation (the upper bound; benchmark only):
      tokens/s with k = 4 against no speculation;
  (c) ngram prompt lookup on a prompt made of a repeated span: acceptance rate and tokens/s
      against no speculation (a random model rarely copies, so this shows the cost side);
  (d) a draft model, k = 4: the target itself as its draft (the upper bound of the mechanism:
      every draft accepted, at the cost of a second target) greedy and at temperature 1, and a
      small random Qwen3 with the target's vocabulary (the cost side: with random weights it
      agrees with the target about never), with the acceptance rate such a draft would need.

    python benchmarks/speculative.py [--steps 12] [--max-k 8] [--tokens 48] [--parts abcd]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import QWEN3_06B, qwen3_06b_checkpoint  # noqa: E402

from ladle.config import EngineConfig  # noqa: E402
from ladle.engine.core import EngineCore  # noqa: E402
from ladle.messages import EngineCoreRequest  # noqa: E402
from ladle.sampling_params import SamplingParams  # noqa: E402
from ladle.spec_decode.config import SpeculativeConfig  # noqa: E402

PROMPT = list(range(1000, 1128))


class RejectedProposer:
    """k drafts that the target will not pick (token 0 repeated): pure verification cost."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, tokens, max_drafts):
        return [0] * min(self.k, max_drafts)


class OracleProposer:
    """Proposes the known greedy continuation of PROMPT."""

    def __init__(self, k: int, continuation: list[int]):
        self.k, self.continuation = k, continuation

    def propose(self, tokens, max_drafts):
        done = len(tokens) - len(PROMPT)
        return self.continuation[done : done + min(self.k, max_drafts)]


def engine(path, k: int = 0, draft=None) -> EngineCore:
    spec = None if k == 0 else SpeculativeConfig(num_speculative_tokens=k)
    if draft is not None:
        spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=k)
    return EngineCore(EngineConfig(model=str(path), dtype="bfloat16", max_model_len=1024,
                                   max_num_seqs=1, kv_cache_memory="512MiB",
                                   speculative_config=spec))


def decode(eng: EngineCore, prompt: list[int], n: int, rid: str,
           temperature: float = 0.0) -> tuple[list[int], float, int]:
    """Tokens (greedy unless a temperature is given; seeded), seconds after the first token,
    and steps taken after it."""
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=n, ignore_eos=True)
    eng.add_request(EngineCoreRequest(rid, prompt, params, [], 0.0))
    toks = []
    while not toks:  # prefill
        for o in eng.step():
            toks += o.new_token_ids
    steps0, t = eng.num_steps, time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks += o.new_token_ids
    return toks, time.perf_counter() - t, eng.num_steps - steps0


def break_even(k: int, cost_ratio: float) -> float:
    """The per-draft acceptance rate a at which a step's expected tokens, (1 - a^(k+1)) / (1 - a)
    (drafts accepted while they agree, plus the one sampled token), pay for its cost."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        tokens = sum(a**i for i in range(k + 1))
        lo, hi = (a, hi) if tokens < cost_ratio else (lo, a)
    return hi


def small_draft_checkpoint() -> Path:
    """A small random Qwen3 with Qwen3-0.6B's vocabulary (4 layers of width 256; tied
    embeddings), built once next to the target."""
    path = qwen3_06b_checkpoint().parent / "qwen3-draft-4x256-random"
    if (path / "model.safetensors").exists():
        return path
    import torch
    import transformers as tf

    torch.manual_seed(1)
    cfg = tf.Qwen3Config(**QWEN3_06B | dict(hidden_size=256, intermediate_size=768,
                                            num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=64),
                         torch_dtype="bfloat16")
    tmp = path.with_suffix(".tmp")
    tf.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(path)
    return path


def part_d(path, tokens: int, repeats: int = 2) -> None:
    """Each engine is warmed up first; plain and speculative runs alternate and the fastest of
    `repeats` counts (the machine is shared)."""
    print(f"(d) draft model, k=4, {tokens} tokens, best of {repeats}")
    plain = engine(path)
    small = small_draft_checkpoint()
    for name, draft, temperature in (("draft = target, greedy", path, 0.0),
                                     ("draft = target, T=1", path, 1.0),
                                     ("small random draft, greedy", small, 0.0),
                                     ("small random draft, T=1", small, 1.0)):
        eng = engine(path, 4, draft)
        for e in (plain, eng):
            decode(e, PROMPT, 8, f"d-warm-{name}", temperature)
        before = {k: v for k, v in eng.stats().items() if k.startswith("spec_decode")}
        best_plain = best_spec = (float("inf"), 1)
        for i in range(repeats):
            ref, secs, steps = decode(plain, PROMPT, tokens, f"d-plain-{name}-{i}", temperature)
            best_plain = min(best_plain, (secs, steps))
            got, secs, steps = decode(eng, PROMPT, tokens, f"d-{name}-{i}", temperature)
            best_spec = min(best_spec, (secs, steps))
            if temperature == 0:
                assert got == ref, "greedy output with a draft model differs from plain decoding"
        stats = eng.stats()
        drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = (stats["spec_decode_num_accepted_tokens"]
                    - before["spec_decode_num_accepted_tokens"])
        n = tokens - 1
        ratio = (best_spec[0] / best_spec[1]) / (best_plain[0] / best_plain[1])
        print(f"  {name}: acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.2f}; "
              f"plain {n / best_plain[0]:6.1f} tok/s, spec {n / best_spec[0]:6.1f} tok/s "
              f"({best_spec[1]} steps); ratio {best_plain[0] / best_spec[0]:4.2f}x; a step "
              f"costs {ratio:4.2f} plain steps: break-even acceptance {break_even(4, ratio):.2f}")
        del eng


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--parts", default="abcd", help="which parts to run, e.g. abc or d")
    args = ap.parse_args()
    path = qwen3_06b_checkpoint()
    if set("abc") & set(args.parts):
        parts_abc(path, args)
    if "d" in args.parts:
        part_d(path, args.tokens)


def parts_abc(path, args) -> None:
    eng = engine(path, 8)  # counters sized for up to 8 drafts; each part sets its proposer

    print("(a) verification step with 1 + k tokens vs a plain decode step")
    base = None
    for k in range(args.max_k + 1):
        eng.scheduler.proposer = RejectedProposer(k) if k else None
        _, secs, steps = decode(eng, PROMPT, args.steps + 1, f"a{k}")
        per_step = secs / steps
        base = base or per_step
        ratio = per_step / base
        print(f"  k={k}: {per_step * 1e3:7.1f} ms/step  ratio {ratio:5.2f}  break-even "
              f"acceptance {break_even(k, ratio):.2f}" if k else f"  k=0: {per_step * 1e3:7.1f} "
              "ms/step  ratio  1.00")

    print(f"(b) oracle drafts, k=4, {args.tokens} tokens")
    eng.scheduler.proposer = None
    ref, plain_secs, _ = decode(eng, PROMPT, args.tokens, "b-plain")
    eng.scheduler.proposer = OracleProposer(4, ref)
    got, spec_secs, steps = decode(eng, PROMPT, args.tokens, "b-oracle")
    assert got == ref, "oracle run differs from plain decoding"
    n = len(ref) - 1
    print(f"  plain {n / plain_secs:6.1f} tok/s; oracle k=4 {n / spec_secs:6.1f} tok/s "
          f"({steps} steps); ratio {plain_secs / spec_secs:4.2f}x")

    print(f"(c) ngram (k=4, lookup 1..3) on a repeated span, {args.tokens} tokens")
    span = list(range(2000, 2016))
    prompt = span * 8
    eng.scheduler.proposer = None
    ref, plain_secs, _ = decode(eng, prompt, args.tokens, "c-plain")
    from ladle.spec_decode.ngram import NgramProposer

    eng.scheduler.proposer = NgramProposer(1, 3, 4)
    before = dict(drafts=eng.num_draft_tokens, accepted=eng.num_accepted_tokens)
    got, spec_secs, _ = decode(eng, prompt, args.tokens, "c-ngram")
    assert got == ref, "ngram run differs from plain decoding"
    drafted = eng.num_draft_tokens - before["drafts"]
    accepted = eng.num_accepted_tokens - before["accepted"]
    n = len(ref) - 1
    print(f"  acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.2f}; plain "
          f"{n / plain_secs:6.1f} tok/s, ngram {n / spec_secs:6.1f} tok/s; ratio "
          f"{plain_secs / spec_secs:4.2f}x")


if __name__ == "__main__":
    main()
