"""Device helpers for hand-written CUDA kernels, added to a generated CUDA source that calls them.

TVM's CUDA code generator splits every operation on a ``float16x2`` value into two scalar ``half``
operations, so TIR cannot ask for the paired instructions (``HFMA2``) directly. Kernels that need them
keep the pairs in ``uint32`` registers and call these helpers through ``T.call_pure_extern``; the
helpers are PTX, one instruction each (``fma.rn.f16x2``, ``cvt.rn.f16x2.f32``, ``cvt.f32.f16``;
sm_80 or newer; ``cvt.rn.f16x2.e4m3x2``, sm_89 or newer). Subnormal halves are kept, not flushed (no ``.ftz``).

FP8 e4m3 to bfloat16 has no conversion instruction before sm_100. The ``bf16s`` pair places the bits: one
``prmt`` puts each byte in the low byte of its half and its sign, replicated, in the high byte; ``<< 4`` and one
mask leave the sign in bit 15 and the exponent and mantissa under bfloat16's (exponent e in the bfloat16 exponent
field, mantissa m at its top three bits): 2^(e - 127) (1 + m / 8) for e > 0 and the bfloat16 subnormal
(m / 8) 2^-126 for e = 0, 2^-120 times the e4m3 values, in three integer operations a pair. Consumers that take
the power of two themselves (the expert GEMMs multiply it into their epilogue scales) use that; the ``bf16`` pair
adds one ``fma.rn.bf16x2`` by 2^120 (+ -0, which keeps +0 and -0) that rebiases both (7 -> 127), exactly.

The wgmma helpers (sm_90a: ``wgmma.mma_async`` m64nNk16 with both operands in shared memory, its fence, commit and
waits, the 128-byte-swizzle descriptor, ``fence.proxy.async``) are a second block, added only to sources that call
them, so sources built for other architectures never carry instructions their ptxas refuses.

``register()`` installs TVM's ``tvm_callback_cuda_postproc`` hook (chaining any hook already
installed), which puts the helpers' definitions at the top of a generated source that calls one of
them and leaves every other source unchanged. The source a module keeps is the processed one, so the
fatbins built from it (``compiler.build``) match it at load time as any other.
"""

from __future__ import annotations

import re

HFMA2 = "moec_hfma2"  # (a, b, c) -> a * b + c on both halves, rounded once
PACK_H2 = "moec_pack_h2"  # (lo, hi) float32 -> the two halves, rounded to nearest
H2_LO = "moec_h2_lo"  # the low half as float32
H2_HI = "moec_h2_hi"  # the high half as float32
E4M3_LO = "moec_e4m3x2_lo"  # bytes 0, 1 (FP8 e4m3) -> the two halves, exactly (cvt.rn.f16x2.e4m3x2; sm_89 or newer)
E4M3_HI = "moec_e4m3x2_hi"  # bytes 2, 3 likewise
PACK_BF2 = "moec_pack_bf2"  # (lo, hi) float32 -> two bfloat16, rounded to nearest (cvt.rn.bf16x2.f32)
E4M3_BF_LO = "moec_e4m3x2_bf16_lo"  # bytes 0, 1 (FP8 e4m3) -> two bfloat16, exactly (see below)
E4M3_BF_HI = "moec_e4m3x2_bf16_hi"  # bytes 2, 3 likewise
E4M3_BFS_LO = "moec_e4m3x2_bf16s_lo"  # bytes 0, 1 (FP8 e4m3) -> two bfloat16 of 2^-120 times their values (see below)
E4M3_BFS_HI = "moec_e4m3x2_bf16s_hi"  # bytes 2, 3 likewise
ST_B32X2 = "moec_st_b32x2"  # (address, lo, hi): one 8-byte store of two 32-bit words (the address 8-byte aligned)
# Warpgroup tensor cores (sm_90a): ``wgmma.mma_async`` with both operands in shared memory, K-major rows of 128 bytes
# in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8), 8-row groups of 1024 bytes)
SMEM_U32 = "moec_smem_u32"  # (generic pointer into shared memory) -> its 32-bit shared address
WG_DESC = "moec_wgmma_desc_sw128"  # (pointer to the first row of a tile, 1024-byte aligned group) -> the 64-bit descriptor
WG_FENCE = "moec_wgmma_fence"  # wgmma.fence: register accesses before it are ordered before the next wgmma
WG_COMMIT = "moec_wgmma_commit"  # wgmma.commit_group
WG_WAIT0 = "moec_wgmma_wait0"  # wgmma.wait_group 0: every committed wgmma has completed (results in registers, smem read)
WG_WAIT1 = "moec_wgmma_wait1"  # wgmma.wait_group 1: all but the latest committed group have completed
FENCE_ASYNC_SMEM = "moec_fence_proxy_async_smem"  # this thread's shared-memory writes made visible to the async proxy
WGMMA_N = (32, 64, 128)  # token widths (the instruction's n) of the wgmma helpers
WGMMA_TYPES = {"bfloat16": "bf16", "float16": "f16"}


