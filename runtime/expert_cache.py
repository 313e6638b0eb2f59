"""Residency of expert weights in a GPU expert cache, for models whose experts do not all fit.

The expert weights live in pinned host memory; ``capacity`` slots on the GPU each hold one expert
(one layer's gate/up and down matrices). ``ExpertCache`` decides what is resident; the copies it
asks for are the runtime's to make (on a copy stream, overlapping compute):

  ``prefetch(layer, experts)``  before ``layer`` runs (from a prediction): load what is missing, if a
                                slot can be freed; never evicts an expert of the layer being computed
                                (``pin``) or one already prefetched for the same layer.
  ``require(layer, experts)``   when ``layer``'s router has run: what is missing is loaded now (a stall:
                                the layer waits for those copies); returns the hits and misses.

Eviction (``policy``): "lru", least recently used, each use (a ``require`` hit or load) or prefetch
refreshing an expert; or "cycle" (with ``layers``), the expert whose layer comes furthest ahead in the
decode step's cycle of layers after the one being loaded for (least recently used among equals). A decode
step visits the layers in order, so the least recently used expert is, in general, of the layer that
comes next: LRU evicts what is about to be needed, the cycle policy what has just been used. Pinned
experts (the current layer's, while it computes) and those prefetched for the upcoming layer are never
evicted; a prefetch that cannot find a free slot is dropped (counted), a
``require`` that cannot is an error (the cache is smaller than one layer's routed experts).
``stats`` counts hits, stalls (misses at ``require``), prefetch copies and prefetched experts never
used, so on-demand loading (no prefetch) and prefetching can be compared on the same routing.
``eviction_reuse()`` estimates how often an evicted expert is loaded again within one cycle of the layers: the
price, in copies, of evicting a resident expert to make room for a prefetch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..compiler.errors import MoecError
from .cuda_driver import CudaDriver, launch_stream, stream_handle


@dataclass
class CacheStats:
    hits: int = 0
    stalls: int = 0  # experts copied while the layer waited
    prefetched: int = 0  # experts copied ahead of their layer
    prefetch_used: int = 0  # prefetched experts the layer then needed
    prefetch_dropped: int = 0  # prefetches given up for want of a free slot
    evictions: int = 0

    @property
    def copies(self) -> int:
        return self.stalls + self.prefetched

    def as_dict(self) -> dict:
        return {**self.__dict__, "copies": self.copies}


@dataclass
class ExpertCache:
    """LRU residency of ``capacity`` expert slots over ``(layer, expert)`` keys."""

    capacity: int
    resident: "OrderedDict[tuple[int, int], int]" = field(default_factory=OrderedDict)  # key -> slot, LRU first
    stats: CacheStats = field(default_factory=CacheStats)
    layers: int = 0  # the model's MoE layers ("cycle" needs them)
    policy: str = "lru"
    decay: float = 0.98  # of the eviction-reuse counts

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise MoecError(f"an expert cache needs at least one slot, got {self.capacity}")
        if self.policy not in ("lru", "cycle") or (self.policy == "cycle" and self.layers < 1):
            raise MoecError(f"expert cache policy {self.policy!r}: expected 'lru', or 'cycle' with the number of layers")
        self._at = 0  # the layer being loaded for (the cycle's origin)
        self._free = list(range(self.capacity - 1, -1, -1))
        self._pinned: set = set()
        self._pending: dict[tuple[int, int], bool] = {}  # prefetched, not yet required: key -> used
        self._tick = 0  # require calls so far
        self._ghost: "OrderedDict[tuple[int, int], int]" = OrderedDict()  # evicted key -> the tick of its eviction
        self._reused, self._evicted = 1.0, 2.0

    def __contains__(self, key) -> bool:
        return key in self.resident

    def slot(self, layer: int, expert: int) -> int:
        return self.resident[(layer, expert)]

    def _touch(self, key) -> None:
        self.resident.move_to_end(key)

    def _take_slot(self, protect: set) -> int | None:
        if self._free:
            return self._free.pop()
        victim, far = None, -1
        for key in self.resident:  # LRU first
            if key not in protect and key not in self._pinned and key not in self._pending:
                if self.policy == "lru":
                    victim = key
                    break
                ahead = (key[0] - self._at) % self.layers  # layers until this one comes round again
                if ahead > far:
                    victim, far = key, ahead
        if victim is None:
            return None
        self.stats.evictions += 1
        self._ghost[victim] = self._tick
        return self.resident.pop(victim)

    def _load(self, key, protect: set) -> int | None:
        slot = self._take_slot(protect)
        if slot is not None:
            self.resident[key] = slot
            if self._ghost.pop(key, None) is not None:  # evicted, and needed again within a cycle
                self._reuse(True)
        return slot

    def _reuse(self, reused: bool) -> None:
        self._reused = self._reused * self.decay + float(reused)
        self._evicted = self._evicted * self.decay + 1.0

    def _expire(self) -> None:
        horizon = self.layers or self.capacity
        while self._ghost:
            key, tick = next(iter(self._ghost.items()))
            if self._tick - tick <= horizon:
                break
            del self._ghost[key]
            self._reuse(False)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def eviction_reuse(self) -> float:
        """The estimated probability that an evicted expert is loaded again within one cycle of the layers (one
        decode step): what evicting a resident expert for a prefetch may cost, in copies. Counts decay by ``decay``
        an eviction, from a prior of one in two."""
        return self._reused / self._evicted

    def prefetch(self, layer: int, experts) -> list[tuple[int, int]]:
        """Start copies for ``layer``'s predicted experts that are not resident; returns ``[(expert, slot)]`` to copy."""
        want = {(layer, int(e)) for e in experts}
        self._at = layer
        copies = []
        for key in sorted(want):
            if key in self.resident:
                self._touch(key)
                continue
            slot = self._load(key, want)
            if slot is None:
                self.stats.prefetch_dropped += 1
                continue
            self._pending[key] = False
            self.stats.prefetched += 1
            copies.append((key[1], slot))
        return copies

    def require(self, layer: int, experts) -> tuple[list[int], list[tuple[int, int]]]:
        """``layer``'s routed experts: ``(hits, [(expert, slot)] copied now)``. The experts stay pinned until
        ``release(layer)``; prefetches for ``layer`` not among them count as unused."""
        need = {(layer, int(e)) for e in experts}
        self._at = layer
        self._tick += 1
        self._expire()
        hits, stalls = [], []
        for key in sorted(need):
            if key in self.resident:
                hits.append(key[1])
                self._touch(key)
                if key in self._pending:
                    self._pending[key] = True
                continue
            slot = self._load(key, need)
            if slot is None:
                raise MoecError(f"expert cache of {self.capacity} slots cannot hold layer {layer}'s {len(need)} routed experts")
            stalls.append((key[1], slot))
        self.stats.hits += len(hits)
        self.stats.stalls += len(stalls)
        self._pinned |= need
        for key in [k for k in self._pending if k[0] == layer]:
            self.stats.prefetch_used += int(self._pending.pop(key))
        return hits, stalls

    def release(self, layer: int) -> None:
        """``layer`` finished computing: its experts may be evicted again."""
        self._pinned = {k for k in self._pinned if k[0] != layer}

    def check(self) -> None:
        """Invariants: every slot is either free or holds exactly one key."""
        used = list(self.resident.values())
        if len(set(used)) != len(used) or set(used) & set(self._free) or len(used) + len(self._free) != self.capacity:
            raise AssertionError(f"expert cache slots inconsistent: {len(used)} used, {len(self._free)} free, capacity {self.capacity}")


