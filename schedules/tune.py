"""MetaSchedule tuning of a model's fused TIR at static token/batch buckets (``moec tune``).

Tasks: the entries after phase 1 get their token/batch sizes bound to one bucket value (the symbolic
dims of the ``input_ids`` and ``logit_pos`` parameters), then go through phase 2 (``fusion_passes``);
every PrimFunc that comes out with static shapes and is not a hand-written kernel is a task, deduplicated
by structure across entries and buckets. Records go into the target's database directory
(``schedules.database``), in MetaSchedule's JSON format; ``moec_tuning.json`` there notes each finished
task and its trial count, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax, tirx

from ..compiler.errors import MoecError

BUCKET_PARAMS = ("input_ids", "logit_pos")  # entry parameters whose symbolic dims are the token/batch sizes


def bucket_vars(func: relax.Function) -> list:
    """The symbolic token/batch vars of an entry: the dims of its ``input_ids`` and ``logit_pos``."""
    found = []
    for p in func.params:
        if p.name in BUCKET_PARAMS and isinstance(p.ty, relax.TensorType) and p.ty.shape is not None:
            for d in p.ty.shape:
                for v in tirx.analysis.undefined_vars(d, []):
                    if not any(v.same_as(f) for f in found):
                        found.append(v)
    return found


def bucket_module(phase1: tvm.IRModule, entries: list[str], value: int, target: tvm.target.Target) -> tvm.IRModule:
    """``phase1`` with every entry's token/batch vars bound to ``value``, through phase 2."""
    from ..passes.pipeline import fusion_passes

    mod = phase1
    for name in entries:
        if name in [gv.name_hint for gv in mod.get_global_vars()]:
            vs = bucket_vars(mod[name])
            if vs:
                mod = relax.transform.BindSymbolicVars({v: value for v in vs}, name)(mod)
    with target:
        return tvm.transform.Sequential(fusion_passes(list(entries)))(mod)


def free_shape_vars(func: tirx.PrimFunc) -> list:
    """Symbolic vars of a PrimFunc's signature (buffer dims and scalar parameters)."""
    found = []
    for p in func.params:
        shape = getattr(p.ty, "shape", None)
        exprs = list(shape) if shape is not None else [p]
        for d in exprs:
            for v in tirx.analysis.undefined_vars(d, []) if not isinstance(d, tirx.Var) else [d]:
                if not any(v.same_as(f) for f in found):
                    found.append(v)
    return found


def task_module(func: tirx.PrimFunc) -> tvm.IRModule:
    """The workload MetaSchedule tunes and looks up for a PrimFunc (its own normalisation)."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(func.without_attr("global_symbol") if func.attrs and "global_symbol" in func.attrs else func)


def is_tunable(name: str, func) -> bool:
    from .rules import hand_kernel_source

    return isinstance(func, tirx.PrimFunc) and hand_kernel_source(name, func) is None and not free_shape_vars(func)


@dataclass
class Task:
    name: str  # the PrimFunc's name in the bucket module, with the bucket: fused_matmul_add4@16
    bucket: int
    mod: tvm.IRModule
    key: str  # structural hash of ``mod``


def extract_tasks(phase1: tvm.IRModule, entries: list[str], buckets: list[int], target: tvm.target.Target,
                  only: list[str] | None = None) -> list[Task]:
    """The tunable PrimFuncs at each bucket (deduplicated by structure); ``only``: name substrings to keep."""
    tasks, seen = [], set()
    for b in buckets:
        mod = bucket_module(phase1, entries, b, target)
        for gv, func in sorted(mod.functions_items(), key=lambda kv: kv[0].name_hint):
            if not is_tunable(gv.name_hint, func):
                continue
            if only and not any(s in gv.name_hint for s in only):
                continue
            tm = task_module(func)
            key = f"{tvm_ffi.structural_hash(tm) & 0xFFFFFFFFFFFFFFFF:016x}"
            if key in seen:
                continue
            seen.add(key)
            tasks.append(Task(f"{gv.name_hint}@{b}", b, tm, key))
    return tasks


def tuning_target(target: tvm.target.Target) -> tvm.target.Target:
    """The target MetaSchedule measures on: llvm needs its core count (``num-cores``) stated."""
    if target.kind.name == "llvm" and "num-cores" not in target.attrs:
        import psutil

        return tvm.target.Target(dict(target.export(), **{"num-cores": psutil.cpu_count(logical=False) or 1}))
    return target


def _import_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (MetaSchedule's TuneContext does) in ~2 s instead of ~20 s.

    It parses some 500 TVMScript functions, each calling ``inspect.stack()``, which reads the source of
    every frame and searches ``sys.modules`` for each: slow in a process that has torch loaded. The
    parser needs only the frames and their current line, so a stack built from those serves the import.
    """
    import inspect
    import linecache
    import sys

    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return

    def _stack(context: int = 1):
        out, frame = [], sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            line = linecache.getline(name, frame.f_lineno) if context > 0 else ""
            out.append(inspect.FrameInfo(frame, name, frame.f_lineno, frame.f_code.co_name, [line] if line else None,
                                         0 if line else None))
            frame = frame.f_back
        return out

    original, inspect.stack = inspect.stack, _stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = original


