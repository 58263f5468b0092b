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
- `NixlConnector` (below): D pulls the blocks straight out of P's cache memory with NIXL; P holds
  them until D's read notifies it (delayed free), or its timeout.
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
CONNECTORS = ("SharedStorageConnector", "NixlConnector")
# What a request's kv_transfer_params may hold (the API refuses anything else, naming it).
_PARAM_TYPES = {"do_remote_decode": bool, "do_remote_prefill": bool, "transfer_id": str,
                "remote_engine_id": str, "num_tokens": int, "remote_block_ids": list,
                "remote_host": str, "remote_port": int}
MAX_REMOTE_BLOCKS = 1 << 20
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
    blocks = params.get("remote_block_ids", [])
    if len(blocks) > MAX_REMOTE_BLOCKS or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**31 for b in blocks):
        raise ValueError(f"kv_transfer_params.remote_block_ids: at most {MAX_REMOTE_BLOCKS} "
                         "block ids, each an integer >= 0")
    if len(params.get("remote_host", "")) > 255:
        raise ValueError("kv_transfer_params.remote_host: at most 255 characters")
    if not 0 <= params.get("remote_port", 0) <= 65535:
        raise ValueError("kv_transfer_params.remote_port: must be in 0..65535")
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
        else:
            NixlConnector.check_extra(extra)
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

    def close(self) -> None:
        pass

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
        _check_timeout(extra)
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


def _check_timeout(extra: dict) -> None:
    timeout = extra.get("timeout_s", 120)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
            not 0 < timeout < float("inf"):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.timeout_s: must be a "
                         f"positive number of seconds, got {timeout!r}")