def simulate(routed_steps, predicted_steps, capacity: int, policy: str = "lru") -> dict:
    """Run the cache over decode steps: ``routed_steps[s][l]`` the experts layer l routes to at step s,
    ``predicted_steps[s][l]`` the prediction for layer l made during layer l - 1 (None: on-demand only).
    Returns the stats: stalls are the copies a layer waits for."""
    cache = ExpertCache(capacity, layers=len(routed_steps[0]) if routed_steps else 1, policy=policy)
    for s, layers in enumerate(routed_steps):
        for layer, experts in enumerate(layers):
            cache.require(layer, experts)  # the router has run: wait for what is missing
            nxt = layer + 1
            if predicted_steps is not None and nxt < len(layers) and predicted_steps[s][nxt] is not None:
                cache.prefetch(nxt, predicted_steps[s][nxt])  # copies overlap this layer's experts
            cache.release(layer)
        cache.check()
    return cache.stats.as_dict()


RESIDENCY_FUNC = "moec.expert_residency"  # the compiled graph's call before each MoE layer's expert GEMMs


class HostCopies:
    """Expert copies made by the host at once (CPU devices, whose pools are host memory): the host weights stay
    NumPy arrays, every copy is complete when ``copy`` returns."""

    asynchronous = False

    def __init__(self, tvm, device) -> None:
        self._tvm, self.device = tvm, device

    def stage(self, array: np.ndarray):
        return np.ascontiguousarray(array)

    def copy(self, pool, offset: int, src, index: int, nbytes: int) -> None:
        part = src[index]
        view = pool._create_view(part.shape, str(part.dtype), relative_byte_offset=offset)
        view.copyfrom(part)

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mark(self) -> float:
        """A point on the compute timeline (here the host's: the device computes as the host calls it)."""
        return time.perf_counter()

    def elapsed(self, start, end) -> float:
        return end - start