def _builder(workers: int):
    """``workers`` MetaSchedule builder processes, or 0: build in this process (no worker start-up per batch)."""
    from tvm.s_tir import meta_schedule as ms

    if workers > 0:
        return _pooled_builder(workers)
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import local_builder

    @derived_object
    class _InProcessBuilder(ms.builder.PyBuilder):
        def build(self, build_inputs):
            results = []
            from tvm.driver import build as tvm_build
            from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

            for b in build_inputs:
                try:  # default_build without its import of every tensor intrinsic (~20 s): the IR is scheduled already
                    rt_mod = tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(b.mod), target=b.target)
                    results.append(ms.builder.BuilderResult(local_builder.default_export(rt_mod), None))
                except Exception as exc:  # noqa: BLE001 - a candidate that does not build is a failed trial
                    results.append(ms.builder.BuilderResult(None, f"in-process build failed: {exc}"))
            return results

    return _InProcessBuilder()


POOL_BUILDS = 512  # builds before the worker pool is restarted (bounds the workers' memory growth)


def _pooled_builder(workers: int, timeout_s: float = 120.0):
    """A builder whose ``workers`` processes live across ``build`` calls.

    MetaSchedule's LocalBuilder starts a fresh process pool for every batch; each worker then imports TVM
    and its tensor intrinsics again (17 s per trial here, 36 s per task on the GPU machine, most of a
    tuning session). This one keeps its pool and restarts it every ``POOL_BUILDS`` builds."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder import local_builder
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    @derived_object
    class _PooledBuilder(ms.builder.PyBuilder):
        def __init__(self):
            super().__init__()
            self.pool, self.used = None, 0

        def build(self, build_inputs):
            if self.pool is None or self.used >= POOL_BUILDS:
                if self.pool is not None:
                    self.pool.shutdown()
                self.pool, self.used = PopenPoolExecutor(max_workers=workers, timeout=timeout_s), 0
            self.used += len(build_inputs)
            args = [(None, None, b.mod, b.target, local_builder._serialize_params(b.params)) for b in build_inputs]
            results = []
            for r in self.pool.map_with_error_catching(lambda x: local_builder._worker_func(*x), args):
                if r.status == StatusKind.COMPLETE:
                    results.append(ms.builder.BuilderResult(r.value, None))
                elif r.status == StatusKind.TIMEOUT:
                    results.append(ms.builder.BuilderResult(None, f"build timed out after {timeout_s} s"))
                else:
                    results.append(ms.builder.BuilderResult(None, f"build failed: {r.value}"))
            return results

    return _PooledBuilder()


def _cost_model() -> str:
    try:
        import xgboost  # noqa: F401
    except ImportError:
        return "random"
    return "xgb"


def run_tasks(tasks: list[Task], target: tvm.target.Target, directory: Path, trials: int, workers: int = 1,
              progress: bool = True, strategy: str = "evolutionary") -> dict:
    """Tune each task for ``trials`` trials into the database at ``directory``, skipping finished ones.

    One MetaSchedule run over the pending tasks (round-robin, one builder and runner pool); a measure
    callback advances the progress bar and notes each task in ``moec_tuning.json`` as it completes.
    """
    from tqdm import tqdm
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    from .database import finish_task, open_database, read_meta

    if strategy not in ("evolutionary", "replay-trace"):
        raise MoecError(f"bad search strategy {strategy!r}: expected evolutionary or replay-trace")
    db = open_database(directory, target, create=True)
    ms_target = tuning_target(target)
    _import_tensor_intrinsics()
    done = read_meta(directory).get("tasks", {})
    pending = [t for t in tasks if done.get(t.key, {}).get("trials", 0) < trials]
    stats = {"tasks": len(tasks), "skipped": len(tasks) - len(pending), "tuned": 0, "trials": 0, "seconds": 0.0}
    if not pending:
        return stats
    t0 = time.perf_counter()
    # the rules' own schedule of each task, measured as the trials are, is one more record: the database's best
    # record for a task is then never slower than what the rules compile (tuning cannot make a kernel worse)
    builder = _builder(workers)
    runner = ms.runner.LocalRunner(ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0))  # one worker pool
    errors = {}
    for t in tqdm(pending, desc="[moec] rules baseline", unit="task", disable=not progress, dynamic_ncols=True):
        why = _commit_rules_baseline(db, t, target, ms_target, builder, runner)
        if why:
            errors[t.name] = why
    stats["baselines"] = len(pending) - len(errors)
    if errors:
        stats["baseline_errors"] = errors
        if progress:
            name, why = next(iter(errors.items()))
            print(f"[moec] the rules' schedule of {len(errors)} of {len(pending)} tasks was not measured "
                  f"(left to the trials); first, {name}: {why}", flush=True)
    before = {t.key: _records_of(db, t.mod) for t in pending}
    bar = tqdm(total=len(pending) * trials, desc="[moec] tune", unit="trial", disable=not progress, dynamic_ncols=True)
    measured = [0] * len(pending)
    finished = set()

    def finish(i: int) -> None:
        if i not in finished:
            finished.add(i)
            t = pending[i]
            finish_task(directory, t.key, t.name, t.bucket, trials, _records_of(db, t.mod))

    @derived_object
    class _Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            task_id = int(task_id)
            measured[task_id] += len(measure_candidates)
            bar.update(len(measure_candidates))
            bar.set_postfix_str(f"{pending[task_id].name[-40:]} ({len(finished)}/{len(pending)} tasks done)")
            if measured[task_id] >= trials:
                finish(task_id)  # its records are in the database already (AddToDatabase runs first)

    contexts = [ms.TuneContext(mod=t.mod, target=ms_target, space_generator="post-order-apply", search_strategy=strategy,
                               task_name=t.name, num_threads=1, rand_state=i) for i, t in enumerate(pending)]
    try:
        ms.tune_tasks(tasks=contexts, task_weights=[1.0] * len(contexts), work_dir=str(directory / "logs"),
                      max_trials_global=trials * len(contexts), max_trials_per_task=trials,
                      num_trials_per_iter=min(trials, 64), builder=builder, runner=runner,
                      database=db, cost_model=_cost_model(), task_scheduler="round-robin",
                      measure_callbacks=list(ms.measure_callback.MeasureCallback.create("default")) + [_Progress()])
        for i in range(len(pending)):  # tasks whose design space ran out before ``trials`` are done too
            finish(i)
    finally:
        bar.close()
    stats["tuned"] = len(finished)
    stats["trials"] = sum(_records_of(db, t.mod) - before[t.key] for t in pending)
    stats["seconds"] = time.perf_counter() - t0
    return stats


def rules_schedule(mod: tvm.IRModule, target: tvm.target.Target):
    """The schedule the rules give a task's ``main`` (a traced ``s_tir.Schedule``; llvm: the function as it is)."""
    from tvm import s_tir

    from .rules import SCHEDULE_RULES

    with target:
        for rule in SCHEDULE_RULES[target.kind.name]():
            space = rule.apply(mod["main"], target, False)
            if space is not None:
                return space if isinstance(space, s_tir.Schedule) else space[0]
    return s_tir.Schedule(mod)


