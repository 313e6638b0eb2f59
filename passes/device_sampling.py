"""AddGreedySampler: an ``argmax`` entry function that picks each row's greedy token on the device.

Expects the phase-1 entries (``decode`` returns ``logits[1, N, V]``, alone or first in a tuple).
Guarantees after: the module has one more entry, ``argmax(logits[1, n, V]) -> tokens[1, n]`` of the
dtype of ``decode``'s token ids (int64 for exported models; int32 otherwise), a single call of the
``argmax_rows`` kernel (``schedules/kernels/sampling.py``) over logits of the decode's dtype and
vocabulary. The runtime feeds it the logits a step left on the device, so greedy decoding copies n
token ids to the host rather than n x V floats, and a pipelined decode passes the tokens on to the
next step's ``decode`` without the host. Nothing else changes.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..compiler.errors import MoecError
from ..compiler.graph import OPAQUE
from ..schedules.kernels.sampling import make_argmax

ENTRY = "argmax"


def decode_logits(mod: tvm.IRModule, source: str = "model") -> relax.TensorType:
    """The type of the logits the ``decode`` entry returns."""
    if "decode" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise MoecError(f"{source}: AddGreedySampler needs the decode entry (run after the KV-cache pass)")
    ret = mod["decode"].ret_ty
    if isinstance(ret, relax.TupleType):
        ret = ret.fields[0]
    shape = getattr(ret, "shape", None)
    if not isinstance(ret, relax.TensorType) or shape is None or len(shape.values) != 3:
        raise MoecError(f"{source}: decode returns {ret}, not logits [1, N, V]")
    if not isinstance(shape.values[2], tirx.IntImm):
        raise MoecError(f"{source}: decode's logits have a symbolic vocabulary ({shape.values[2]})")
    return ret


@tvm.transform.module_pass(opt_level=0, name="AddGreedySampler")
class AddGreedySampler:
    def __init__(self, target: tvm.target.Target, source: str = "model") -> None:
        self.target, self.source = target, source

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        ret = decode_logits(mod, self.source)
        vocab, dtype = int(ret.shape.values[2]), ret.dtype
        ids = mod["decode"].params[0].ty
        out_dtype = ids.dtype if isinstance(ids, relax.TensorType) and ids.dtype in ("int32", "int64") else "int32"
        form = "cuda" if self.target.kind.name == "cuda" else "llvm"
        prim = make_argmax(vocab, dtype, form, out_dtype).without_attr("global_symbol").with_attr("op_pattern", OPAQUE)
        bb = relax.BlockBuilder(mod)
        n = tirx.Var("n", "int64")
        logits = relax.Var("logits", relax.TensorType((1, n, vocab), dtype))
        with bb.function(ENTRY, [logits]):
            with bb.dataflow():
                kernel = bb.add_func(prim, "argmax_rows")
                tokens = bb.emit_output(relax.call_tir(kernel, [logits], out_ty=relax.TensorType((1, n), out_dtype)))
            bb.emit_func_output(tokens)
        return bb.get()


__all__ = ["AddGreedySampler", "ENTRY", "decode_logits"]