class CudaStreamCopies:
    """Expert copies on their own CUDA stream, overlapping compute. The host weights are staged once in pinned
    (page-locked) host memory (TVM's ``cuda_host`` device), so a copy is a DMA the host only enqueues. The stream
    is TVM's (created non-blocking: the compute stream never waits for it implicitly); the copies themselves go
    through the CUDA driver (``cuMemcpyHtoDAsync``), because TVM's tensor copies take no stream argument.
    ``wait()`` makes the compute stream wait for every copy enqueued so far (an event, no host wait);
    ``ready()`` asks, without waiting, whether they have all finished."""

    asynchronous = True

    def __init__(self, tvm, device) -> None:
        import tvm_ffi

        self._tvm, self.device = tvm, device
        self._drv = CudaDriver(device.index, "offloaded experts")
        self.host_device = tvm.runtime.device(3, device.index)  # kDLCUDAHost: cudaMallocHost'd memory
        self.stream = stream_handle(tvm_ffi.get_global_func("runtime.Device_StreamCreate")(device))
        self._sync_from_to = tvm_ffi.get_global_func("runtime.Device_StreamSyncFromTo")
        self.compute = launch_stream()
        self._marks: list[int] = []
        self._turn = 0

    def stage(self, array: np.ndarray):
        pinned = self._tvm.runtime.empty(array.shape, str(array.dtype), self.host_device)
        pinned.copyfrom(np.ascontiguousarray(array))
        return pinned

    def copy(self, pool, offset: int, src, index: int, nbytes: int) -> None:
        self._drv.bind()
        self._drv.htod(pool.data_ptr() + offset, src.data_ptr() + index * nbytes, nbytes, self.stream)

    def ready(self) -> bool:
        return self._drv.stream_ready(self.stream)

    def wait(self) -> None:
        self._sync_from_to(self.device, self.stream, self.compute)

    def synchronize(self) -> None:
        self._drv.stream_synchronize(self.stream)

    def mark(self) -> int:
        """A timing event recorded on the compute stream (from a ring of four: a mark is read before the fourth
        after it is recorded). It completes when the compute stream gets there, after any wait enqueued before."""
        if not self._marks:
            self._marks = [self._drv.event(self, timing=True) for _ in range(4)]
        ev = self._marks[self._turn]
        self._turn = (self._turn + 1) % len(self._marks)
        self._drv.record(ev, self.compute)
        return ev

    def elapsed(self, start: int, end: int) -> float:
        """Device seconds between two marks (waiting for ``end``: at once when the stream was synchronised after it)."""
        self._drv.wait_event(end)
        return self._drv.elapsed(start, end)


