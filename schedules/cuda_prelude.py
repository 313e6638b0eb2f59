"""Device helpers for hand-written CUDA kernels, added to a generated CUDA source that calls them.

TVM's CUDA code generator splits every operation on a ``float16x2`` value into two scalar ``half``
operations, so TIR cannot ask for the paired instructions (``HFMA2``) directly. Kernels that need them
keep the pairs in ``uint32`` registers and call these helpers through ``T.call_pure_extern``; the
helpers are PTX, one instruction each (``fma.rn.f16x2``, ``cvt.rn.f16x2.f32``, ``cvt.f32.f16``;
sm_80 or newer; ``cvt.rn.f16x2.e4m3x2``, sm_89 or newer). Subnormal halves are kept, not flushed (no ``.ftz``).

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

_CALLS = re.compile(r"\b(?:%s)\(" % "|".join((HFMA2, PACK_H2, H2_LO, H2_HI, E4M3_LO, E4M3_HI)))
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
