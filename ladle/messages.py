"""What crosses the boundary between the API process and the engine-core process (msgspec
structs, msgpack on the wire). The offline LLM uses the same types in one process."""

from __future__ import annotations

import msgspec

from ladle.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # a dataclass: msgspec encodes it field by field
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # Beam search: the request ids its n best beams are reported under (default: req_id for
    # n = 1, else req_id-0 ... req_id-(n-1), the frontend's names for n choices).
    output_ids: list[str] | None = None
    # Prefill/decode disaggregation (distributed/kv_transfer.py), checked by
    # check_kv_transfer_params.
    kv_transfer_params: dict | None = None


class Logprobs(msgspec.Struct, array_like=True):
    """Per sampled token: the top-k (ids, values) in rank order, and the sampled token's value
    and rank (1 = most likely)."""

    token_ids: list[list[int]]  # (N, k)
    values: list[list[float]]  # (N, k)
    sampled_values: list[float]  # (N,)
    sampled_ranks: list[int]  # (N,)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None  # FinishReason value, None while running
    stop_reason: int | str | None = None  # the stop token id that ended it
    # The last new token is EOS or a stop_token_id that ended the request: its text is not
    # output (unless include_stop_str_in_output). False when a grammar or a length ended it.
    ended_by_stop_token: bool = False
    num_cached_tokens: int = 0
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    error: str | None = None  # why the request failed (FinishReason.ERROR)
    # The failure is the server's (a crash in the step, a grammar rejecting its own sampled
    # token), not the request's: the API answers 500, not 400.
    is_server_error: bool = False
    # A beam search's returned beam (all its tokens at once): the sum of its tokens'
    # log-probabilities and its length-penalised score.
    cumulative_logprob: float | None = None
    beam_score: float | None = None
    # A prefill server's handle on the finished request's KV, for the decode server.
    kv_transfer_params: dict | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: dict | None = None  # scheduler and cache gauges, sent with each step's outputs
