"""The tiered pools hold every layer in one tensor: at 128 streams x 4096 tokens x 16 layers a pool has more
than 2^31 elements, so every kernel that reads or writes one must compute its offsets in 64 bits."""

import re

import pytest
import tvm

from moec.compiler.targets import make_target
from moec.runtime.kv_cache import POOLS, pool_specs
from moec.schedules.kernels.tiered_append import make_tiered_append
from moec.schedules.kernels.tiered_attention import make_tiered_attention, make_tiered_mass
from moec.schedules.kernels.tiered_decode import make_tiered_decode_cuda
from moec.schedules.kernels.tiered_rerank import make_tiered_rerank

KERNELS = {
    "tiered_attention": lambda: make_tiered_attention(16, 16, 128, 16, 128, target="cuda"),
    "tiered_mass": lambda: make_tiered_mass(16, 16, 128, 16, target="cuda"),
    "tiered_decode": lambda: make_tiered_decode_cuda(16, 16, 128, 16, 128),
    "tiered_attention_mma": lambda: make_tiered_attention(16, 16, 128, 16, 128, target="cuda", mma_dtype="bfloat16"),
    "tiered_mass_mma": lambda: make_tiered_mass(16, 16, 128, 16, target="cuda", mma_dtype="bfloat16"),
    "tiered_append": lambda: make_tiered_append(16, 128, 16, target="cuda"),
    "tiered_rerank": lambda: make_tiered_rerank(16, 128, 16, 128, 4, 64, target="cuda"),
}


def test_headline_pools_pass_int32():
    # what the 64-bit offsets are for: the headline engine's tier-1 and tier-2 key pools
    tokens = 128 * 4096
    specs = pool_specs(16, int(0.2 * tokens) // 16, tokens // 128, 16, 128, 16, 128)
    for name in ("t1_k", "t2_k"):
        n = 1
        for d in specs[name][0]:
            n *= d
        assert n > 2**31, name


def _indices(src: str, ptr: str):
    """The index expression of every ``ptr[...]`` access (brackets matched)."""
    for m in re.finditer(re.escape(ptr) + r"\[", src):
        depth, i = 1, m.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(src[i], 0)
            i += 1
        yield src[m.end():i - 1]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_pool_offsets_are_64_bit(name):
    funcs = KERNELS[name]()  # one PrimFunc, or the re-rank's launches by name
    mod = tvm.IRModule(funcs if isinstance(funcs, dict) else {name: funcs})
    src = tvm.compile(mod, target=make_target("cuda")).mod.imports[0].inspect_source()
    pointers = set(re.findall(r"\b(\w+)\[", src))
    seen = 0
    for pool in POOLS:
        # the pool's own pointer or a typed view of it (the decode kernel reads FP8 and uint32 views)
        for ptr in sorted(p for p in pointers if p == f"{pool}_ptr" or re.fullmatch(rf"{pool}\d+", p)):
            for idx in _indices(src, ptr):
                seen += 1
                assert "int64_t" in idx, f"{name}: {ptr}[{idx}] is indexed in 32 bits"
    assert seen, f"{name}: no pool access found in the CUDA source"
