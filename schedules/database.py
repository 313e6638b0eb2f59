"""Tuning databases, one directory per target, and applying their records at compile time.

A directory holds MetaSchedule's ``database_workload.json`` and ``database_tuning_record.json``
(``JSONDatabase``) plus ``moec_tuning.json``: the target it was tuned for (its key and
``target.export()``), the token/batch buckets and the finished tasks. MetaSchedule's lookup ignores
the target, so a directory of another target is refused here, by name.

``TunedSchedules`` applies a database in phase 3: the compiled entries have dynamic token/batch sizes,
the records static ones, so for each bucket the phase-1 entries are bound to it and fused again; call
sites pair up in order, and each call whose static twin has a record gets the tuned kernel behind a
``R.If`` on the call's sizes (the dynamic kernel, scheduled by the rules, stays for all other sizes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax, tirx

from ..compiler.errors import MoecError

META = "moec_tuning.json"
WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


def _target_doc(target: tvm.target.Target) -> dict:
    from ..compiler.build import _jsonable

    return _jsonable(target.export())


def target_key(target: tvm.target.Target) -> str:
    """``<kind>[-<arch>]-<hash of target.export()>``, e.g. ``cuda-sm_90-1a2b3c4d``."""
    doc = json.dumps(_target_doc(target), sort_keys=True)
    arch = f"-{target.arch}" if target.kind.name == "cuda" else ""
    return f"{target.kind.name}{arch}-{hashlib.sha256(doc.encode()).hexdigest()[:8]}"


def default_db_dir(target: tvm.target.Target) -> Path:
    """``<moec cache>/tuning/<target key>`` (the cache is ``$MOEC_CACHE`` or ``~/.cache/moec``)."""
    from ..models.corpus import cache_root

    return cache_root() / "tuning" / target_key(target)


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MoecError(f"{path}: corrupt tuning database metadata ({exc})") from None


def _write_meta(directory: Path, meta: dict) -> None:
    tmp = directory / f".{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, directory / META)


def open_database(directory: str | Path, target: tvm.target.Target, create: bool = False):
    """The ``JSONDatabase`` at ``directory`` for ``target``; another target's directory is refused."""
    from tvm.s_tir import meta_schedule as ms

    directory = Path(directory)
    key = target_key(target)
    if not directory.is_dir():
        if not create:
            raise MoecError(f"tuning database {directory}: no such directory")
        directory.mkdir(parents=True)
    meta = read_meta(directory)
    if meta and meta.get("target_key") != key:
        raise MoecError(f"tuning database {directory} was tuned for target {meta.get('target_key')}, not {key} "
                        f"(one database per target: tune this target into its own directory)")
    has_db = (directory / WORKLOADS).is_file()
    if not meta and not has_db and not create:
        raise MoecError(f"tuning database {directory}: not a tuning database (no {META} or {WORKLOADS})")
    db = ms.database.JSONDatabase(str(directory / WORKLOADS), str(directory / RECORDS), allow_missing=create)
    if not meta:
        for rec in db.get_all_tuning_records()[:1]:  # a bare MetaSchedule database: check its records' target
            kind = rec.target.kind.name
            arch = rec.target.arch if kind == "cuda" else None
            if kind != target.kind.name or (arch is not None and arch != target.arch):
                raise MoecError(f"tuning database {directory} holds records for {kind}{' ' + arch if arch else ''}, "
                                f"not {target.kind.name}{' ' + target.arch if target.kind.name == 'cuda' else ''}")
        if create:
            _write_meta(directory, {"target_key": key, "target": _target_doc(target), "buckets": [], "tasks": {}})
    return db


def note_buckets(directory: Path, buckets: list[int]) -> None:
    meta = read_meta(directory)
    meta["buckets"] = sorted(set(meta.get("buckets", [])) | set(buckets))
    _write_meta(directory, meta)


def finish_task(directory: Path, key: str, name: str, bucket: int, trials: int, records: int) -> None:
    meta = read_meta(directory)
    prev = meta.setdefault("tasks", {}).get(key, {})
    meta["tasks"][key] = {"name": name, "bucket": bucket, "trials": max(trials, prev.get("trials", 0)), "records": records}
    _write_meta(directory, meta)


def resolve_tuning_db(spec: str | Path | None, target: tvm.target.Target) -> Path | None:
    """``"auto"``: the target's default database if there is one; ``"none"``/None: none; else a directory."""
    if spec is None or str(spec) == "none":
        return None
    if str(spec) == "auto":
        d = default_db_dir(target)
        return d if (d / META).is_file() else None
    d = Path(spec).expanduser()
    open_database(d, target)  # refuses a missing directory or another target's, by name
    return d


