"""Paged KV-cache bookkeeping: which blocks each request holds, and the prefix cache.

Blocks are fixed-size (block_size tokens). A full block is named by a hash chained over every
token before it (plus the request's cache_salt in the first block), so equal prefixes share
blocks. Blocks whose last owner finished stay cached in an LRU free queue until reused.

A hybrid model (linear-attention layers) also needs one state slot per running request: a
fixed pool of `num_state_slots`, handed out with a request's first blocks and returned with
them (finish or preemption), so a request that holds blocks always holds a slot.

A hybrid's prefix cache needs more than blocks: the linear layers' state after the cached
prefix. `num_snapshot_slots` more slots hold such snapshots, each the state after a full block,
named by that block's hash and evicted least recently used. A prompt chunk that crosses a block
boundary has its state after its last full block copied into one (plan_snapshot; the model
writes it during the chunk's forward), and a prefix hit is cut back to its longest run of blocks
whose last one has a snapshot, which the request's slot copies before its first step. The cost
is the snapshot slots' memory, fixed at start: num_snapshot_slots x the state of one sequence."""

from __future__ import annotations

from collections import OrderedDict

from ladle.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, num_snapshot_slots: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order (oldest first); cached ones are still findable by hash.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of a request already hashed
        self.num_state_slots = num_state_slots
        self.free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end
        self.req_slot: dict[str, int] = {}
        # Snapshot slots follow the requests' slots: num_state_slots .. + num_snapshot_slots - 1.
        self.num_snapshot_slots = num_snapshot_slots
        self.free_snapshot_slots = list(range(num_state_slots + num_snapshot_slots - 1,
                                              num_state_slots - 1, -1))
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.planned: dict[int, int] = {}  # slot -> block hash: written by the step being run
        # (snapshot slot, request slot) copies to make before the next step (prefix hits)
        self.restores: list[tuple[int, int]] = []
        # Prefix-cache statistics, in tokens of prompts looked up.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_blocks(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])

    def get_slot(self, req_id: str) -> int:
        """The request's state slot (hybrid models; it holds one while it holds blocks)."""
        return self.req_slot[req_id]

    # ---- prefix cache -----------------------------------------------------------------------
    def _hash_blocks(self, request: Request) -> None:
        """Extend request.block_hashes over every full block of its known tokens."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else hash(("ladle", request.cache_salt))
        for i in range(len(hashes), len(tokens) // bs):
            parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Blocks of the longest cached prefix, and how many tokens they cover. At least one
        token is always left to compute, because the last position must produce logits."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._hash_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in request.block_hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        if self.num_state_slots:  # a hybrid: only up to a block whose state was kept
            while blocks and request.block_hashes[len(blocks) - 1] not in self.snapshots:
                blocks.pop()
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for num_new_tokens more tokens after request.num_computed_tokens (with
        computed_blocks, the request's prefix-cache hit, on its first allocation). Returns False
        and changes nothing when there are not enough free blocks."""
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.req_id, [])
        num_computed = request.num_computed_tokens
        need = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(computed_blocks)
        # Touching a cached block that sits in the free queue takes it out of the queue.
        num_revived = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need + num_revived > len(self.free_queue):
            return False
        if self.num_state_slots and request.req_id not in self.req_slot:
            if not self.free_slots:
                return False
            self.req_slot[request.req_id] = self.free_slots.pop()
            if computed_blocks:  # the state after the hit: its last block's snapshot
                h = request.block_hashes[len(computed_blocks) - 1]
                self.snapshots.move_to_end(h)
                self.restores.append((self.snapshots[h], self.req_slot[request.req_id]))
        blocks = self.req_blocks.setdefault(request.req_id, [])
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            blocks.append(b)
        if computed_blocks:
            self.num_cached_blocks[request.req_id] = len(computed_blocks)
        for _ in range(max(need, 0)):
            blocks.append(self._pop_free())
        return True

    # ---- state snapshots (hybrid models) ----------------------------------------------------
    def plan_snapshot(self, request: Request, num_new: int) -> tuple[int, int] | None:
        """For a chunk of num_new >= 2 known tokens of a hybrid's request starting at its
        num_computed_tokens: (tokens into the chunk, snapshot slot) where the state after the
        chunk's last full block is to be written, or None (no boundary crossed, already kept,
        or no slot). The snapshot is findable once the step has run (publish_snapshot)."""
        if not (self.enable_prefix_caching and self.num_snapshot_slots) or num_new < 2:
            return None
        start = request.num_computed_tokens
        boundary = (start + num_new) // self.block_size * self.block_size
        if boundary <= start:
            return None
        self._hash_blocks(request)
        h = request.block_hashes[boundary // self.block_size - 1]
        if h in self.snapshots:
            self.snapshots.move_to_end(h)
            return None
        if h in self.planned.values():
            return None
        if self.free_snapshot_slots:
            slot = self.free_snapshot_slots.pop()
        elif self.snapshots:
            _, slot = self.snapshots.popitem(last=False)  # the least recently used
        else:
            return None  # every snapshot slot is being written this step
        self.planned[slot] = h
        return boundary - start, slot

    def publish_snapshot(self, slot: int) -> None:
        """The step that wrote a planned snapshot succeeded: prefix hits may restore it."""
        h = self.planned.pop(slot, None)
        if h is not None:
            self.snapshots[h] = slot

    def begin_step(self) -> None:
        """Snapshots planned for a step that failed were not written: their slots are free."""
        self.free_snapshot_slots.extend(self.planned)
        self.planned.clear()

    def take_restores(self) -> list[tuple[int, int]]:
        taken, self.restores = self.restores, []
        return taken

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` the KV of parent's computed tokens (a beam search fork): the full blocks
        are shared (reference-counted), the last partial block, which both will write past,
        gets a private copy for the child. Returns (source, copy) blocks for the model runner
        to copy, None when there is no partial block; raises MemoryError (nothing changed)
        when no block is free for the copy."""
        if self.num_state_slots:
            raise ValueError("a hybrid model's requests cannot fork (their state is not in "
                             "blocks)")
        blocks = self.req_blocks.get(parent.req_id, [])
        n = parent.num_computed_tokens
        full = n // self.block_size
        partial = n % self.block_size != 0
        if partial and not self.free_queue:
            raise MemoryError("no free KV block for a beam's copy")
        mine = self.req_blocks.setdefault(child.req_id, [])
        for b in blocks[:full]:
            self.ref_cnt[b] += 1
            mine.append(b)
        self.num_cached_blocks[child.req_id] = min(self.num_cached_blocks.get(parent.req_id, 0),
                                                   full)
        if not partial:
            return None
        b = self._pop_free()
        mine.append(b)
        return blocks[full], b

    def _pop_free(self) -> int:
        """The oldest free block, out of the prefix cache, held once."""
        b, _ = self.free_queue.popitem(last=False)
        if self.block_hash[b] is not None:  # evict from the prefix cache
            if self.cached.get(self.block_hash[b]) == b:
                del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
        self.ref_cnt[b] = 1
        return b

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that the first num_tokens tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        self._hash_blocks(request)
        blocks = self.req_blocks.get(request.req_id, [])
        start = self.num_cached_blocks.get(request.req_id, 0)
        end = min(num_tokens // self.block_size, len(blocks), len(request.block_hashes))
        for i in range(start, end):
            h = request.block_hashes[i]
            b = blocks[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
        self.num_cached_blocks[request.req_id] = max(start, end)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past the first num_tokens tokens (slots of rejected
        draft tokens). They were never published: only full blocks of known tokens are."""
        blocks = self.req_blocks.get(request.req_id)
        if not blocks:
            return
        keep = -(-num_tokens // self.block_size)
        while len(blocks) > keep:
            b = blocks.pop()
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def free(self, request: Request) -> None:
        """Release the request's blocks at once. Its tail blocks are queued for eviction before
        its head blocks, since a later request is likelier to share the head."""
        blocks = self.req_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        slot = self.req_slot.pop(request.req_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def reset_prefix_cache(self) -> None:
        for b in list(self.free_queue):
            self.block_hash[b] = None
        self.free_snapshot_slots.extend(self.snapshots.values())
        self.snapshots.clear()
        self.cached = {h: b for h, b in self.cached.items() if self.ref_cnt[b] > 0}
