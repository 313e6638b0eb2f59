"""Hand-written TIR kernels for the hot paths."""

from __future__ import annotations

import functools

MEMO_SIZE = 256  # results a factory keeps (least recently used first out): a process compiling many models stays bounded


def memoized(factory):
    """A kernel factory whose results are kept for the process, by argument: TIR functions are immutable, so one
    parse of a kernel's TVMScript serves every build that asks for it with the same arguments (the parse was about a
    third of a small model's build, the re-rank's five kernels most of it). Only factories whose result depends on
    their arguments alone take this; a dict result is returned as a fresh copy, and arguments that cannot be hashed
    build afresh. At most ``MEMO_SIZE`` results a factory are kept (``functools.lru_cache``). ``cache_clear()``
    empties the memo."""
    cached = functools.lru_cache(maxsize=MEMO_SIZE)(factory)

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:  # an unhashable argument
            return factory(*args, **kwargs)
        out = cached(*args, **kwargs)
        return dict(out) if isinstance(out, dict) else out

    wrapper.cache_clear = cached.cache_clear
    return wrapper