def _call_sites(func: relax.Function) -> list[tuple[str, relax.Call]]:
    """``(key, call)`` of every call_tir binding in order; key ``<callee>#<k>``: its k-th call of that callee."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    sites, seen = [], {}
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Call) and b.value.op.same_as(call_tir):
                callee = b.value.args[0].name_hint
                seen[callee] = seen.get(callee, 0) + 1
                sites.append((f"{callee}#{seen[callee] - 1}", b.value))
    return sites


def _op_key(name: str) -> str:
    return re.sub(r"\d+", "", name)


def _pair_sites(dyn: relax.Function, static: relax.Function) -> list:
    """Call sites of an entry and of its bucket-bound twin that compute the same operator.

    Static shapes fuse some reshapes that dynamic ones leave apart, so the sequences differ in places:
    they are aligned on the kernels' operator names (numbering dropped) and only equal runs pair up.
    """
    import difflib

    a, b = _call_sites(dyn), _call_sites(static)
    keys_a = [_op_key(c.args[0].name_hint) for _, c in a]
    keys_b = [_op_key(c.args[0].name_hint) for _, c in b]
    pairs = []
    for m in difflib.SequenceMatcher(a=keys_a, b=keys_b, autojunk=False).get_matching_blocks():
        pairs += [(a[m.a + k], b[m.b + k]) for k in range(m.size)]
    return pairs


def _same_signature(dcall: relax.Call, scall: relax.Call, bound: list, value: int) -> bool:
    """The two calls take and return tensors of the same dtypes and, with ``bound`` = ``value``, shapes."""
    def types(call):
        out = [a.ty for a in call.args[1].fields]
        ret = call.ty
        return out + (list(ret.fields) if isinstance(ret, relax.TupleType) else [ret])

    ta, tb = types(dcall), types(scall)
    if len(ta) != len(tb) or len(dcall.args) != len(scall.args) and len(scall.args) > 2:
        return False
    from tvm.sym.analyzer import Analyzer

    analyzer = Analyzer()
    for v in bound:
        analyzer.bind(v, tirx.IntImm(str(v.ty.dtype), value))
    for x, y in zip(ta, tb):
        if not (isinstance(x, relax.TensorType) and isinstance(y, relax.TensorType)) or x.dtype != y.dtype:
            return False
        if x.shape is None or y.shape is None or len(x.shape) != len(y.shape):
            return False
        for dx, dy in zip(x.shape, y.shape):
            if not analyzer.can_prove(tirx.EQ(dx, dy)):
                return False
    return True


def _site_vars(call: relax.Call) -> list:
    found = []
    types = [a.ty for a in call.args[1].fields] + [call.ty]
    while types:
        t = types.pop()
        if isinstance(t, relax.TupleType):
            types += list(t.fields)
        elif isinstance(t, relax.TensorType) and t.shape is not None:
            for d in t.shape:
                for v in tirx.analysis.undefined_vars(d, []):
                    if not any(v.same_as(f) for f in found):
                        found.append(v)
    return found


class TunedSchedules:
    """Applies one tuning database in phase 3 (see the module docstring); the pipeline drives it."""

    def __init__(self, directory: str | Path, target: tvm.target.Target):
        self.directory = Path(directory)
        self.target = target
        self.database = open_database(self.directory, target)
        self.buckets = [int(b) for b in read_meta(self.directory).get("buckets", [])]
        self.phase1 = None
        self.entries: list[str] = []
        self.sources: dict[str, str] = {}  # tuned PrimFunc -> "tuning-db:<task>"
        self.dispatched: dict[str, list[int]] = {}  # dynamic PrimFunc -> buckets it has tuned twins for
        self.plan: dict[tuple[str, str], list] = {}  # (entry, "<callee>#<k>") -> [(vars, bucket, tuned gv, #args)]
        self.call_sites = 0

    def capture(self, entries: list[str]) -> tvm.transform.Pass:
        self.entries = list(entries)

        @tvm.transform.module_pass(opt_level=0, name="CapturePhase1")
        def _capture(mod, _ctx):
            self.phase1 = mod
            return mod

        return _capture

    def add_tuned(self, mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
        """Add the tuned static kernels of every bucket and plan their dispatch; returns the module."""
        from .rules import hand_kernel_source, is_scheduled
        from .tune import bucket_module, bucket_vars, is_tunable, task_module

        if self.phase1 is None or not self.buckets:
            return mod
        names = {gv.name_hint for gv in mod.get_global_vars()}
        bb = relax.BlockBuilder(mod)
        tuned: dict[str, tvm.ir.GlobalVar] = {}  # workload hash -> tuned kernel in the module
        for b in self.buckets:
            static = bucket_module(self.phase1, self.entries, b, target)
            for entry in self.entries:
                if entry not in names or not isinstance(mod[entry], relax.Function):
                    continue
                bound = bucket_vars(mod[entry])
                for (site, dcall), (_, scall) in _pair_sites(mod[entry], static[entry]):
                    dname, sname = dcall.args[0].name_hint, scall.args[0].name_hint
                    dfunc, sfunc = mod[dcall.args[0]], static[scall.args[0]]
                    if hand_kernel_source(dname, dfunc) is not None or is_scheduled(dfunc) or not is_tunable(sname, sfunc):
                        continue
                    if relax.analysis.has_reshape_pattern(dfunc):
                        continue  # phase 4 turns these calls into views (RewriteDataflowReshape): nothing to run
                    if not _same_signature(dcall, scall, bound, b):
                        continue
                    svars = _site_vars(dcall)
                    if not all(any(v.same_as(u) for u in bound) for v in svars):
                        continue  # sizes other than the token/batch ones: not covered by the buckets
                    tm = task_module(sfunc)
                    wkey = f"{tvm_ffi.structural_hash(tm) & 0xFFFFFFFFFFFFFFFF:016x}"
                    if wkey not in tuned:
                        sch = self.database.query_schedule(tm, target, "main")
                        if sch is None:
                            continue
                        func = sch.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True)
                        gv = bb.add_func(func, f"{dname}_tuned_b{b}")
                        tuned[wkey] = gv
                        self.sources[gv.name_hint] = f"tuning-db:{self.directory} ({sname} at token/batch {b})"
                    self.plan.setdefault((entry, site), []).append((svars, b, tuned[wkey], len(dcall.args[1].fields)))
                    self.dispatched.setdefault(dname, [])
                    if b not in self.dispatched[dname]:
                        self.dispatched[dname].append(b)
        return bb.get()

    def dispatch(self, mod: tvm.IRModule) -> tvm.IRModule:
        """Route each planned call to its tuned kernels when its sizes match a bucket (after the rules)."""
        if not self.plan:
            return mod
        mod = relax.transform.RewriteDataflowReshape()(mod)
        mod = relax.transform.ToNonDataflow()(mod)
        plan = self.plan
        owner = self

        @relax.expr_functor.mutator
        class _Dispatch(relax.PyExprMutator):
            def __init__(self, mod, entry):
                super().__init__(mod)
                self.entry = entry
                self.seen = {}

            def visit_var_binding_(self, binding):
                value = binding.value
                if not isinstance(value, relax.Call) or not value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
                    return super().visit_var_binding_(binding)
                callee = value.args[0].name_hint
                self.seen[callee] = self.seen.get(callee, 0) + 1
                options = plan.get((self.entry, f"{callee}#{self.seen[callee] - 1}"))
                if not options or any(n != len(value.args[1].fields) for *_, n in options):
                    return super().visit_var_binding_(binding)
                args = self.visit_expr(value.args[1])
                out = value.ty if isinstance(value.ty, relax.TensorType) else list(value.ty.fields)
                expr = relax.Call(value.op, [value.args[0], args, *value.args[2:]], value.attrs, value.ty_args)
                for svars, b, gv, _ in reversed(options):
                    tuned = relax.call_tir(gv, args, out_ty=out)
                    if not svars:
                        expr = tuned
                        continue
                    cond = None
                    for v in svars:
                        eq = tirx.EQ(v, tirx.IntImm(str(v.ty.dtype), b))
                        cond = eq if cond is None else tirx.And(cond, eq)
                    expr = relax.If(relax.prim_value(cond), relax.SeqExpr([], tuned), relax.SeqExpr([], expr))
                new = self.builder_.emit(expr, name_hint=binding.var.name)
                if isinstance(expr, relax.If):
                    # the If's type is the join of its branches'; a later pass that re-normalises it may see the tuned
                    # branch at the bucket's static shape and drop the call's symbolic one (a workspace that an in-place
                    # call then mutates must keep it: seen on CUDA at bucket 128), so the result is always cast back
                    new = self.builder_.match_cast(new, value.ty, name_hint=binding.var.name)
                self.set_var_remap(binding.var, new)
                owner.call_sites += 1

        for entry in sorted({e for e, _ in plan}):
            mod[entry] = _Dispatch(mod, entry).visit_expr(mod[entry])
        return relax.transform.DeadCodeElimination(self.entries)(mod)

    def manifest(self) -> dict:
        return {"database": str(self.directory), "target_key": target_key(self.target), "buckets": self.buckets,
                "applied": len(self.sources), "tuned_kernels": sorted(self.sources),
                "dispatched_call_sites": self.call_sites, "dispatched": dict(sorted(self.dispatched.items()))}
