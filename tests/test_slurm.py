"""scripts/slurm/train.sbatch under a REAL Slurm (slurmctld + slurmd on localhost).

* Argument checks (no Slurm needed): `train.sbatch --dry-run` must fail fast with a clear message.
* `@pytest.mark.slurm`: scripts/slurm/ci_start_slurm.sh installs Debian's slurm-wlm + munge when
  missing and starts munged, slurmctld and slurmd (1 node, the host's CPUs). The tiny CPU config
  then trains with `--moe-backend mok` on 2 gloo ranks; after its first checkpoint the job is
  requeued with `scontrol requeue`, and the second attempt must load that checkpoint and continue.
  Skips only when not root or when Slurm is missing and apt-get is unavailable; a Slurm that does
  not start is a test FAILURE with the daemons' log tails.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
START = REPO / "scripts" / "slurm" / "ci_start_slurm.sh"
TINY = REPO / "configs" / "deepseek-v3-tiny.args"

sys.path.insert(0, str(REPO))
from megatron_mok import logparse  # noqa: E402


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOK_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def _dry_run(*args, **env):
    return subprocess.run(["bash", str(SBATCH), "--dry-run", *args], cwd=REPO, env=_clean_env(**env),
                          capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------------- argument checks


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "tiny.args"
    p.write_text("--num-layers 2  # a comment\n--moe-layer-freq ([0]*1+[1]*1)\n--seq-length 64\n")
    return p


def test_dry_run_ok_prints_plan(cfg, tmp_path):
    r = _dry_run(str(cfg), "mok", "1", "2", "--", "--train-iters", "7",
                 SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES="1", SLURM_CPUS_ON_NODE="4",
                 SLURM_JOB_NAME="ci", MOK_RUNS_ROOT=str(tmp_path / "runs"), MOK_PYTHON=sys.executable)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "arguments OK" in out
    assert "device=cpu nodes=1 ranks_per_node=2 world_size=2 cpus_per_rank=2" in out
    run_dir = tmp_path / "runs" / "ci-tiny-mok-42"
    assert f"run_dir={run_dir}" in out
    cmd = out.split("command=", 1)[1]
    assert "--ntasks=2" in cmd and "--ntasks-per-node=2" in cmd
    # config words stay literal (no globbing), our defaults come before the user's extra args
    assert r"\(\[0\]\*1+\[1\]\*1\)" in cmd
    assert f"--save {run_dir}/checkpoints --load {run_dir}/checkpoints" in cmd
    assert cmd.index("--moe-backend mok") < cmd.index("--train-iters 7")
    assert "--save-interval 500" in cmd


def test_placeholder_config_accepts_data_path_override(tmp_path):
    full = tmp_path / "full.args"
    full.write_text("--num-layers 61\n--data-path REPLACE_WITH_YOUR_DATA_PREFIX\n")
    r = _dry_run(str(full), "alltoall", "--", "--data-path", "/data/x_text_document",
                 SLURM_CPUS_ON_NODE="2", MOK_PYTHON=sys.executable)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("command=", 1)[1].rstrip().endswith("--data-path /data/x_text_document")


def test_dry_run_env_vars_instead_of_positionals(cfg):
    r = _dry_run(MOK_CONFIG=str(cfg), MOK_BACKEND="alltoall", MOK_GPUS_PER_NODE="2",
                 SLURM_CPUS_ON_NODE="2", MOK_PYTHON=sys.executable)
    assert r.returncode == 0, r.stderr
    assert "backend=alltoall" in r.stdout and "world_size=2" in r.stdout


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((), {}, "missing CONFIG"),
        (("{cfg}",), {}, "missing BACKEND"),
        (("/nonexistent/x.args", "mok"), {}, "config file not found: '/nonexistent/x.args'"),
        (("{cfg}", "nccl"), {}, "unknown backend 'nccl': expected one of: mok, alltoall, allgather, hybridep, deepep"),
        (("{cfg}", "mok", "2"), {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1"},
         "NODES=2 but the allocation has only 1 node(s)"),
        (("{cfg}", "mok", "1", "4"), {"SLURM_CPUS_ON_NODE": "2"},
         "GPUS_PER_NODE=4 ranks per node but the allocation provides only 2 CPU(s) per node"),
        (("{cfg}", "hybridep", "1", "8"), {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_CPUS_ON_NODE": "64"},
         "GPUS_PER_NODE=8 ranks per node but the allocation provides only 2 GPU(s) per node"),
        (("{cfg}", "mok"), {"MOK_PYTHON": "/nonexistent/python"}, "python interpreter not found"),
        (("{placeholder}", "mok"), {}, "has the placeholder 'REPLACE_WITH_YOUR_DATA_PREFIX'"),
    ],
)
def test_bad_arguments_fail_fast(cfg, tmp_path, args, env, message):
    placeholder = tmp_path / "full.args"
    placeholder.write_text("--num-layers 61\n--data-path REPLACE_WITH_YOUR_DATA_PREFIX\n")
    args = [a.format(cfg=cfg, placeholder=placeholder) for a in args]
    env.setdefault("MOK_PYTHON", sys.executable)
    t0 = time.time()
    r = _dry_run(*args, **env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert "ERROR" in r.stderr
    assert time.time() - t0 < 10


def test_outside_slurm_without_dry_run_refuses(cfg):
    r = subprocess.run(["bash", str(SBATCH), str(cfg), "mok"], cwd=REPO,
                       env=_clean_env(MOK_PYTHON=sys.executable), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "not inside a Slurm job" in r.stderr


# --------------------------------------------------------------------------- real Slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the Slurm test starts slurmctld/slurmd as root: not root")
    have = all(shutil.which(x) for x in ("slurmctld", "slurmd", "sbatch", "munged"))
    if not have and not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and apt-get is unavailable")
    state = tmp_path_factory.mktemp("slurm")
    env = _clean_env(MOK_SLURM_CTLD_PORT="16817", MOK_SLURM_SLURMD_PORT="16818")
    t0 = time.time()
    r = subprocess.run(["bash", str(START), "start", str(state)], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        subprocess.run(["bash", str(START), "stop", str(state)], env=env, capture_output=True, text=True,
                       timeout=120)
        pytest.fail(f"Slurm did not start (exit {r.returncode}):\n{r.stderr}\n{r.stdout}", pytrace=False)
    print(f"Slurm started in {time.time() - t0:.1f} s\n{r.stderr}")
    conf = state / "slurm.conf"
    assert conf.is_file()
    try:
        yield {"conf": str(conf), "state": state}
    finally:
        subprocess.run(["bash", str(START), "stop", str(state)], env=env, capture_output=True, text=True,
                       timeout=120)


def _scontrol_job(env, jid) -> dict:
    r = subprocess.run(["scontrol", "show", "job", "-o", jid], env=env, capture_output=True, text=True)
    fields = {}
    for tok in r.stdout.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields[k] = v
    return fields


def _wait(pred, timeout, what, diag):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{diag()}", pytrace=False)


def _submit(env, out_file, *args) -> str:
    sub = subprocess.run(["sbatch", "--parsable", "-o", str(out_file), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


_DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.mark.slurm
def test_sbatch_trains_and_resumes_after_requeue(slurm, tmp_path):
    """6-ish iterations, `scontrol requeue` after the first checkpoint, resume to 10; then a second
    submission into the same run folder (MOK_RUN_DIR) continues to 12."""
    assert TINY.is_file(), "configs/deepseek-v3-tiny.args is missing"
    runs = tmp_path / "runs"
    env = _clean_env(SLURM_CONF=slurm["conf"], MOK_RUNS_ROOT=str(runs),
                     MOK_PYTHON=os.environ.get("MOK_PYTHON", sys.executable), MOK_TENSORBOARD="0")
    out_file = tmp_path / "slurm-%j.out"
    t0 = time.time()
    jid = _submit(env, out_file, "-J", "ci", "-N", "1", "--ntasks-per-node=2", str(SBATCH), str(TINY), "mok",
                  "--", "--train-iters", "10", "--save-interval", "2")
    run_dir = runs / f"ci-deepseek-v3-tiny-mok-{jid}"
    log0, log1 = run_dir / "logs" / f"train-{jid}.0.log", run_dir / "logs" / f"train-{jid}.1.log"
    job_out = Path(str(out_file).replace("%j", jid))

    def diag(j=None):
        j = j or jid
        parts = [f"job {j}: {_scontrol_job(env, j)}"]
        for f in (Path(str(out_file).replace("%j", j)), slurm["state"] / "slurmctld.log",
                  slurm["state"] / "slurmd.log"):
            if f.exists():
                parts.append(f"----- {f} (tail) -----\n" + "\n".join(f.read_text(errors="replace").splitlines()[-60:]))
        return "\n".join(parts)

    def first_save():
        if _scontrol_job(env, jid).get("JobState") in _DONE:
            pytest.fail(f"job {jid} ended before its first checkpoint could be requeued\n{diag()}", pytrace=False)
        return log0.exists() and logparse.parse_log_file(log0).saved_iterations

    saved = _wait(first_save, 240, "the first checkpoint", diag)
    t_saved = time.time() - t0
    r = subprocess.run(["scontrol", "requeue", jid], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    def finished(j):
        info = _scontrol_job(env, j)
        return info if info.get("JobState") in _DONE and log1.exists() else None

    job = _wait(lambda: finished(jid), 240, f"job {jid} to finish after the requeue", diag)
    t_requeued = time.time() - t0
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", diag()
    assert job.get("Restarts") == "1", job

    first = logparse.parse_log_file(log0)
    second = logparse.parse_log_file(log1)
    # attempt 0: trained from scratch, logged finite losses, saved a checkpoint, was stopped early
    assert first.started_from_scratch and not first.loaded_iterations
    assert first.iterations and all(math.isfinite(r.lm_loss) for r in first.iterations)
    assert first.arg("moe_backend") == "mok" and first.arg("world_size") == "2"
    n = max(first.saved_iterations)
    assert saved[0] <= n < 10, f"attempt 0 ran to the end before the requeue (saved {first.saved_iterations})"
    # attempt 1: loaded iteration n and continued from n + 1 to 10
    assert second.loaded_iterations == [n], second.loaded_iterations
    its = [r.iteration for r in second.iterations]
    assert its == list(range(n + 1, 11)), its
    assert all(math.isfinite(r.lm_loss) for r in second.iterations)
    assert 10 in second.saved_iterations
    assert len(second.rank_stats) == 2 and all(s.exit == "0" for s in second.rank_stats)
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert "resuming from" in job_out.read_text()

    # a new job into the same run folder continues from iteration 10
    env2 = dict(env, MOK_RUN_DIR=str(run_dir))
    jid2 = _submit(env2, out_file, "-J", "ci2", "-N", "1", "--ntasks-per-node=2", str(SBATCH), str(TINY), "mok",
                   "--", "--train-iters", "12", "--save-interval", "100",
                   "--override-opt-param-scheduler")  # new train_iters: take the LR schedule from the args
    log1 = run_dir / "logs" / f"train-{jid2}.0.log"
    job2 = _wait(lambda: finished(jid2), 240, f"job {jid2} to finish", lambda: diag(jid2))
    assert job2["JobState"] == "COMPLETED" and job2["ExitCode"] == "0:0", diag(jid2)
    third = logparse.parse_log_file(log1)
    assert third.loaded_iterations == [10]
    assert [r.iteration for r in third.iterations] == [11, 12]
    assert all(math.isfinite(r.lm_loss) for r in third.iterations)
    elapsed = time.time() - t0

    print(f"job {jid}: first checkpoint (iteration {n}) after {t_saved:.1f} s, requeued, done after "
          f"{t_requeued:.1f} s; job {jid2} (same run folder) done after {elapsed:.1f} s total")
    print("attempt 0 iterations:", [r.iteration for r in first.iterations], "attempt 1:", its,
          "second job:", [r.iteration for r in third.iterations][-2:])
    print("losses:", [(r.iteration, r.lm_loss) for r in first.iterations + second.iterations]
          + [(r.iteration, r.lm_loss) for r in third.iterations[-2:]])


def test_memory_estimate_counts_the_kept_gate_up_outputs():
    import re

    def worst(*extra):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "slurm" / "estimate_memory.py"),
                            str(REPO / "configs" / "deepseek-v3.args"), "--nodes", "32", *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout, float(re.search(r"worst rank \d+: ([\d.]+) GiB", r.stdout).group(1))

    out_kept, kept = worst("--moe-backend", "mok")
    out_lean, lean = worst("--moe-backend", "mok", "--mok-recompute-gate-up")
    _, a2a = worst("--moe-backend", "alltoall")
    assert "gate/up outputs kept" in out_kept and "gate/up outputs recomputed" in out_lean
    # the recipe recomputes the MoE layers: h [cap, 2I] (+ the shared expert's) is held by the one
    # layer rebuilt for its backward: 135,168 x 2 x 2048 x 2 B + 4096 x 2 x 2048 x 2 B = 1.06 GiB
    assert kept - lean == pytest.approx(1.06, abs=0.1)
    assert a2a < lean < kept
