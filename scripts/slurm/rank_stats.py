"""Run one training rank and report its peak memory when it exits.

Usage (what scripts/slurm/launch_rank.sh and scripts/compare_backends.py do):

    python scripts/slurm/rank_stats.py -m megatron_mok.pretrain_gpt ARGS...
    python scripts/slurm/rank_stats.py path/to/script.py ARGS...

The module or script runs in this process exactly as under ``python -m`` / ``python script.py``.
At exit (normal end, exception or sys.exit) one line goes to stderr::

    [mok-stats] rank=0 local_rank=0 host=node1 pid=123 exit=0 peak_rss_mib=2345.6 \
        cuda_max_allocated_mib=NA cuda_max_reserved_mib=NA

``peak_rss_mib`` is this process's max resident set size (getrusage); the CUDA numbers are
``torch.cuda.max_memory_allocated/reserved`` of the current device when CUDA was used. The line is
parsed by megatron_mok.tools.logparse. Set MOK_RANK_STATS=0 in the launchers to bypass this wrapper.
"""

from __future__ import annotations

import atexit
import os
import resource
import runpy
import socket
import sys

_state = {"exit": "exception"}


def _fmt(v):
    return "NA" if v is None else f"{v:.1f}"


def _report() -> None:
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    alloc = reserved = None
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                alloc = torch.cuda.max_memory_allocated() / 2**20
                reserved = torch.cuda.max_memory_reserved() / 2**20
        except Exception:  # a broken CUDA context must not hide the training's own error
            pass
    line = (
        f"[mok-stats] rank={os.environ.get('RANK', '?')} "
        f"local_rank={os.environ.get('LOCAL_RANK', '?')} host={socket.gethostname()} "
        f"pid={os.getpid()} exit={_state['exit']} peak_rss_mib={_fmt(rss_mib)} "
        f"cuda_max_allocated_mib={_fmt(alloc)} cuda_max_reserved_mib={_fmt(reserved)}"
    )
    try:
        print(line, file=sys.stderr, flush=True)
    except Exception:
        pass


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: rank_stats.py -m MODULE [ARGS...] | SCRIPT [ARGS...]")
    atexit.register(_report)
    try:
        if argv[0] == "-m":
            if len(argv) < 2:
                sys.exit("rank_stats.py: -m needs a module name")
            mod = argv[1]
            sys.argv = [mod] + argv[2:]
            # Same code path as `python -m MODULE` (sets __main__, sys.argv[0], sys.path[0]).
            sys.path[0] = os.getcwd()
            runner = getattr(runpy, "_run_module_as_main", None)
            if runner is not None:
                runner(mod, alter_argv=True)
            else:
                runpy.run_module(mod, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        _state["exit"] = 0
    except SystemExit as e:
        code = e.code
        _state["exit"] = 0 if code is None else (code if isinstance(code, int) else 1)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
