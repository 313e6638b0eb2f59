"""Continuous batching over one ``Engine``: streams join and leave between decode steps.

``Scheduler(engine).submit(Request(...))`` queues a request and returns its ``Stream`` handle;
every ``step()`` then

  1. admits queued requests (first come, first served) while a sequence slot is free and the cache
     can hold the request's *whole* life (prompt + max_new_tokens) next to everything admitted before
     it; a request that does not fit now waits at the head of the queue,
  2. runs one prefill call of at most ``prefill_chunk`` tokens over the admitted streams that still
     have prompt left (long prompts take several steps; a stream whose prompt completes samples its
     first token),
  3. runs one decode step over every stream that has a token to feed, samples each stream's next
     token with its own sampler (``moec.runtime.sampling``), and retires the streams that hit a stop
     token or their length limit; their cache pages go back at once.

Admission reserves, per stream, the pages the stream can need at its longest, so a running stream
never meets a full cache (no preemption needed) and a refused request never disturbs the others.
A request that can never fit (its prompt + max_new_tokens exceeds the cache, or the waiting queue is
full) is refused at ``submit`` with ``RequestRefused`` (a ``CacheExhausted``) naming the request.

Capacity per cache kind:

  paged (bf16/fp16/fp32)  a stream of at most L cached tokens holds ceil(L / page_size) pages of the
                          engine's ``max_total_tokens // page_size``.
  tiered (FP8 + 2-bit)    after a re-rank a stream keeps at most ``budget(L) + t2_page - 1`` tier-1
                          tokens, and gains at most ``rerank_every`` more before the next re-rank;
                          its tier-2 pages never exceed ``(L - budget(L)) // t2_page``. A prefill
                          chunk may overshoot a stream's tier-1 reservation until the re-rank right
                          after the call brings it back, so each chunk is sized to the free tier-1
                          pages (every other stream is within its reservation then, so the stream's
                          own unused reservation is always free: prefill always progresses).
                          fp8 (no re-rank) keeps all L tokens in tier 1.

A stream caches ``len(prompt) + max_new_tokens - 1`` tokens at most: its last token is never fed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Iterator, Sequence

from ..compiler.errors import MoecError
from .kv_cache import CacheExhausted
from .sampling import Sampler, SamplingParams


class RequestRefused(CacheExhausted):
    """A request that can never be served by this scheduler (it names the request)."""


@dataclass
class Request:
    """One generation request.

    prompt : token ids (at least one).
    max_new_tokens : tokens to generate at most (the stream leaves after this many).
    stop_tokens : the stream leaves after generating one of these (it is included in the output).
    sampling : greedy by default; see ``SamplingParams``.
    rid : the request's id in events and errors (default: a running integer).
    """

    prompt: Sequence[int]
    max_new_tokens: int = 16
    stop_tokens: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: Hashable | None = None


class Stream:
    """The handle of a submitted request: its tokens so far and its state.

    ``state`` is "queued", "prefill", "decode" or "done"; ``finish_reason`` ("stop", "length",
    "cancelled") is set when done. Iterating a stream yields its tokens as they come, stepping
    the scheduler when none is ready.
    """

    def __init__(self, scheduler: "Scheduler", request: Request) -> None:
        self.scheduler, self.request, self.rid = scheduler, request, request.rid
        self.prompt = [int(t) for t in request.prompt]
        self.max_len = len(self.prompt) + request.max_new_tokens - 1  # tokens cached at the longest
        self.stop = frozenset(int(t) for t in request.stop_tokens)
        self.sampler = Sampler(request.sampling)
        self.tokens: list[int] = []
        self.state = "queued"
        self.finish_reason: str | None = None
        self.seq: int | None = None  # engine sequence id while admitted
        self.prefilled = 0  # prompt tokens in the cache
        self.need: tuple[int, int] = (0, 0)  # reserved pages (paged or tier 1, tier 2)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            while i < len(self.tokens):
                yield self.tokens[i]
                i += 1
            if self.done:
                return
            self.scheduler.step()

    def __repr__(self) -> str:
        return f"Stream(rid={self.rid!r}, state={self.state}, tokens={len(self.tokens)})"


class Scheduler:
    """Continuous batching, chunked prefill and per-stream sampling over one ``Engine``.

    Parameters
    ----------
    engine : a loaded ``Engine`` (paged or tiered cache); the scheduler owns its sequences.
    prefill_chunk : prompt tokens per step, over all arriving streams (default and maximum: the
        engine's prefill chunk). Smaller chunks delay running streams less per step.
    max_batch : streams admitted at once (default and maximum: the engine's ``max_batch``).
    max_queue : requests waiting at most (default: unbounded); beyond it ``submit`` refuses.
    """

    def __init__(self, engine, prefill_chunk: int | None = None, max_batch: int | None = None,
                 max_queue: int | None = None) -> None:
        if engine.lengths:
            raise MoecError(f"the engine holds {len(engine.lengths)} sequences already: a scheduler needs an engine "
                            "(or a cache) of its own")
        self.engine = engine
        self.prefill_chunk = min(prefill_chunk or engine.prefill_chunk, engine.prefill_chunk)
        self.max_batch = min(max_batch or engine.max_batch, engine.max_batch)
        if self.prefill_chunk < 1 or self.max_batch < 1:
            raise MoecError("prefill_chunk and max_batch must be >= 1")
        self.max_queue = max_queue
        self.queue: deque[Stream] = deque()
        self.running: list[Stream] = []  # admitted, in admission order
        self.streams: dict[Hashable, Stream] = {}  # every stream not yet done
        self._next_rid = 0
        self.steps = self.prefill_calls = self.decode_calls = self.served = 0
        t = engine.tiered
        if t is None:
            self.capacity = (engine.max_total_tokens // engine.page_size, 0)
        else:
            self.capacity = (t.tables.t1.num_pages, t.tables.t2.num_pages)
        self.reserved = [0, 0]

    # ------------------------------------------------------------------ capacity
    def pages_needed(self, length: int) -> tuple[int, int]:
        """Pages a stream of at most ``length`` cached tokens may hold at once: (paged or tier 1, tier 2)."""
        e = self.engine
        if e.tiered is None:
            return (math.ceil(length / e.page_size), 0)
        pt, opts = e.tiered.tables, e.tiered.opts
        if e.tiered._rerank is None:  # fp8: every token stays in tier 1
            return (math.ceil(length / pt.t1_page), 0)
        budget = pt.budget(length)
        t1 = min(length, budget + pt.t2_page - 1 + opts["rerank_every"])
        return (math.ceil(t1 / pt.t1_page), (length - budget) // pt.t2_page)

    def _describe(self, need) -> str:
        if self.engine.tiered is None:
            return f"{need[0]} pages of {self.engine.page_size} tokens, the cache has {self.capacity[0]}"
        return (f"{need[0]} tier-1 and {need[1]} tier-2 pages, the cache has {self.capacity[0]} and "
                f"{self.capacity[1]}")

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> Stream:
        """Queue a request; returns its ``Stream``. Raises ``RequestRefused`` if it can never be served
        (and ``MoecError`` for a malformed request); either way nothing else changes."""
        if not isinstance(request, Request):
            raise MoecError(f"submit takes a Request, got {type(request).__name__}")
        if request.rid is None:
            while self._next_rid in self.streams:
                self._next_rid += 1
            request.rid = self._next_rid
            self._next_rid += 1
        rid = request.rid
        if rid in self.streams:
            raise MoecError(f"request {rid!r}: a stream with this id is still running")
        if len(request.prompt) == 0:
            raise MoecError(f"request {rid!r}: the prompt needs at least one token")
        if int(request.max_new_tokens) != request.max_new_tokens or request.max_new_tokens < 1:
            raise MoecError(f"request {rid!r}: max_new_tokens must be an integer >= 1, got {request.max_new_tokens}")
        vocab = self.engine.vocab_size
        if any(not 0 <= int(t) < vocab for t in request.prompt):
            raise MoecError(f"request {rid!r}: prompt token ids must be in [0, {vocab})")
        s = Stream(self, request)
        need = self.pages_needed(s.max_len)
        if s.max_len > self.engine.max_total_tokens or need[0] > self.capacity[0] or need[1] > self.capacity[1]:
            raise RequestRefused(
                f"request {rid!r} refused: a prompt of {len(s.prompt)} tokens + {request.max_new_tokens} new tokens "
                f"caches up to {s.max_len} tokens ({self._describe(need)}; at most {self.engine.max_total_tokens} "
                f"tokens): it can never fit")
        if self.engine.max_context is not None and s.max_len > self.engine.max_context:
            raise RequestRefused(
                f"request {rid!r} refused: a prompt of {len(s.prompt)} tokens + {request.max_new_tokens} new tokens "
                f"caches up to {s.max_len} tokens, more than the model's sliding window lets its attention see "
                f"({self.engine.max_context} tokens; the compiled attention spans whole sequences)")
        if self.max_queue is not None and len(self.queue) >= self.max_queue:
            raise RequestRefused(f"request {rid!r} refused: {len(self.queue)} requests already wait (max_queue)")
        s.need = need
        self.queue.append(s)
        self.streams[rid] = s
        return s

    def cancel(self, rid: Hashable) -> None:
        """Drop a queued or running stream now (its pages go back at once)."""
        s = self.streams.get(rid)
        if s is None:
            raise MoecError(f"request {rid!r}: no such stream (finished or never submitted)")
        if s.state == "queued":
            self.queue.remove(s)
            s.state, s.finish_reason = "done", "cancelled"
            del self.streams[rid]
        else:
            self._finish(s, "cancelled")

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    # ------------------------------------------------------------------ stepping
    def _admit(self) -> None:
        e = self.engine
        while self.queue and len(self.running) < self.max_batch and len(e.lengths) < e.max_batch:
            s = self.queue[0]
            if any(r + n > c for r, n, c in zip(self.reserved, s.need, self.capacity)):
                return  # waits (first come, first served: later requests do not overtake it)
            self.queue.popleft()
            s.seq = e.add_sequence()
            s.state = "prefill"
            self.reserved = [r + n for r, n in zip(self.reserved, s.need)]
            self.running.append(s)

    def _finish(self, s: Stream, reason: str) -> None:
        self.engine.release(s.seq)
        self.reserved = [r - n for r, n in zip(self.reserved, s.need)]
        self.running.remove(s)
        del self.streams[s.rid]
        s.state, s.finish_reason, s.seq = "done", reason, None
        self.served += 1

    def _emit(self, s: Stream, token: int, events: list) -> None:
        s.tokens.append(token)
        events.append((s.rid, token))
        if token in s.stop:
            self._finish(s, "stop")
        elif len(s.tokens) >= s.request.max_new_tokens:
            self._finish(s, "length")
        else:
            s.state = "decode"

    def _prefill_step(self, events: list) -> None:
        e = self.engine
        tiered = e.tiered is not None and e.tiered._rerank is not None
        budget = self.prefill_chunk
        room = e.tiered.tables.t1.free if tiered else 0
        batch = []
        for s in self.running:
            if s.state != "prefill" or budget == 0:
                continue
            take = min(len(s.prompt) - s.prefilled, budget)
            if tiered:  # fit the chunk into the free tier-1 pages (the re-rank after the call frees them)
                pt, ps1 = e.tiered.tables, e.tiered.tables.t1_page
                q = pt.seqs[e.tiered.slot[s.seq]]
                take = min(take, (len(q.t1_pages) + room) * ps1 - q.t1_len)
                if take <= 0:
                    continue
                room -= math.ceil((q.t1_len + take) / ps1) - len(q.t1_pages)
            batch.append((s, take))
            budget -= take
        if not batch:
            return
        chunks = [s.prompt[s.prefilled:s.prefilled + n] for s, n in batch]
        _, logits = e.prefill(chunks, seq_ids=[s.seq for s, _ in batch])
        self.prefill_calls += 1
        for row, (s, n) in enumerate(batch):
            s.prefilled += n
            if s.prefilled == len(s.prompt):
                self._emit(s, s.sampler(logits[row]), events)

    def step(self) -> list[tuple[Hashable, int]]:
        """Admit, prefill one chunk, decode one token per running stream; returns the new ``(rid, token)``s."""
        events: list[tuple[Hashable, int]] = []
        self._admit()
        if self.queue and not self.running:  # nothing runs that could free room for the head of the queue
            raise MoecError(f"request {self.queue[0].rid!r} cannot be admitted although no stream runs: the engine "
                            f"holds {len(self.engine.lengths)} sequences this scheduler does not own")
        decoding = [s for s in self.running if s.state == "decode"]  # streams prefilled below join next step
        self._prefill_step(events)
        if decoding:
            seqs, fed = [s.seq for s in decoding], [s.tokens[-1] for s in decoding]
            self.decode_calls += 1
            if all(s.sampler.params.greedy for s in decoding):  # argmax on the device: b ids come back, not b x V
                for s, tok in zip(decoding, self.engine.decode_greedy(seqs, fed)):
                    self._emit(s, int(tok), events)
            else:
                logits = self.engine.decode(seqs, fed)
                for row, s in enumerate(decoding):
                    self._emit(s, s.sampler(logits[row]), events)
        self.steps += 1
        return events

    def stream(self, requests: Iterable[Request] = ()) -> Iterator[tuple[Hashable, int]]:
        """Submit ``requests`` and yield ``(rid, token)`` as tokens come until no work is left.

        Requests submitted while iterating are served too. A refused request raises from here
        before any token is yielded (submit the others yourself to carry on past it).
        """
        for r in requests:
            self.submit(r)
        while not self.idle:
            yield from self.step()

    def generate(self, requests: Iterable[Request]) -> dict[Hashable, list[int]]:
        """Serve ``requests`` to the end; returns each request's tokens by rid."""
        handles = [self.submit(r) for r in requests]
        for _ in self.stream():
            pass
        return {h.rid: h.tokens for h in handles}
