"""Prefill/decode disaggregation: KV connectors, shaped like vLLM's KVConnectorBase_V1.

The flow (vLLM's disaggregated-serving proxy; ladle's is `ladle proxy`):
1. The prefill server (P, kv_role "kv_producer" or "kv_both") gets the request with
   `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`. It computes the
   prompt, samples a token (which the proxy drops), and when the request finishes the connector
   takes the prompt's KV out of its blocks (`request_finished`); the response carries
   `kv_transfer_params` for the decode side.
2. The decode server (D, "kv_consumer" or "kv_both") gets the original request plus those
   params. When the scheduler admits it, after its own prefix-cache lookup, the connector says
   how many more prompt tokens it can supply (`get_num_new_matched_tokens`): every prompt token
   but the last, minus what D's cache already holds, so only the missing blocks move. Their
   blocks are allocated, the connector is told where (`update_state_after_alloc`), and the
   tokens count as computed. Before the step's forward the worker side writes them into the
   cache (`start_load_kv`; `wait_for_layer_load` is where a layer-wise transport would wait).
   D then computes the last prompt token itself and samples the first output token: every
   per-request sampling state (penalties, seeded noise position, grammar, min_tokens,
   max_tokens) starts on D exactly as on a single server, and P's sampled token is never used.

Connectors here:
- `SharedStorageConnector` (vLLM's first example connector of that name): P writes each
  finished request's prompt KV to one safetensors file in a directory both servers see
  (`kv_connector_extra_config.shared_storage_path`), with the prompt's token ids; D reads the
  positions it lacks and deletes the file. P's blocks are freed at finish as for any request
  (the file holds the copy); a file that no D reads within `timeout_s` (default 120) is
  deleted by P, and an aborted request writes none. One host, or hosts sharing a file system.

Requests that cannot take external KV compute their prompt as usual (a hybrid model's state,
prompt logprobs, which need every prompt position's logits, a file whose tokens differ from
the prompt, a missing file after its timeout).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("SharedStorageConnector",)
# What a request's kv_transfer_params may hold (the API refuses anything else, naming it).
_PARAM_TYPES = {"do_remote_decode": bool, "do_remote_prefill": bool, "transfer_id": str,
                "remote_engine_id": str, "num_tokens": int}
_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_ENGINE_ID_CHARS = 64


def check_kv_transfer_params(params: Any) -> dict | None:
    """A request's kv_transfer_params, checked: a dict of the known keys with values of their
    type (transfer_id: 32 hex digits, as P makes it). ValueError names the key at fault."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params: must be an object (as a prefill server's "
                         "response gives it)")
    for key, value in params.items():
        kind = _PARAM_TYPES.get(key)
        if kind is None:
            raise ValueError(f"kv_transfer_params.{key}: unknown; accepted: "
                             + ", ".join(_PARAM_TYPES))
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"kv_transfer_params.{key}: must be a {kind.__name__}")
    if "transfer_id" in params and not _ID.match(params["transfer_id"]):
        raise ValueError("kv_transfer_params.transfer_id: must be 32 lowercase hex digits")
    if len(params.get("remote_engine_id", "")) > MAX_ENGINE_ID_CHARS:
        raise ValueError(f"kv_transfer_params.remote_engine_id: at most {MAX_ENGINE_ID_CHARS} "
                         "characters")
    if params.get("num_tokens", 0) < 0:
        raise ValueError("kv_transfer_params.num_tokens: must be >= 0")
    return dict(params)


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config JSON: kv_connector, kv_role, kv_connector_extra_config."""

    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str = ""

    @classmethod
    def from_value(cls, value) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config: not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config: must be a JSON object with kv_connector and "
                             "kv_role")
        unknown = set(value) - {"kv_connector", "kv_role", "kv_connector_extra_config",
                                "engine_id"}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {sorted(unknown)}; accepted: "
                             "kv_connector, kv_role, kv_connector_extra_config, engine_id")
        if value.get("kv_connector") not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector: {value.get('kv_connector')!r}; "
                             "accepted: " + ", ".join(CONNECTORS))
        if value.get("kv_role") not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role: {value.get('kv_role')!r}; accepted: "
                             + ", ".join(KV_ROLES))
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config: must be an object")
        config = cls(value["kv_connector"], value["kv_role"], dict(extra),
                     str(value.get("engine_id") or uuid.uuid4().hex[:16]))
        if len(config.engine_id) > MAX_ENGINE_ID_CHARS:
            raise ValueError(f"kv_transfer_config.engine_id: at most {MAX_ENGINE_ID_CHARS} "
                             "characters")
        if config.kv_connector == "SharedStorageConnector":
            SharedStorageConnector.check_extra(extra)
        return config

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass(slots=True)
class _Load:
    """A pending load: the request's prompt positions [start, end) into its blocks."""

    req_id: str
    path: Path
    blocks: list[int]
    start: int
    end: int