class PrefetchGate:
    """Whether a predicted expert is worth copying ahead of its layer.

    A prefetch issued at layer l's residency can hide at most the compute until layer l + 1's router (``overlap``:
    layer l's expert GEMMs, layer l + 1's attention and router), and never more than the copy itself. A wrong one
    costs a whole copy (``copy_s``) of copy-engine time, which the next layers' demand copies then queue behind.
    Where no slot is free, the copy also evicts a resident expert, which comes back within a cycle of the layers
    with probability q (``ExpertCache.eviction_reuse``) and then costs a copy of its own. So an expert whose
    prediction comes true with probability p is copied ahead only if

        p * min(overlap, copy_s) >= (1 - p) * copy_s + (q * copy_s if it evicts)

    Where a copy takes far longer than a layer computes (a bf16 Mixtral-8x7B expert: 7 ms over PCIe against about
    1 ms of compute) or the cache is too small for the experts it holds to survive a cycle, nothing passes and the
    prefetch costs nothing; where copies are short and slots to spare, most predictions pass.

    p is estimated per prediction rank (an expert's best rank among the tokens' predictions, 0 = some token's
    top choice) from the predictions made so far, copied or not, against the experts the layer then routed to
    (``observe``), with counts that decay by ``decay`` an observation and a prior of one hit in two.
    ``overlap`` is measured on the device (the compute stream's time between one layer's residency call, after any
    wait for copies, and the next layer's), as a moving average per number of rows (tokens) in the call: a
    prefill chunk's layers compute far longer than a decode step's, and must not make decode prefetch look free."""

    def __init__(self, copy_s: float, ranks: int, decay: float = 0.98) -> None:
        self.copy_s = float(copy_s)
        self.used = np.ones(max(int(ranks), 1))
        self.seen = np.full(max(int(ranks), 1), 2.0)
        self.decay = float(decay)
        self.overlaps: dict[int, float] = {}  # rows -> moving average of the overlap, in seconds

    def precision(self) -> np.ndarray:
        return self.used / self.seen

    def observe(self, predicted: dict, routed) -> None:
        """``predicted``: expert -> best rank, for the layer whose routed experts are ``routed``."""
        routed = set(int(e) for e in routed)
        for e, r in predicted.items():
            r = min(int(r), len(self.seen) - 1)
            self.used[r] = self.used[r] * self.decay + float(e in routed)
            self.seen[r] = self.seen[r] * self.decay + 1.0

    def time_layer(self, seconds: float, rows: int = 1) -> None:
        old = self.overlaps.get(int(rows))
        self.overlaps[int(rows)] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def overlap(self, rows: int = 1) -> float | None:
        """The overlap for a call of ``rows`` rows: measured at that many, else at the nearest count measured (by
        ratio), else None."""
        rows = max(int(rows), 1)
        if rows in self.overlaps:  # (every call after a step of this batch size: asked for each predicted expert)
            return self.overlaps[rows]
        if not self.overlaps:
            return None
        near = min(self.overlaps, key=lambda r: abs(np.log(max(r, 1) / rows)))
        return self.overlaps[near]

    def admit(self, rank: int, rows: int = 1, evict_reuse: float = 0.0) -> bool:
        """Copy ahead an expert of this best rank, in a call of ``rows`` rows? ``evict_reuse``: q when the copy must
        evict a resident expert, 0 when a slot is free. (Yes until a layer of about that many rows is timed.)"""
        overlap = self.overlap(rows)
        if overlap is None:
            return True
        p = self.precision()[min(int(rank), len(self.seen) - 1)]
        return p * min(overlap, self.copy_s) >= (1.0 - p + float(evict_reuse)) * self.copy_s