def wgmma_name(dtype: str, n: int) -> str:
    """The helper ``(float* d, desc_a, desc_b)``: d[0 .. n / 2) += A (64 x 16, K-major) B^T (n x 16, K-major), float32."""
    return f"moec_wgmma_m64n{n}k16_{WGMMA_TYPES[dtype]}"


def _wgmma_helper(dtype: str, n: int) -> str:
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    t = WGMMA_TYPES[dtype]
    return (f"__device__ __forceinline__ void {wgmma_name(dtype, n)}(float* d, unsigned long long da, unsigned long long db) {{\n"
            f'  asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{regs + 2}, 0;\\n'
            f' wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} {{{outs}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
            f'    : {cons}\n    : "l"(da), "l"(db), "r"(1) : "memory");\n}}\n')


WGMMA_PRELUDE = rf"""__device__ __forceinline__ unsigned int {SMEM_U32}(const void* p) {{
  return (unsigned int)__cvta_generic_to_shared(p);
}}
__device__ __forceinline__ unsigned long long {WG_DESC}(const void* p) {{
  // start address >> 4 (bits 0-13), leading offset 1 (unused by swizzled K-major tiles), stride 1024 bytes >> 4 between
  // 8-row groups (bits 32-45), base offset 0, layout 1: the 128-byte swizzle (bits 62-63)
  unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}}
__device__ __forceinline__ void {WG_FENCE}() {{ asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }}
__device__ __forceinline__ void {WG_COMMIT}() {{ asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }}
__device__ __forceinline__ void {WG_WAIT0}() {{ asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }}
__device__ __forceinline__ void {WG_WAIT1}() {{ asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }}
__device__ __forceinline__ void {FENCE_ASYNC_SMEM}() {{ asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }}
""" + "".join(_wgmma_helper(dt, n) for dt in WGMMA_TYPES for n in WGMMA_N)

