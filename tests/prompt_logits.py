"""ladle's logits at every position of a prompt, as a test reads them: the hidden states of the
one prefill step, caught by a forward hook on the engine's model, through the model's own head."""

from __future__ import annotations

import torch

from ladle import LLM, SamplingParams


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """float32 (len(ids), vocab). The LLM must prefill len(ids) tokens in one step (its
    max_num_batched_tokens at least that) and must not hit the prefix cache for them."""
    model = llm.engine.runner.model
    caught = []
    hook = model.register_forward_hook(lambda _m, _args, out: caught.append(out))
    try:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1))
    finally:
        hook.remove()
    steps = [h for h in caught if h.shape[0] == len(ids)]
    assert steps, f"no step ran all {len(ids)} tokens: {[tuple(h.shape) for h in caught]}"
    with torch.inference_mode():
        return model.compute_logits(steps[0]).float().clone()


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over rows of KL(p || q), from logits."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def logit_agreement(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(relative logit error: the RMS difference over the reference's standard deviation, top-1
    agreement) of logits (positions, vocab) against a reference's; printed for the test log."""
    diff = ((got - want).norm() / want.std() / want.numel() ** 0.5).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"relative logit error {diff:.5f}, top-1 agreement {agree:.3f}")
    return diff, agree