class OffloadedExperts:
    """The runtime side of offloaded experts (``moec compile --expert-slots``): the layers' expert weights in host
    memory (pinned on CUDA), device pools of ``slots`` experts (W1 [S, 2I, D], W2 [S, D, I]; with FP8 experts,
    ``--expert-weights fp8``, their e4m3 codes and float32 scales [S, 2I], [S, D], four pools at about half the
    bytes) that the compiled grouped expert kernels read, and an ``ExpertCache`` deciding residency.

    ``residency(ids, x, layer)`` is what the compiled graph calls (``RESIDENCY_FUNC``) once a layer's router has
    chosen (``ids``; ``x`` the layer's expert input, its post-attention state after the norm): the routed experts
    are made resident (missing ones copied into free or least recently used slots) and the [E] slot table comes
    back for the kernels. ``begin()`` starts a model call: no layer is computing yet, so every slot may be reused.

    Copies (``copier``): on CUDA (``CudaStreamCopies``) they run on a copy stream while the host goes on; when a
    layer's routed experts include copies not yet finished (its misses, or prefetches still in flight) the compute
    stream is made to wait for them before the layer's expert GEMMs, with no host wait. Reading ``ids`` has
    synchronised the compute stream, so every earlier kernel that read a slot has finished before a copy can
    overwrite it; the running layer's experts are never evicted. On the CPU the copies are made at once.

    Prefetch (``predictors``: per layer l >= 1, layer l's router weight [E, D], its bias or None, and the ratio of
    layer l's norm weight to layer l - 1's): after layer l - 1's residency, layer l's router is applied to layer
    l - 1's input renormalised with layer l's norm weight (the same RMS, so ``x * ratio``), and the top ``top_k +
    extra`` experts of each token are copied ahead of layer l's router (``ExpertCache.prefetch``: never evicting
    the running layer's experts), overlapping layer l - 1's expert GEMMs and layer l's attention. ``cache.stats``
    counts the prefetched experts the layer then used and the stalls left; ``waits`` the layers whose GEMMs waited
    for copies in flight, ``ready`` the layers whose needed copies had all finished by their router.

    ``gate`` (``PrefetchGate``): True copies ahead only the predicted experts worth it (the gate's rule, with the
    copy time from ``copy_bandwidth``), False every predicted expert, None (default) gates where copies are
    asynchronous (CUDA). ``skipped`` counts the predicted experts the gate held back."""

    def __init__(self, tvm, device, doc: dict, host: dict, predictors: list | None = None, top_k: int = 0,
                 extra: int = 0, copier=None, gate: bool | None = None) -> None:
        self._tvm, self.device = tvm, device
        # extra: one number for every layer, or one per layer (``expert_prefetch="auto"``)
        self.predictors, self.top_k = predictors, int(top_k)
        self.extra = [int(e) for e in extra] if isinstance(extra, (list, tuple)) else int(extra)
        if copier is None:
            copier = CudaStreamCopies(tvm, device) if device.dlpack_device_type() == 2 else HostCopies(tvm, device)
        self.copier = copier
        # per layer its stored arrays, one per pool (W1, W2; with FP8 experts W1 codes, scales, W2 codes, scales)
        if any(len(names) != len(doc["pools"]) for names in doc["layers"]):
            raise ValueError(f"offloaded experts: each layer needs one array per pool ({len(doc['pools'])})")
        for names in doc["layers"]:  # every expert of every layer must fit its pool's slot: the copies are raw bytes
            for p, n in zip(doc["pools"], names):
                a = host[n]
                if tuple(a.shape) != (int(doc["experts"]), *p["shape"][1:]) or str(a.dtype) != p["dtype"]:
                    raise ValueError(f"offloaded experts: {n} is {list(a.shape)} {a.dtype}, but pool {p['name']} takes "
                                     f"{doc['experts']} experts of {p['shape'][1:]} {p['dtype']}")
        first = [host[n] for n in doc["layers"][0]]
        self._slot_bytes = [int(np.prod(p["shape"][1:])) * first[i].itemsize for i, p in enumerate(doc["pools"])]
        self.layers = [tuple(copier.stage(host[n]) for n in names) for names in doc["layers"]]
        self.experts = int(doc["experts"])
        self.pools = [tvm.runtime.empty(tuple(p["shape"]), p["dtype"], device) for p in doc["pools"]]
        self.cache = ExpertCache(int(doc["slots"]), layers=len(doc["layers"]), policy="cycle")
        self.copies = 0
        self.copy_bytes = 0
        self.waits = 0
        self.ready = 0
        self._inflight: set = set()  # (layer, expert) copies enqueued since the compute stream last waited
        self._last = None
        self._gated = (copier.asynchronous if gate is None else bool(gate)) and predictors is not None
        self.gate: PrefetchGate | None = None  # made at the first prefetch (it measures the copy bandwidth)
        self.skipped = 0
        self._predicted: dict = {}  # (gated) layer -> {expert: best rank} of the prediction made for it
        self._timed = None  # (the copier's mark as it returned, layer) of the last residency call: the gate's overlap
        # host seconds spent in residency calls, by part: waiting for the router's ids (the compute stream), reading the
        # expert input and predicting the next layer's experts (the gate's one-time copy-bandwidth measurement included,
        # also counted alone)
        self.host_s = {"ids": 0.0, "predict": 0.0, "gate_setup": 0.0, "total": 0.0}
        # the residency calls since the counts were reset, as (layer, entered, ids read, returned, copies made (the
        # prefetches included), waited) with host clock times (time.perf_counter): where a prefill's host time goes
        self.calls: list = []

    CALLS_KEPT = 512

    def reset_counts(self) -> None:
        self.cache.stats = CacheStats()
        self.copies = self.copy_bytes = self.waits = self.ready = self.skipped = 0
        self.host_s = dict.fromkeys(self.host_s, 0.0)
        self.calls = []

    def timeline(self, since: float) -> list:
        """The residency calls kept (at most ``CALLS_KEPT`` since the counts were reset), times in ms from ``since``
        (a ``time.perf_counter()`` reading): ``[layer, entered, ids read, returned, copies made, waited (0/1)]``."""
        return [[c[0], *(round(1e3 * (t - since), 3) for t in c[1:4]), c[4], c[5]] for c in self.calls]

    def counts(self) -> dict:
        out = {"slots": self.cache.capacity, "copies": self.copies, "copy_bytes": self.copy_bytes,
               "copy_waits": self.waits, "copies_ready": self.ready, "prefetch_skipped": self.skipped,
               **self.cache.stats.as_dict(), "host_ms": {k: round(v * 1e3, 3) for k, v in self.host_s.items()}}
        if self.gate is not None:
            out["gate"] = {"copy_ms": self.gate.copy_s * 1e3,
                           "overlap_ms_by_rows": {str(r): round(v * 1e3, 4) for r, v in sorted(self.gate.overlaps.items())},
                           "precision_by_rank": [round(float(p), 4) for p in self.gate.precision()],
                           "eviction_reuse": round(self.cache.eviction_reuse(), 4)}
        return out

    def begin(self) -> None:
        for layer in range(len(self.layers)):
            self.cache.release(layer)
        self._last = None
        self._timed = None

    def _copy(self, layer: int, expert: int, slot: int) -> None:
        for i, pool in enumerate(self.pools):
            self.copier.copy(pool, slot * self._slot_bytes[i], self.layers[layer][i], expert, self._slot_bytes[i])
            self.copy_bytes += self._slot_bytes[i]
        self.copies += 1
        if self.copier.asynchronous:
            self._inflight.add((layer, expert))

    def copy_bandwidth(self, repeats: int = 8) -> float:
        """Host-to-device bytes per second of expert copies: layer 0's first expert copied ``repeats`` times into a
        scratch buffer the size of a slot, the way the cache copies (measured on its own, not while decoding)."""
        scratch = [self._tvm.runtime.empty((self._slot_bytes[i],), "uint8", self.device) for i in range(len(self.pools))]
        self.copier.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            for i, buf in enumerate(scratch):
                self.copier.copy(buf, 0, self.layers[0][i], 0, self._slot_bytes[i])
        self.copier.synchronize()
        return repeats * sum(self._slot_bytes) / (time.perf_counter() - t)

    def _prefetch(self, x, layer: int) -> None:
        """Layer ``layer``'s experts predicted from the previous layer's expert input ``x`` [T, D]."""
        w, bias, ratio = self.predictors[layer]
        logits = (x * ratio) @ w.T
        if bias is not None:
            logits = logits + bias
        k = min(self.top_k + (self.extra[layer] if isinstance(self.extra, list) else self.extra), self.experts)
        top = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
        ranked = np.take_along_axis(top, np.argsort(-np.take_along_axis(logits, top, -1), axis=-1), -1)
        best: dict = {}  # expert -> its best rank among the tokens' predictions
        for r in range(k):
            for e in np.unique(ranked[:, r]).tolist():
                best.setdefault(int(e), r)
        want = list(best)
        if self._gated:
            self._predicted[layer] = best  # scored against the layer's routing at its residency
            if self.gate is None:
                t = time.perf_counter()
                self.gate = PrefetchGate(sum(self._slot_bytes) / self.copy_bandwidth(repeats=2), ranks=k)
                self.host_s["gate_setup"] += time.perf_counter() - t
            free, q, admitted = self.cache.free_slots, self.cache.eviction_reuse(), []
            for e in sorted(want, key=best.get):  # the surest first: they take the free slots
                if (layer, e) in self.cache:
                    admitted.append(e)
                elif self.gate.admit(best[e], len(x), 0.0 if free > 0 else q):
                    admitted.append(e)
                    free -= 1
            self.skipped += len(best) - len(admitted)
            want = admitted
        for expert, slot in self.cache.prefetch(layer, want):
            self._copy(layer, expert, slot)

    def residency(self, ids, x, layer: int):
        if not 0 <= layer < len(self.layers):
            raise MoecError(f"offloaded experts: layer {layer} of {len(self.layers)}")
        t0 = time.perf_counter()
        copies, waits, self._ids_at = self.copies, self.waits, t0
        try:
            return self._residency(ids, x, layer, t0)
        finally:
            t1 = time.perf_counter()
            self.host_s["total"] += t1 - t0
            if len(self.calls) < self.CALLS_KEPT:
                self.calls.append((layer, t0, self._ids_at, t1, self.copies - copies, int(self.waits > waits)))

    def _residency(self, ids, x, layer: int, t0: float):
        if self._last is not None and self._last != layer:
            self.cache.release(self._last)
        self._last = layer
        e = self.experts
        arrived = self.copier.mark() if self._gated else None  # the compute stream reached this layer's router
        routed = ids.numpy().astype(np.int64).reshape(-1)  # (synchronises the compute stream)
        routed = np.where(routed < 0, routed + e, routed)  # the kernels' wrap of negative ids
        routed = np.unique(routed[(routed >= 0) & (routed < e)])
        self._ids_at = time.perf_counter()
        self.host_s["ids"] += self._ids_at - t0
        if self._gated:
            if self._timed is not None and self._timed[1] == layer - 1 and self.gate is not None:
                # the compute between the previous layer's residency (after its wait for copies) and this router
                rows = int(np.prod(x.shape[:-1]))
                self.gate.time_layer(self.copier.elapsed(self._timed[0], arrived), rows)
            if self.gate is not None and layer in self._predicted:
                self.gate.observe(self._predicted.pop(layer), routed.tolist())
        predict = self.predictors is not None and layer + 1 < len(self.layers)
        xs = None
        if predict:
            t = time.perf_counter()
            xs = x.numpy().astype(np.float32).reshape(-1, x.shape[-1])
            self.host_s["predict"] += time.perf_counter() - t
        _, copies = self.cache.require(layer, routed.tolist())
        table = np.zeros(e, np.int32)  # experts with no token are never read: any slot will do
        for expert in routed.tolist():
            table[expert] = self.cache.slot(layer, expert)
        out = self._tvm.runtime.tensor(table, self.device)  # (its upload syncs the compute stream: before any wait)
        for expert, slot in copies:
            self._copy(layer, expert, slot)
        if self._inflight and self._inflight & {(layer, int(x_)) for x_ in routed.tolist()}:
            if self.copier.ready():
                self.ready += 1
            else:  # the layer's GEMMs (enqueued after this returns) wait for the copies, the host does not
                self.copier.wait()
                self.waits += 1
            self._inflight.clear()
        if predict:
            t = time.perf_counter()
            self._prefetch(xs, layer + 1)
            self.host_s["predict"] += time.perf_counter() - t
        if self._gated:
            self._timed = (self.copier.mark(), layer)
        return out