def _commit_rules_baseline(db, task: "Task", target: tvm.target.Target, ms_target, builder, runner) -> str | None:
    """Measure the rules' schedule of ``task`` and commit it as a record; None, or why it could not be built or run."""
    from tvm.s_tir import meta_schedule as ms

    try:
        sch = rules_schedule(task.mod, target)
        args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
        (built,) = builder.build([ms.builder.BuilderInput(sch.mod, ms_target)])
        if built.error_msg:
            return f"build failed: {built.error_msg.strip().splitlines()[-1][:300]}"
        device = "cpu" if ms_target.kind.name == "llvm" else ms_target.kind.name
        (future,) = runner.run([ms.runner.RunnerInput(built.artifact_path, device, args)])
        result = future.result()
        if result.error_msg or not result.run_secs:
            return f"run failed: {(result.error_msg or 'no time measured').strip().splitlines()[-1][:300]}"
        workload = db.commit_workload(task.mod)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, result.run_secs, ms_target, args))
        return None
    except Exception as exc:  # noqa: BLE001 - a task whose rule schedule does not replay is left to the tuned records
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"


def _records_of(db, mod) -> int:
    if not db.has_workload(mod):
        return 0
    return len(db.get_top_k(db.commit_workload(mod), 1 << 30))


def parse_buckets(text: str | list | tuple) -> list[int]:
    items = text if isinstance(text, (list, tuple)) else [x for x in re.split(r"[,\s]+", str(text)) if x]
    try:
        values = sorted({int(x) for x in items})
    except (TypeError, ValueError):
        raise MoecError(f"bad buckets {text!r}: expected positive integers, e.g. 1,16,128") from None
    if not values or values[0] < 1:
        raise MoecError(f"bad buckets {text!r}: expected positive integers, e.g. 1,16,128")
    return values


