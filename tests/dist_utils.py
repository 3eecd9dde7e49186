"""Run a test function on N CPU ranks (torch.multiprocessing spawn + gloo on localhost).

``run_distributed(fn, world_size)`` starts ``world_size`` fresh processes, initializes the default
gloo process group in each (free localhost port), calls ``fn(rank, world_size, *args, **kwargs)``
and returns the per-rank return values (rank order). If any rank raises, the parent raises
``DistributedTestFailure`` carrying every failing rank's exception text and traceback. A rank that
has not reported within ``timeout`` seconds (a hang, a deadlock in a collective) is killed and the
test fails instead of hanging CI. ``fn`` must be importable by the children (a module-level
function, or a ``functools.partial`` of one).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedTestFailure", "free_port", "run_distributed"]


class DistributedTestFailure(AssertionError):
    """One or more ranks raised, crashed or timed out. ``failures``: {rank: text}."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, result_queue, args, kwargs, collective_timeout_s, threads):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    initialized = False
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        initialized = True
        result = fn(rank, world_size, *args, **kwargs)
        payload = (rank, True, pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        payload = (rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    # Report before tearing down: a rank stuck in teardown must not hide the result.
    result_queue.put(payload)
    if initialized:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _run_once(fn, world_size, args, kwargs, timeout, collective_timeout_s, threads, fail_grace_s):
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        p = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, result_queue, args, kwargs, collective_timeout_s, threads),
            name=f"dist-test-rank{rank}",
        )
        p.start()
        procs.append(p)
    results: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    first_failure_at = None
    dead_since: dict[int, float] = {}
    try:
        while len(results) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure_at is not None and now > first_failure_at + fail_grace_s:
                break  # a rank failed; the others are probably blocked on it in a collective
            try:
                rank, ok, data = result_queue.get(timeout=0.1)
                results[rank] = (ok, data)
                if not ok and first_failure_at is None:
                    first_failure_at = time.monotonic()
                continue
            except queue_mod.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank in results or p.exitcode is None:
                    continue
                # Exited without a report (after a short grace for the queue's feeder thread).
                dead_since.setdefault(rank, now)
                if now - dead_since[rank] > 2.0:
                    results[rank] = (False, f"rank {rank} exited with code {p.exitcode} without reporting "
                                            "(crash / signal)")
                    if first_failure_at is None:
                        first_failure_at = now
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if len(results) == world_size else 0)
            if p.is_alive():
                p.kill()  # only the processes started above
            p.join(timeout=5)
        result_queue.close()

    failures: dict[int, str] = {}
    for rank in range(world_size):
        if rank not in results:
            what = "timed out" if first_failure_at is None else "did not finish after another rank failed"
            failures[rank] = f"rank {rank} {what} (killed; limit {timeout:.0f}s): hung, e.g. in a collective"
        elif not results[rank][0]:
            failures[rank] = results[rank][1]
    if failures:
        text = "\n".join(f"===== rank {r} =====\n{failures[r]}" for r in sorted(failures))
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))
        raise DistributedTestFailure(
            f"{len(failures)} of {world_size} ranks failed in {name}:\n{text}", failures
        )
    return [pickle.loads(results[r][1]) for r in range(world_size)]


def run_distributed(fn, world_size: int = 2, *, args=(), kwargs=None, timeout: float = 120.0,
                    collective_timeout_s: float | None = None, threads: int = 1,
                    fail_grace_s: float = 10.0):
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return the results.

    timeout: wall-clock seconds for the whole run (start-up included); ranks still running then are
        killed and the test fails. collective_timeout_s: gloo's own collective timeout (default:
        ``timeout`` minus a margin), so a rank blocked on a dead peer usually reports a traceback.
    fail_grace_s: after the first rank fails, how long the others get to report before being killed.
    """
    if collective_timeout_s is None:
        collective_timeout_s = max(5.0, timeout - 15.0)
    kwargs = kwargs or {}
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout, collective_timeout_s, threads, fail_grace_s)
        except DistributedTestFailure as exc:
            port_clash = any("address already in use" in t.lower() or "eaddrinuse" in t.lower()
                             for t in exc.failures.values())
            if not port_clash or attempt == 2:
                raise
    raise AssertionError("unreachable")
