"""Hand-written TIR kernels for the hot paths."""

from __future__ import annotations

import functools
from collections import OrderedDict

MEMO_SIZE = 256  # results a factory keeps (least recently used first out): a process compiling many models stays bounded


def memoized(factory):
    """A kernel factory whose results are kept for the process, by argument: TIR functions are immutable, so one
    parse of a kernel's TVMScript serves every build that asks for it with the same arguments (the parse was about a
    third of a small model's build, the re-rank's five kernels most of it). Only factories whose result depends on
    their arguments alone take this; a dict result is returned as a fresh copy, and arguments that cannot be hashed
    build afresh. At most ``MEMO_SIZE`` results a factory are kept. ``cache_clear()`` empties the memo."""
    memo: OrderedDict = OrderedDict()

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        try:
            hit = key in memo
        except TypeError:  # an unhashable argument
            return factory(*args, **kwargs)
        if hit:
            memo.move_to_end(key)
        else:
            memo[key] = factory(*args, **kwargs)
            if len(memo) > MEMO_SIZE:
                memo.popitem(last=False)
        out = memo[key]
        return dict(out) if isinstance(out, dict) else out

    wrapper.cache_clear = memo.clear
    return wrapper