def tune(model, target: str = "llvm", arch: str | None = None, trials: int = 64, buckets="1,16,128",
         database: str | Path | None = None, workers: int = 1, only: list[str] | None = None, dry_run: bool = False,
         strategy: str = "evolutionary", progress: bool = False, **compile_options) -> dict:
    """Tune a model's kernels with MetaSchedule into the target's database.

    Parameters
    ----------
    model : str | Path | ImportedModel
        What ``moec.compile`` takes; ``compile_options`` (kv_cache, cascade_groups, ...) must be the ones
        the model will be compiled with: they change the kernels.
    target, arch : as for ``moec.compile``.
    trials : int
        MetaSchedule trials per task. A task already tuned with at least this many is skipped.
    buckets : str | list[int]
        Static token/batch sizes to tune at (prefill tokens, decode batch): "1,16,128".
    database : str | Path, optional
        Database directory (default: ``<moec cache>/tuning/<target key>/``).
    workers : int
        MetaSchedule builder processes; 0 builds in this process (no process start-up per batch: much
        faster for few trials; a candidate that crashes the compiler takes the run down with it).
    only : list[str], optional
        Tune only the tasks whose kernel name contains one of these strings.
    strategy : {"evolutionary", "replay-trace"}
        MetaSchedule's search: evolutionary (with a cost model) or random samples of the design space.
    dry_run : bool
        Extract the tasks (e.g. for cuda on a machine without a GPU) and tune nothing.

    Returns
    -------
    dict with the database directory, the tasks, and counts of skipped / tuned tasks and new trials.
    """
    from ..compiler.build import compile as moec_compile
    from .database import default_db_dir, note_buckets, open_database, target_key

    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise MoecError(f"bad trials {trials!r}: expected a positive integer")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise MoecError(f"bad workers {workers!r}: expected 0 (build in this process) or more builder processes")
    values = parse_buckets(buckets)
    phase1, entries, tgt = moec_compile(model, None, target=target, arch=arch, _until_phase1=True, **compile_options)
    directory = Path(database).expanduser() if database is not None else default_db_dir(tgt)
    t0 = time.perf_counter()
    tasks = extract_tasks(phase1, entries, values, tgt, only)
    result = {"database": str(directory), "target_key": target_key(tgt), "buckets": values,
              "tasks": [t.name for t in tasks], "extract_seconds": time.perf_counter() - t0}
    if progress:
        print(f"[moec] {len(tasks)} tasks at buckets {','.join(map(str, values))} for {target_key(tgt)} "
              f"in {result['extract_seconds']:.1f}s; database {directory}", flush=True)
    if dry_run:
        if directory.exists():
            open_database(directory, tgt)  # still refuse another target's directory
        return dict(result, skipped=0, tuned=0, trials=0, seconds=0.0)
    open_database(directory, tgt, create=True)
    note_buckets(directory, values)
    stats = run_tasks(tasks, tgt, directory, trials, workers, progress, strategy)
    return dict(result, **{k: v for k, v in stats.items() if k != "tasks"})
