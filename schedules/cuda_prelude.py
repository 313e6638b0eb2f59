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

_CALLS = re.compile(r"\b(?:%s)\(" % "|".join((HFMA2, PACK_H2, H2_LO, H2_HI, E4M3_LO, E4M3_HI, PACK_BF2, E4M3_BF_LO, E4M3_BF_HI, E4M3_BFS_LO, E4M3_BFS_HI,
                                           ST_B32X2)))
_HOOK = "tvm_callback_cuda_postproc"
_installed = False


def add_prelude(code: str) -> str:
    """``code`` with the helpers' definitions first when it calls one of them (once), else unchanged."""
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
