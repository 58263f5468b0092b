"""Drive the real InputBatch + Sampler with crafted logits, as the model runner does."""

from __future__ import annotations

import numpy as np
import torch

from ladle.engine.request import Request
from ladle.runner.input_batch import InputBatch
from ladle.sample.logits_processors.interface import ProcessorConfig
from ladle.sample.metadata import SamplingMetadata
from ladle.sample.sampler import Sampler
from ladle.sampling_params import SamplingParams

CPU = torch.device("cpu")


class Harness:
    def __init__(self, vocab: int, max_rows: int = 64, seed: int = 0, reasoning=None,
                 max_len: int = 256,
                 custom=()):
        self.vocab = vocab
        self.batch = InputBatch(max_rows, max_len, 16)
        gen = torch.Generator().manual_seed(seed)
        cfg = ProcessorConfig(vocab, CPU, max_rows)
        self.sampler = Sampler.build(vocab, CPU, max_rows, gen, reasoning,
                                     [cls(cfg) for cls in custom])
        self.requests: list[Request] = []

    def set_requests(self, specs: list[tuple[SamplingParams, list[int], list[int]]],
                     eos=(0,)) -> None:
        """specs: (params, prompt ids, output ids so far) per row."""
        self.requests = []
        for i, (params, prompt, output) in enumerate(specs):
            r = Request(f"r{i}-{id(self)}-{np.random.randint(1 << 30)}", prompt, params, list(eos))
            for t in output:
                r.append_output_token(t)
            self.requests.append(r)
        self._refresh()

    def _refresh(self):
        update = self.batch.update(self.requests)
        self.sampler.update_state(update)
        self.meta = SamplingMetadata.from_columns(self.batch.columns, self.batch.num_reqs, CPU)

    def step(self, logits: torch.Tensor, accept: bool = True):
        """Sample one token per row from `logits` (R, V); append it to the outputs."""
        R = len(self.requests)
        positions = torch.tensor([r.num_output_tokens for r in self.requests])
        self.sampler.update_state(None)
        out = self.sampler(logits.clone(), self.meta, positions)
        if accept:
            toks = out.sampled_token_ids
            for r, t in zip(self.requests, toks.tolist(), strict=True):
                r.append_output_token(t)
            rows = np.arange(R)
            self.batch.append_tokens(rows, toks.numpy())
            self.sampler.accept(torch.from_numpy(rows), toks)
        return out

    def processed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The full (R, V) logits each row samples from (all rows must ask for
        logprobs=vocab with logprobs_mode='processed_logits')."""
        out = self.step(logits, accept=False)
        lp = out.logprobs
        full = torch.full((len(self.requests), self.vocab), float("-inf"))
        full.scatter_(1, lp.token_ids, lp.values)
        return full