_GUARD = "MOEC_CUDA_PRELUDE"
PRELUDE = rf"""#ifndef {_GUARD}
#define {_GUARD}
__device__ __forceinline__ unsigned int {HFMA2}(unsigned int a, unsigned int b, unsigned int c) {{
  unsigned int d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}}
__device__ __forceinline__ unsigned int {PACK_H2}(float lo, float hi) {{
  unsigned int d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}}
__device__ __forceinline__ float {H2_LO}(unsigned int a) {{
  float f;
  asm("{{.reg .f16 l, h;\n mov.b32 {{l, h}}, %1;\n cvt.f32.f16 %0, l;}}" : "=f"(f) : "r"(a));
  return f;
}}
__device__ __forceinline__ float {H2_HI}(unsigned int a) {{
  float f;
  asm("{{.reg .f16 l, h;\n mov.b32 {{l, h}}, %1;\n cvt.f32.f16 %0, h;}}" : "=f"(f) : "r"(a));
  return f;
}}
__device__ __forceinline__ unsigned int {PACK_BF2}(float lo, float hi) {{
  unsigned int d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}}
__device__ __forceinline__ unsigned int {E4M3_BFS_LO}(unsigned int a) {{
  unsigned int p;
  asm("prmt.b32 %0, %1, 0, 0x9180;" : "=r"(p) : "r"(a));
  return (p << 4) & 0x87F087F0u;
}}
__device__ __forceinline__ unsigned int {E4M3_BFS_HI}(unsigned int a) {{
  unsigned int p;
  asm("prmt.b32 %0, %1, 0, 0xB3A2;" : "=r"(p) : "r"(a));
  return (p << 4) & 0x87F087F0u;
}}
__device__ __forceinline__ unsigned int moec_bf16x2_rebias_(unsigned int s) {{  // both halves times 2^120, exactly
  unsigned int d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(s), "r"(0x7B807B80u), "r"(0x80008000u));
  return d;
}}
__device__ __forceinline__ unsigned int {E4M3_BF_LO}(unsigned int a) {{
  return moec_bf16x2_rebias_({E4M3_BFS_LO}(a));
}}
__device__ __forceinline__ unsigned int {E4M3_BF_HI}(unsigned int a) {{
  return moec_bf16x2_rebias_({E4M3_BFS_HI}(a));
}}
__device__ __forceinline__ void {ST_B32X2}(void* p, unsigned int lo, unsigned int hi) {{
  *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}}
__device__ __forceinline__ unsigned int {E4M3_LO}(unsigned int a) {{
  unsigned int d;
  asm("{{.reg .b16 l, h;\n mov.b32 {{l, h}}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;}}" : "=r"(d) : "r"(a));
  return d;
}}
__device__ __forceinline__ unsigned int {E4M3_HI}(unsigned int a) {{
  unsigned int d;
  asm("{{.reg .b16 l, h;\n mov.b32 {{l, h}}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;}}" : "=r"(d) : "r"(a));
  return d;
}}
#endif
"""
_WG_GUARD = "MOEC_CUDA_WGMMA_PRELUDE"

_CALLS = re.compile(r"\b(?:%s)\(" % "|".join((HFMA2, PACK_H2, H2_LO, H2_HI, E4M3_LO, E4M3_HI, PACK_BF2, E4M3_BF_LO, E4M3_BF_HI, E4M3_BFS_LO, E4M3_BFS_HI,
                                           ST_B32X2)))
_WG_CALLS = re.compile(r"\b(?:%s)\(" % "|".join([SMEM_U32, WG_DESC, WG_FENCE, WG_COMMIT, WG_WAIT0, WG_WAIT1, FENCE_ASYNC_SMEM]
                                                  + [wgmma_name(dt, n) for dt in WGMMA_TYPES for n in WGMMA_N]))
_HOOK = "tvm_callback_cuda_postproc"
_installed = False


def add_prelude(code: str) -> str:
    """``code`` with the helpers' definitions first when it calls one of them (once), else unchanged; the wgmma helpers
    (sm_90a only) likewise, apart, so that sources for other architectures never see them."""
    if _WG_GUARD not in code and _WG_CALLS.search(code):
        code = f"#ifndef {_WG_GUARD}\n#define {_WG_GUARD}\n{WGMMA_PRELUDE}#endif\n" + code
    if _GUARD in code or not _CALLS.search(code):
        return code
    return PRELUDE + code


def register() -> None:
    """Install the post-processing hook once per process (chaining a hook installed before it)."""
    global _installed
    if _installed:
        return
    import tvm_ffi

    previous = tvm_ffi.get_global_func(_HOOK, allow_missing=True)

    def postproc(code, target=None):
        if previous is not None:
            code = previous(code, target) if target is not None else previous(code)
        return add_prelude(str(code))

    tvm_ffi.register_global_func(_HOOK, postproc, override=True)
    _installed = True
