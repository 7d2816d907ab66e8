"""Micro-benchmarks behind ``whalepy calibrate``: each returns plain rows (dicts of numbers).

Timing: on CUDA, CUDA events around each call after warm-up (the launch is inside the interval, as
it is when a training step runs the kernel); on CPU, ``time.perf_counter``. Every figure is the
median of ``repeats`` runs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, *, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one ``fn()``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_gemm(device: torch.device, dtype: torch.dtype, sizes: list[tuple[int, int, int]], repeats: int) -> list[dict]:
    rows = []
    for m, k, n in sizes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        s = time_call(lambda: a @ b, device, repeats=repeats)  # noqa: B023 - called before the next loop
        rows.append({"m": m, "k": k, "n": n, "s": s, "tflops": 2 * m * k * n / s / 1e12})
    return rows


def bench_attention(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int, int]],
                    repeats: int) -> list[dict]:
    """Causal SDPA ``(batch, heads, seq, head_dim)``: forward, and forward + backward."""
    rows = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd() -> Any:
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=True)  # noqa: B023

        def fwd_bwd() -> Any:
            sdpa(q, k, v, is_causal=True).sum().backward()  # noqa: B023

        rows.append({"batch": b, "heads": h, "seq": s, "head_dim": d,
                     "fwd_s": time_call(fwd, device, repeats=repeats),
                     "fwd_bwd_s": time_call(fwd_bwd, device, repeats=repeats)})
    return rows


def bench_memory(device: torch.device, numel: int, repeats: int) -> dict:
    """Bytes/s of a copy and of an add (read 2, write 1), fp32."""
    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    copy_s = time_call(lambda: y.copy_(x), device, repeats=repeats)
    add_s = time_call(lambda: torch.add(x, y, out=z), device, repeats=repeats)
    return {"numel": numel, "copy_GBps": 8 * numel / copy_s / 1e9, "add_GBps": 12 * numel / add_s / 1e9}


def bench_launch(device: torch.device, ops: int = 200, repeats: int = 5) -> float:
    """Seconds per kernel launch from eager PyTorch: a chain of tiny in-place adds."""
    x = torch.zeros(1, device=device)

    def chain() -> None:
        for _ in range(ops):
            x.add_(1.0)

    return time_call(chain, device, repeats=repeats) / ops


def bench_backward_launch(device: torch.device, ops: int = 200, repeats: int = 5) -> float:
    """Seconds per backward node from eager autograd: a chain of ``ops`` tiny multiplies, its backward
    timed as (forward + backward) - forward."""
    x = torch.ones(1, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = y * 1.0
        return y

    both = time_call(lambda: forward().backward(), device, repeats=repeats)
    fwd = time_call(forward, device, repeats=repeats)
    return max(0.0, both - fwd) / ops


def bench_adamw(device: torch.device, numel: int, repeats: int, **opt: Any) -> float:
    """Seconds of one AdamW step over ``numel`` fp32 parameters."""
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p)
    optim = torch.optim.AdamW([p], lr=1e-3, **opt)
    return time_call(optim.step, device, repeats=repeats, warmup=1)


def bench_host_link(device: torch.device, numel: int, repeats: int) -> dict:
    """Host <-> device GB/s, pinned and pageable (CUDA only)."""
    out = {}
    dev = torch.empty(numel, dtype=torch.uint8, device=device)
    for pinned in (True, False):
        host = torch.empty(numel, dtype=torch.uint8, pin_memory=pinned)
        h2d = time_call(lambda: dev.copy_(host, non_blocking=pinned), device, repeats=repeats)  # noqa: B023
        d2h = time_call(lambda: host.copy_(dev, non_blocking=pinned), device, repeats=repeats)  # noqa: B023
        out[f"h2d_{'pinned' if pinned else 'pageable'}_GBps"] = numel / h2d / 1e9
        out[f"d2h_{'pinned' if pinned else 'pageable'}_GBps"] = numel / d2h / 1e9
    return out


def bench_disk(nbytes: int, directory: str | None = None) -> dict:
    """Sequential write (with fsync) then read of ``nbytes`` in ``directory`` (the NVMe tier's path).
    The read may be served from the page cache when the file fits in host memory."""
    buf = os.urandom(min(nbytes, 64 << 20))
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as f:
        path = f.name
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < nbytes:
                f.write(buf)
                written += len(buf)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
        read_s = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return {"disk_write_GBps": written / write_s / 1e9, "disk_read_GBps": written / read_s / 1e9}


def bench_collectives(device: torch.device, sizes: list[int], repeats: int) -> list[dict]:
    """all-reduce / all-gather / reduce-scatter / send-recv over the default process group:
    seconds and bus bandwidth (NCCL-tests convention) per message size in bytes."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)
        x = torch.ones(numel, device=device)
        out = torch.empty(numel * world, device=device)
        shard = torch.empty(numel // world, device=device)
        ops = {
            "all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world),  # noqa: B023
            "all_gather": (lambda: dist.all_gather_into_tensor(out, x), (world - 1) / world),  # noqa: B023
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, x), (world - 1) / world),  # noqa: B023
        }

        def send_recv() -> None:
            if rank == 0:
                dist.send(x, 1)  # noqa: B023
            elif rank == 1:
                dist.recv(x, 0)  # noqa: B023

        ops["send_recv"] = (send_recv, 1.0)
        for name, (fn, factor) in ops.items():
            def synced(fn: Callable[[], Any] = fn) -> None:
                fn()
                dist.barrier()

            s = time_call(synced, device, repeats=repeats, warmup=1)
            size = 4 * numel
            rows.append({"op": name, "bytes": size, "s": s, "busbw_GBps": factor * size / s / 1e9})
    return rows
