"""Does compute on the launch stream wait for expert copies in flight on a copy stream?

The offloaded-expert runtime copies experts (hundreds of MB, pinned host memory) on a non-blocking copy stream while
the compute stream (the legacy default stream TVM launches on) runs the layer. Between two layers the runtime also
uploads a small slot table from pageable host memory, reads the routed ids back, and launches kernels. This measures,
with torch only (no TVM), the host time of one such "layer" (a matmul of about a millisecond, then the small transfer
under test, then a read-back) with and without big copies queued on the copy stream:

  compute       the matmul and a 4-byte read-back only
  pageable_htod a pageable 256-byte upload (cuMemcpyHtoD, synchronous, as TVM's tensor upload) before the matmul
  pinned_htod   the same from pinned memory, asynchronous on the launch stream
  kernel_write  the table written by a kernel (a fill from a device scalar) instead of a copy

If a variant's time with copies queued is near the copies' own time, that transfer is serialised behind them (same
copy engine), and every layer that makes it waits for the prefetches issued before it.

  python3 bench/copy_overlap.py --json OUT.json --commit SHA        (on the GPU machine; torch with CUDA)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy-mb", type=int, default=352, help="bytes of one expert copy (a bf16 Mixtral-8x7B expert: 352)")
    ap.add_argument("--copies", type=int, default=4, help="copies queued before each timed layer")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import torch

    cu = ctypes.CDLL("libcuda.so.1")
    u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
    cu.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]
    cu.cuMemcpyHtoD_v2.argtypes = [u64, vp, sz]

    dev = torch.device("cuda")
    nbytes = args.copy_mb << 20
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()  # non-blocking with respect to the legacy default stream
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096 * 2, device=dev, dtype=torch.bfloat16)
    table = torch.zeros(64, dtype=torch.int32, device=dev)
    scalar = torch.ones((), dtype=torch.int32, device=dev)
    page = np.arange(64, dtype=np.int32)
    pinned = torch.arange(64, dtype=torch.int32).pin_memory()

    def copies(n: int) -> None:
        for _ in range(n):
            assert cu.cuMemcpyHtoDAsync_v2(dst.data_ptr(), host.data_ptr(), nbytes, side.cuda_stream) == 0

    def layer(kind: str) -> None:
        if kind == "pageable_htod":
            assert cu.cuMemcpyHtoD_v2(table.data_ptr(), page.ctypes.data, page.nbytes) == 0
        elif kind == "pinned_htod":
            assert cu.cuMemcpyHtoDAsync_v2(table.data_ptr(), pinned.data_ptr(), 256, 0) == 0
        elif kind == "kernel_write":
            table.fill_(scalar)
        c = a @ b
        c[0, :1].float().cpu()  # the read-back syncs the launch stream

    def timed(kind: str, queued: int) -> float:
        torch.cuda.synchronize()
        copies(queued)
        t = time.perf_counter()
        layer(kind)
        out = time.perf_counter() - t
        side.synchronize()
        return out * 1e3

    torch.cuda.synchronize()
    t = time.perf_counter()
    copies(args.copies)
    side.synchronize()
    copy_ms = (time.perf_counter() - t) * 1e3 / args.copies
    kinds = ["compute", "pageable_htod", "pinned_htod", "kernel_write"]
    for k in kinds:  # warm up
        timed(k, 0)
    rows = {}
    for k in kinds:
        idle = statistics.median(timed(k, 0) for _ in range(args.repeats))
        busy = statistics.median(timed(k, args.copies) for _ in range(args.repeats))
        rows[k] = {"idle_ms": round(idle, 3), "copies_queued_ms": round(busy, 3),
                   "serialised": busy > idle + 0.5 * copy_ms}
        print(f"{k:14s} idle {idle:8.3f} ms   with {args.copies} copies queued {busy:8.3f} ms", flush=True)
    out = {"benchmark": "copy_overlap", "command": " ".join(["python3", "bench/copy_overlap.py", *sys.argv[1:]]), "git_commit": args.commit,
           "device": torch.cuda.get_device_name(), "copy_mb": args.copy_mb, "copies_queued": args.copies,
           "copy_ms": round(copy_ms, 3), "copy_GBps": round(nbytes / copy_ms / 1e6, 2), "layers": rows}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
