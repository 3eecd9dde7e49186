"""Run a user's own Megatron-LM training script with the mok plugin injected.

    torchrun --nproc-per-node 8 -m megatron_mok.run /path/to/Megatron-LM/pretrain_gpt.py \\
        <the script's usual arguments> --moe-backend mok

The script runs unchanged as ``__main__``: its parser learns ``--moe-backend`` and the
``--mok-*`` knobs, and the MoE layers it builds use the chosen backend.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"error: training script not found: {argv[0]}", file=sys.stderr)
        raise SystemExit(2)
    from .adapter import install

    install()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # the script's sibling modules (gpt_builders, ...)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
