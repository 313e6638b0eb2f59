"""Page accounting of the tiered KV cache: two page pools and per-sequence page tables.

Layout (one set of tensors per layer; page ids are shared by all layers and KV heads, so one page
table per sequence serves every layer). Formats are those of ``moec.runtime.kv_quant``.

  tier 1 (FP8 e4m3), pages of ``t1_page`` tokens:
    k, v        uint8   [P1, Hkv, t1_page, Dh]   e4m3 bytes
    k_scale,    float16 [P1, Hkv, t1_page]       one scale per token and head
    v_scale
    pos         int32   [P1, Hkv, t1_page]       the token's position in its sequence
    mass        float32 [P1, Hkv, t1_page]       accumulated attention probability
  tier 2 (2-bit codes, uniform grid), pages of ``t2_page`` tokens, always full:
    k, v        uint8   [P2, Hkv, t2_page, Dh/4] 4 codes a byte, channel 4j+i in bits 2i..2i+1
    k_mu, k_sig float16 [P2, Hkv, Dh]            keys: per channel over the page's tokens
    v_mu, v_sig float16 [P2, Hkv, t2_page]       values: per token
    pos         int32   [P2, Hkv, t2_page]
  page tables (host and device), per sequence slot s:
    t1_table[s, :ceil(t1_len[s] / t1_page)], t2_table[s, :t2_pages[s]]   int32 page ids

Within one sequence every (layer, KV head) holds the same number of tier-1 tokens and tier-2 pages,
since the budget rule depends only on the sequence length; which tokens they are differs per head.
Tier-1 tokens are kept compacted at the front of the sequence's tier-1 pages (a re-rank rewrites
them), so tier-1 token i of a sequence lives in page ``t1_table[s, i // t1_page]``, slot ``i % t1_page``.

This module does the accounting only (which pages belong to whom, how many tokens each tier holds,
what a re-rank must move); kernels move the data. Every request is checked before anything is
allocated, so a refused request (``CacheExhausted``) leaves the tables as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from ..compiler.errors import MoecError

if TYPE_CHECKING:
    import numpy as np


POOLS = ("t1_k", "t1_v", "t1_ks", "t1_vs", "t1_pos", "t1_mass",
         "t2_k", "t2_v", "t2_kmu", "t2_ksig", "t2_vmu", "t2_vsig", "t2_pos")


def pool_specs(num_layers, t1_pages, t2_pages, num_kv_heads: int, head_dim: int, t1_page: int, t2_page: int) -> dict:
    """``{name: (shape, dtype)}`` of the pool tensors, each with a leading layer axis, in ``POOLS`` order.

    (Sizes may be symbolic: the compiler builds its function signatures from the same table.)
    """
    L, P1, P2, H, D = num_layers, t1_pages, t2_pages, num_kv_heads, head_dim
    return {
        "t1_k": ((L, P1, H, t1_page, D), "uint8"), "t1_v": ((L, P1, H, t1_page, D), "uint8"),
        "t1_ks": ((L, P1, H, t1_page), "float16"), "t1_vs": ((L, P1, H, t1_page), "float16"),
        "t1_pos": ((L, P1, H, t1_page), "int32"), "t1_mass": ((L, P1, H, t1_page), "float32"),
        "t2_k": ((L, P2, H, t2_page, D // 4), "uint8"), "t2_v": ((L, P2, H, t2_page, D // 4), "uint8"),
        "t2_kmu": ((L, P2, H, D), "float16"), "t2_ksig": ((L, P2, H, D), "float16"),
        "t2_vmu": ((L, P2, H, t2_page), "float16"), "t2_vsig": ((L, P2, H, t2_page), "float16"),
        "t2_pos": ((L, P2, H, t2_page), "int32"),
    }


class CacheExhausted(MoecError):
    """A page pool has too few free pages for the request."""


class PagePool:
    """A fixed pool of page ids with an owner per allocated page."""

    def __init__(self, name: str, num_pages: int) -> None:
        self.name = name
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self.owner: dict[int, int] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, owner: int) -> list[int]:
        if n > len(self._free):
            raise CacheExhausted(f"{self.name} pool exhausted: {n} pages requested, {len(self._free)} of "
                                 f"{self.num_pages} free; release sequences or give the cache more pages")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.owner[p] = owner
        return pages

    def release(self, pages: list[int], owner: int) -> None:
        for p in pages:
            if self.owner.get(p) != owner:
                raise MoecError(f"{self.name} page {p} released by sequence {owner} but owned by {self.owner.get(p)}")
            del self.owner[p]
            self._free.append(p)


@dataclass
class SequencePages:
    length: int = 0  # tokens cached
    t1_len: int = 0  # tier-1 tokens
    t1_pages: list[int] = field(default_factory=list)
    t2_pages: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RerankPlan:
    """What one sequence's re-rank does: keep ``keep`` tier-1 tokens, demote ``demote`` tokens into
    the new tier-2 pages ``new_t2_pages`` and free the tier-1 pages ``freed_t1_pages``."""

    slot: int
    keep: int
    demote: int
    new_t2_pages: tuple[int, ...]
    freed_t1_pages: tuple[int, ...]


class TieredPageTables:
    """Page tables of the tiered cache for up to ``max_sequences`` sequences."""

    def __init__(self, t1_pages: int, t2_pages: int, t1_page: int = 16, t2_page: int = 128, max_sequences: int = 128,
                 tier1_fraction: float = 0.15, sink: int = 4, recent: int = 64) -> None:
        if not 0 <= tier1_fraction <= 1:
            raise MoecError("tier1_fraction must be in [0, 1]")
        self.t1 = PagePool("tier-1 (FP8)", t1_pages)
        self.t2 = PagePool("tier-2 (2-bit)", t2_pages)
        self.t1_page, self.t2_page = t1_page, t2_page
        self.max_sequences = max_sequences
        self.tier1_fraction, self.sink, self.recent = tier1_fraction, sink, recent
        self.seqs: dict[int, SequencePages] = {}
        self._free_slots = list(range(max_sequences - 1, -1, -1))
        # per slot: (t1 pages, t2 pages) as int32 arrays, rebuilt only after a page is added or a re-rank
        # moves pages, so a decode step does no host work proportional to the context length
        self._arrays: dict[int, tuple] = {}
        # the dense tables of the last ``tables()`` call, and the slots whose pages changed since: a decode step
        # of the same sequences rewrites only those rows
        self._dense: tuple | None = None
        self._dirty: set[int] = set()

    # ---------------------------------------------------------------- sequences
    def add_sequence(self) -> int:
        if not self._free_slots:
            raise CacheExhausted(f"the cache holds at most {self.max_sequences} sequences; release one first")
        slot = self._free_slots.pop()
        self.seqs[slot] = SequencePages()
        return slot

    def remove_sequence(self, slot: int) -> None:
        seq = self._get(slot)
        self.t1.release(seq.t1_pages, slot)
        self.t2.release(seq.t2_pages, slot)
        del self.seqs[slot]
        self._invalidate(slot)
        self._free_slots.append(slot)

    def _get(self, slot: int) -> SequencePages:
        if slot not in self.seqs:
            raise MoecError(f"unknown sequence slot {slot}")
        return self.seqs[slot]

    # ---------------------------------------------------------------- appends
    def append(self, counts: dict[int, int]) -> dict[int, list[int]]:
        """Reserve tier-1 room for ``counts[slot]`` new tokens per sequence (all or nothing).

        Returns the tier-1 pages newly added to each sequence's table.
        """
        need = {}
        for slot, n in counts.items():
            seq = self._get(slot)
            need[slot] = math.ceil((seq.t1_len + n) / self.t1_page) - len(seq.t1_pages)
        total = sum(need.values())
        if total > self.t1.free:
            raise CacheExhausted(f"{self.t1.name} pool exhausted: appending {sum(counts.values())} tokens needs {total} "
                                 f"pages, {self.t1.free} free; release sequences or give the cache more tier-1 pages")
        added = {}
        for slot, n in counts.items():
            seq = self.seqs[slot]
            added[slot] = self.t1.alloc(need[slot], slot) if need[slot] else []
            if added[slot]:
                seq.t1_pages += added[slot]
                self._invalidate(slot)
            seq.t1_len += n
            seq.length += n
        return added

    # ---------------------------------------------------------------- re-rank
    def protected(self, length: int) -> int:
        """Tokens always in tier 1: the attention sinks and the recent window."""
        return min(length, self.sink + self.recent)

    def budget(self, length: int) -> int:
        return max(int(math.floor(self.tier1_fraction * length)), self.protected(length))

    def plan_rerank(self, slot: int) -> RerankPlan:
        """Decide (and apply to the tables) how many tokens of ``slot`` move to tier 2.

        Demotion is in whole tier-2 pages; the tier-1 pages left empty after compaction are freed.
        The re-rank kernel must run with the tables as they were before this call (``tables()``
        first) and the plan's ``new_t2_pages``; the freed pages are reused only by later work.
        """
        seq = self._get(slot)
        excess = seq.t1_len - self.budget(seq.length)
        pages = max(0, excess) // self.t2_page
        if pages == 0:
            return RerankPlan(slot, seq.t1_len, 0, (), ())
        new = self.t2.alloc(pages, slot)
        demote = pages * self.t2_page
        keep = seq.t1_len - demote
        still = math.ceil(keep / self.t1_page)
        freed = seq.t1_pages[still:]
        self.t1.release(freed, slot)
        seq.t1_pages = seq.t1_pages[:still]
        seq.t2_pages += new
        self._invalidate(slot)
        seq.t1_len = keep
        return RerankPlan(slot, keep, demote, tuple(new), tuple(freed))

    # ---------------------------------------------------------------- kernel arguments
    def append_slots(self, slot: int, n: int) -> "np.ndarray":
        """Global tier-1 slot ids (``page * t1_page + slot``) of the last ``n`` tier-1 tokens of ``slot``."""
        import numpy as np

        seq = self._get(slot)
        idx = np.arange(seq.t1_len - n, seq.t1_len)
        pages = self.page_arrays(slot)[0]
        return (pages[idx // self.t1_page] * self.t1_page + idx % self.t1_page).astype(np.int32)

    def last_slots(self, t1_table: "np.ndarray", t1_len: "np.ndarray") -> "np.ndarray":
        """Global tier-1 slot ids of each row's last tier-1 token, from ``tables()``' t1_table and t1_len: what
        ``append_slots(slot, 1)`` gives per sequence, for a whole decode step at once."""
        import numpy as np

        last = t1_len.astype(np.int64) - 1
        return (t1_table[np.arange(len(last)), last // self.t1_page] * self.t1_page + last % self.t1_page).astype(np.int32)

    def page_arrays(self, slot: int) -> tuple["np.ndarray", "np.ndarray"]:
        """The tier-1 and tier-2 page ids of ``slot`` as int32 arrays (cached; do not modify them)."""
        import numpy as np

        a = self._arrays.get(slot)
        if a is None:
            seq = self._get(slot)
            a = self._arrays[slot] = (np.asarray(seq.t1_pages, np.int32), np.asarray(seq.t2_pages, np.int32))
        return a

    def _invalidate(self, slot: int) -> None:
        self._arrays.pop(slot, None)
        self._dirty.add(slot)

    def tables(self, slots: list[int]) -> dict[str, "np.ndarray"]:
        """Dense page tables of ``slots`` for the kernels: t1_table/t2_table (padded with page 0),
        t1_len, t2_np (tier-2 pages) and length (fresh arrays the caller may keep or modify).

        The tables of the previous call are kept: for the same sequences in the same order and table widths,
        only the rows of sequences whose pages changed since are rewritten (a decode step adds a page to a
        sequence once every ``t1_page`` tokens)."""
        import numpy as np

        seqs = [self._get(s) for s in slots]
        m1 = max([len(q.t1_pages) for q in seqs] + [1])
        m2 = max([len(q.t2_pages) for q in seqs] + [1])
        key = tuple(slots)
        if self._dense is not None and self._dense[0] == key and self._dense[1].shape[1] == m1 \
                and self._dense[2].shape[1] == m2:
            _, t1, t2 = self._dense
            rows = [(i, s) for i, s in enumerate(slots) if s in self._dirty]
        else:
            t1 = np.zeros((len(seqs), m1), np.int32)
            t2 = np.zeros((len(seqs), m2), np.int32)
            self._dense = (key, t1, t2)
            rows = list(enumerate(slots))
        for i, s in rows:
            a1, a2 = self.page_arrays(s)
            t1[i, : len(a1)] = a1
            t1[i, len(a1):] = 0
            t2[i, : len(a2)] = a2
            t2[i, len(a2):] = 0
        self._dirty.difference_update(slots)
        return {"t1_table": t1.copy(), "t1_len": np.array([q.t1_len for q in seqs], np.int32), "t2_table": t2.copy(),
                "t2_np": np.array([len(q.t2_pages) for q in seqs], np.int32),
                "length": np.array([q.length for q in seqs], np.int32)}

    # ---------------------------------------------------------------- checks
    def check(self) -> None:
        """Raise if a page is owned twice, leaked, or a table disagrees with its counts."""
        seen: dict[int, int] = {}
        seen2: dict[int, int] = {}
        for slot, seq in self.seqs.items():
            for pool, pages, table in ((self.t1, seq.t1_pages, seen), (self.t2, seq.t2_pages, seen2)):
                for p in pages:
                    if p in table or pool.owner.get(p) != slot:
                        raise MoecError(f"{pool.name} page {p} is owned twice or by the wrong sequence")
                    table[p] = slot
            if len(seq.t1_pages) != math.ceil(seq.t1_len / self.t1_page):
                raise MoecError(f"sequence {slot}: {len(seq.t1_pages)} tier-1 pages for {seq.t1_len} tokens")
            if seq.t1_len + len(seq.t2_pages) * self.t2_page != seq.length:
                raise MoecError(f"sequence {slot}: tiers hold {seq.t1_len} + {len(seq.t2_pages)} pages, length {seq.length}")
            if slot in self._arrays and (self._arrays[slot][0].tolist() != seq.t1_pages
                                         or self._arrays[slot][1].tolist() != seq.t2_pages):
                raise MoecError(f"sequence {slot}: cached page arrays disagree with its page tables")
        for pool, table in ((self.t1, seen), (self.t2, seen2)):
            if len(table) + pool.free != pool.num_pages or set(table) != set(pool.owner):
                raise MoecError(f"{pool.name}: {len(table)} owned + {pool.free} free != {pool.num_pages} pages")