class KVConnector:
    """The interface (vLLM's KVConnectorBase_V1, in one process: ladle's scheduler and model
    runner share the engine process). Scheduler side: get_num_new_matched_tokens,
    update_state_after_alloc, request_finished. Worker side: register_kv_caches,
    start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save, get_finished."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self.kv_caches: list | None = None
        # Counters for /metrics: prompt tokens loaded from and saved for the other side.
        self.num_loaded_tokens = 0
        self.num_saved_tokens = 0
        self.num_expired = 0

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request, blocks: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        pass

    def request_finished(self, request, blocks: list[int]) -> tuple[bool, dict | None]:
        """(whether the blocks must stay held until a transfer ends, the kv_transfer_params for
        the response)."""
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self) -> dict[str, str]:
        return {}

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose sending / receiving ended since the last call (for delayed frees)."""
        return set(), set()

    def stats(self) -> dict:
        return {"kv_loaded_tokens": self.num_loaded_tokens,
                "kv_saved_tokens": self.num_saved_tokens,
                "kv_transfers_expired": self.num_expired}


class SharedStorageConnector(KVConnector):
    """KV through files in a shared directory (see the module docstring)."""

    @staticmethod
    def check_extra(extra: dict) -> None:
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path: "
                             "required for SharedStorageConnector (a directory both servers "
                             "can read and write)")
        timeout = extra.get("timeout_s", 120)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
                not 0 < timeout < float("inf"):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.timeout_s: must be a "
                             f"positive number of seconds, got {timeout!r}")
        unknown = set(extra) - {"shared_storage_path", "timeout_s"}
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) "
                             f"{sorted(unknown)}; accepted: shared_storage_path, timeout_s")

    def __init__(self, config: KVTransferConfig, block_size: int):
        super().__init__(config, block_size)
        extra = config.kv_connector_extra_config
        self.dir = Path(extra["shared_storage_path"])
        self.timeout_s = float(extra.get("timeout_s", 120))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_transfer_config: shared_storage_path {self.dir}: cannot be "
                             f"created ({e.strerror})") from None
        self._pending: dict[str, _Load] = {}
        self._matched: dict[str, Path] = {}

    def _file(self, transfer_id: str) -> Path:
        return self.dir / f"{transfer_id}.safetensors"

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill") \
                or "transfer_id" not in params:
            return 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt position's logits are needed: D computes the prompt
        from safetensors import safe_open

        path = self._file(params["transfer_id"])
        # Every prompt token but the last: D computes that one, and samples from it.
        end = request.num_prompt_tokens - 1
        try:
            with safe_open(path, framework="pt") as f:
                stored = f.get_tensor("token_ids")[:end].tolist()
        except Exception as e:  # missing (expired, never written) or unreadable
            logger.warning("request %s: KV file %s cannot be read (%s); computing its prompt "
                           "here", request.req_id, path, e)
            return 0
        if stored != request.prompt_token_ids[:end]:
            logger.warning("request %s: KV file %s holds another prompt's KV; computing this "
                           "one here", request.req_id, path)
            return 0
        if end <= num_computed_tokens:
            self._drop(path)
            return 0
        self._matched[request.req_id] = path
        return end - num_computed_tokens

    def update_state_after_alloc(self, request, blocks: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        path = self._matched.pop(request.req_id, None)
        if path is None or num_external_tokens == 0:
            return
        self._pending[request.req_id] = _Load(request.req_id, path, list(blocks),
                                              num_computed_tokens,
                                              num_computed_tokens + num_external_tokens)

    def request_finished(self, request, blocks: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        self._matched.pop(request.req_id, None)
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        from ladle.engine.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_STOPPED,
                                  RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None  # aborted or failed: nothing to hand over
        self._expire()
        transfer_id = uuid.uuid4().hex
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        self._save(self._file(transfer_id), request.prompt_token_ids[:n], blocks, n)
        self.num_saved_tokens += n
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "transfer_id": transfer_id, "remote_engine_id": self.config.engine_id,
                       "num_tokens": n}

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self) -> dict[str, str]:
        """Write every pending load into the cache before the step's forward (synchronously:
        a file read on one host has nothing to overlap with). Returns the requests whose load
        failed, with why: their tokens counted as computed are not, so they must fail."""
        from safetensors import safe_open

        pending, self._pending = self._pending, {}
        failed = {}
        for load in pending.values():
            try:
                with safe_open(load.path, framework="pt") as f:
                    for layer, cache in enumerate(self.kv_caches):
                        if cache is None or not isinstance(cache, tuple):
                            continue
                        k = f.get_slice(f"k.{layer}")[load.start:load.end]
                        v = f.get_slice(f"v.{layer}")[load.start:load.end]
                        self._write(cache, load.blocks, load.start, load.end, k, v)
            except Exception as e:
                failed[load.req_id] = (f"reading the prefill server's KV file {load.path} "
                                       f"failed ({type(e).__name__}: {e})")
                continue
            self.num_loaded_tokens += load.end - load.start
        for path in {load.path for load in pending.values()}:  # n > 1: one file, many loads
            self._drop(path)
        return failed

    # ---- internals ----------------------------------------------------------------------------
    def _positions(self, blocks: list[int], start: int, end: int):
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size

    def _write(self, cache, blocks, start, end, k, v) -> None:
        kc, vc = cache
        blk, off = self._positions(blocks, start, end)
        blk, off = blk.to(kc.device), off.to(kc.device)
        kc[blk, :, off, :] = k.to(kc.device, kc.dtype)
        vc[blk, :, off, :] = v.to(vc.device, vc.dtype)

    def _save(self, path: Path, token_ids: list[int], blocks: list[int], n: int) -> None:
        from safetensors.torch import save_file

        blk, off = self._positions(blocks, 0, n)
        tensors = {"token_ids": torch.tensor(token_ids, dtype=torch.long)}
        for layer, cache in enumerate(self.kv_caches):
            if cache is None or not isinstance(cache, tuple):
                continue
            kc, vc = cache
            tensors[f"k.{layer}"] = kc[blk.to(kc.device), :, off.to(kc.device), :].cpu()
            tensors[f"v.{layer}"] = vc[blk.to(vc.device), :, off.to(vc.device), :].cpu()
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)  # D never sees a half-written file

    def _drop(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def _expire(self) -> None:
        """Delete the files no decode server read within timeout_s."""
        cutoff = time.time() - self.timeout_s
        for path in self.dir.glob("*.safetensors"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    self.num_expired += 1
            except FileNotFoundError:
                pass


def make_connector(config: KVTransferConfig | None, block_size: int) -> KVConnector | None:
    if config is None:
        return None
    if config.kv_connector == "SharedStorageConnector":
        return SharedStorageConnector(config, block_size)
    raise ValueError(f"kv_transfer_config.kv_connector: {config.kv_connector!r}")