class NixlConnector(KVConnector):
    """KV pulled by the decode server straight out of the prefill server's cache memory with
    NIXL (its UCX backend: shared memory on one host, TCP or RDMA between hosts), as vLLM's
    NixlConnector does.

    P registers its cache tensors with a NIXL agent at start and answers a side channel (a ZMQ
    REP socket, `side_channel_host` / `side_channel_port` in kv_connector_extra_config; port 0:
    any) with its agent metadata and the layout of its blocks. A finished request's blocks stay
    held (`request_finished` returns delay_free) and its params name them (remote_block_ids,
    remote_host, remote_port, transfer_id). D, on first contact with a P, asks the side channel
    for that layout and checks it is its own (layers, block bytes, dtype); for each request it
    READs the blocks of the tokens it lacks into its own blocks (one descriptor per layer, K or
    V, and block) and notifies P with the transfer id, which frees them. P frees them too when
    no D has read them within timeout_s (default 120), and at once for an aborted request (it
    never holds them). Needs the `nixl` package (CUDA builds also run on CPU: `pip install
    --no-deps nixl-cu12`)."""

    @staticmethod
    def check_extra(extra: dict) -> None:
        _check_timeout(extra)
        unknown = set(extra) - {"side_channel_host", "side_channel_port", "timeout_s"}
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) "
                             f"{sorted(unknown)}; accepted: side_channel_host, "
                             "side_channel_port, timeout_s")
        port = extra.get("side_channel_port", 0)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.side_channel_port: "
                             f"must be in 0..65535 (0: any), got {port!r}")
        if _nixl_api() is None:
            raise ValueError("kv_transfer_config.kv_connector: NixlConnector needs NIXL's "
                             "Python package (pip install --no-deps nixl-cu12, or nixl); "
                             "or use SharedStorageConnector")

    def __init__(self, config: KVTransferConfig, block_size: int):
        super().__init__(config, block_size)
        extra = config.kv_connector_extra_config
        self.timeout_s = float(extra.get("timeout_s", 120))
        self.host = extra.get("side_channel_host", "127.0.0.1")
        self.port = int(extra.get("side_channel_port", 0))
        nixl_agent, nixl_agent_config = _nixl_api()
        self.agent = nixl_agent(f"ladle-{config.engine_id}",
                                nixl_agent_config(backends=["UCX"]))
        self._held: dict[str, tuple[str, float]] = {}  # transfer id -> (req_id, deadline)
        self._pending: dict[str, tuple] = {}  # req_id -> (params, local blocks, start, end)
        self._remotes: dict[str, dict] = {}  # engine id -> its layout and agent name
        self._layout: dict | None = None
        self._server = None

    def register_kv_caches(self, kv_caches: list) -> None:
        super().register_kv_caches(kv_caches)
        tensors = [t for cache in kv_caches if isinstance(cache, tuple) for t in cache]
        self.agent.register_memory(tensors)
        first = tensors[0]
        self._layout = {
            "agent": self.agent.get_agent_metadata(),
            "layers": [None if not isinstance(c, tuple) else [c[0].data_ptr(), c[1].data_ptr()]
                       for c in kv_caches],
            "block_bytes": first[0].numel() * first.element_size(),
            "num_blocks": first.shape[0], "dtype": str(first.dtype),
        }
        if self.config.is_producer:
            self._serve_side_channel()

    def _serve_side_channel(self) -> None:
        """A daemon thread answering every request on the REP socket with this engine's
        layout (read-only after start, so no lock)."""
        import threading

        import msgspec
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        if self.port:
            sock.bind(f"tcp://{self.host}:{self.port}")
        else:
            self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        reply = msgspec.msgpack.encode(self._layout)

        def serve():
            while True:
                try:
                    sock.recv()
                    sock.send(reply)
                except zmq.ZMQError:  # closed
                    return

        self._server = sock
        threading.Thread(target=serve, daemon=True, name="ladle-nixl-side-channel").start()
        logger.info("NixlConnector: prefill side channel on tcp://%s:%d", self.host, self.port)

    # ---- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill") \
                or not {"remote_block_ids", "remote_host", "remote_port", "transfer_id",
                        "remote_engine_id"} <= params.keys():
            return 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0
        end = request.num_prompt_tokens - 1
        if end <= num_computed_tokens or \
                len(params["remote_block_ids"]) * self.block_size < end or \
                params.get("num_tokens", 0) < end:
            return 0
        return end - num_computed_tokens

    def update_state_after_alloc(self, request, blocks: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        if num_external_tokens:
            self._pending[request.req_id] = (request.kv_transfer_params, list(blocks),
                                             num_computed_tokens,
                                             num_computed_tokens + num_external_tokens)

    def request_finished(self, request, blocks: list[int]) -> tuple[bool, dict | None]:
        from ladle.engine.request import RequestStatus

        params = request.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode") \
                or request.status not in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        transfer_id = uuid.uuid4().hex
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        self._held[transfer_id] = (request.req_id, time.monotonic() + self.timeout_s)
        self.num_saved_tokens += n
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "transfer_id": transfer_id, "remote_engine_id": self.config.engine_id,
                      "remote_block_ids": list(blocks[:-(-n // self.block_size)]),
                      "remote_host": self.host, "remote_port": self.port, "num_tokens": n}

    def get_finished(self) -> tuple[set[str], set[str]]:
        """The requests whose held blocks may go: read by a D (its notification), or unread
        past the timeout."""
        done = set()
        if self._held:
            for messages in self.agent.get_new_notifs().values():
                for m in messages:
                    entry = self._held.pop(m.decode(errors="replace"), None)
                    if entry is not None:
                        done.add(entry[0])
            now = time.monotonic()
            for transfer_id, (req_id, deadline) in list(self._held.items()):
                if deadline < now:
                    del self._held[transfer_id]
                    done.add(req_id)
                    self.num_expired += 1
        return done, set()

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self) -> dict[str, str]:
        pending, self._pending = self._pending, {}
        failed = {}
        for req_id, (params, blocks, start, end) in pending.items():
            try:
                self._read(params, blocks, start, end)
            except Exception as e:
                failed[req_id] = (f"pulling the prefill server's KV ({params['remote_host']}:"
                                  f"{params['remote_port']}) failed: {type(e).__name__}: {e}")
                continue
            self.num_loaded_tokens += end - start
        return failed

    def _remote(self, params: dict) -> dict:
        engine_id = params["remote_engine_id"]
        remote = self._remotes.get(engine_id)
        if remote is not None:
            return remote
        import msgspec
        import zmq

        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        try:
            sock.connect(f"tcp://{params['remote_host']}:{params['remote_port']}")
            sock.send(b"layout")
            remote = msgspec.msgpack.decode(sock.recv())
        except zmq.Again:
            raise RuntimeError("its side channel did not answer within 10 s") from None
        finally:
            sock.close()
        mine = self._layout
        if [x is None for x in remote["layers"]] != [x is None for x in mine["layers"]] or \
                remote["block_bytes"] != mine["block_bytes"] or remote["dtype"] != mine["dtype"]:
            raise RuntimeError(
                f"its KV layout ({len(remote['layers'])} layers, {remote['block_bytes']} bytes "
                f"per block, {remote['dtype']}) is not this server's ({len(mine['layers'])}, "
                f"{mine['block_bytes']}, {mine['dtype']}): the same model, dtype and "
                "--block-size are needed on both sides")
        remote["name"] = self.agent.add_remote_agent(remote["agent"])
        self._remotes[engine_id] = remote
        return remote

    def _read(self, params: dict, blocks: list[int], start: int, end: int) -> None:
        remote = self._remote(params)
        size = self._layout["block_bytes"]
        first, last = start // self.block_size, (end - 1) // self.block_size
        theirs = params["remote_block_ids"]
        if any(b >= remote["num_blocks"] for b in theirs[first:last + 1]):
            raise RuntimeError("remote_block_ids name blocks the prefill server does not have")
        local, far = [], []
        for mine, other in zip(self._layout["layers"], remote["layers"], strict=True):
            if mine is None:
                continue
            for my_base, other_base in zip(mine, other, strict=True):  # K, then V
                for i in range(first, last + 1):
                    local.append((my_base + blocks[i] * size, size, 0))
                    far.append((other_base + theirs[i] * size, size, 0))
        handle = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(far, "DRAM"), remote["name"],
            params["transfer_id"].encode())
        try:
            self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the read did not finish within {self.timeout_s:g} s")
            if state != "DONE":
                raise RuntimeError(f"the read ended in state {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def _nixl_api():
    """(nixl_agent, nixl_agent_config) from whichever NIXL package is installed; None."""
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    return None


def make_connector(config: KVTransferConfig | None, block_size: int) -> KVConnector | None:
    if config is None:
        return None
    if config.kv_connector == "SharedStorageConnector":
        return SharedStorageConnector(config, block_size)
    return NixlConnector(config, block_size)
