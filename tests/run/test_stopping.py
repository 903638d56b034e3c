"""SIGTERM stops a run cleanly (issue 45, item 7; ``run/stopping.py``): at a step's end with a
checkpoint when the step can end within ``stop_grace_s``, otherwise abandoning the step; the
report is written, the exit status is 143, the message names the newest checkpoint and the
command that resumes, and ``--resume auto`` continues exactly. Under torchrun one rank's signal
stops every rank after the same step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.test_distributed import COMMANDS, TINY

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SFT = ["sft", *TINY, *COMMANDS["sft"], "batch_size=8", "learning_rate=1e-3", "warmup_steps=0", "device=cpu"]
SFT += ["report_to=[]", "log_every=1000", "save_every=0"]


# `python -m posttrain` with Ctrl-C's usual meaning: a child inherits an ignored SIGINT (Python
# then installs no KeyboardInterrupt handler), and in a full suite the test process may ignore it
AS_FROM_A_TERMINAL = "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
AS_FROM_A_TERMINAL += "runpy.run_module('posttrain', run_name='__main__', alter_sys=True)"


def start(args: list[str], ranks: int = 1, env: dict[str, str] | None = None) -> subprocess.Popen:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    module = ["-m", "posttrain"] if ranks > 1 else ["-c", AS_FROM_A_TERMINAL]
    return subprocess.Popen(
        [*launcher, *module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def logged_steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))} for row in rows]


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def signalled_sft(run: Path, steps: int, number: signal.Signals, status: int) -> str:
    """An SFT run into ``run`` sent ``number`` after three logged steps; its stderr, once it exits with ``status``."""
    child = start([*SFT, f"steps={steps}", f"output_dir={run}"])
    wait_for(lambda: len(logged_steps(run)) >= 3, "three logged steps")
    child.send_signal(number)
    _, err = child.communicate(timeout=60)
    assert child.returncode == status, err[-2000:]
    return err


def test_sigterm_saves_the_step_writes_the_report_exits_143_and_resumes_exactly(tmp_path):
    straight = start([*SFT, "steps=40", f"output_dir={tmp_path / 'straight'}"])
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-2000:]
    run = tmp_path / "stopped"
    err = signalled_sft(run, 40, signal.SIGTERM, 143)
    stopped_at = logged_steps(run)[-1]["step"]
    assert stopped_at < 40 and f"stopped by SIGTERM after step {stopped_at}" in err and "Traceback" not in err
    assert f"the newest checkpoint is {run / 'checkpoints' / f'step-{stopped_at}'}" in err
    assert f"continues at step {stopped_at + 1}" in err and f"output_dir={run} --resume auto" in err
    assert "stopped by SIGTERM" in (run / "report.html").read_text() and not (run / "final").exists()
    resumed = start([*SFT, "steps=40", f"output_dir={run}", "--resume", "auto"])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-2000:]
    assert logged_steps(run) == logged_steps(tmp_path / "straight")


def slow_reward(prompts, completions, **_):
    """Tells the test it was called, then takes longer than the test's grace."""
    Path(os.environ["POSTTRAIN_TEST_MARKER"]).touch()
    time.sleep(30)
    return [0.0] * len(completions)


def test_a_step_that_cannot_end_within_the_grace_is_abandoned(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "in_the_reward"
    args = ["rl", *TINY, "data.task=reverse", "data.n_train=16", "data.n_eval=9", "eval_size=0", "steps=3",
            "prompts_per_step=2", "samples_per_prompt=2", "max_new_tokens=4", "reward_workers=0", "preflight=false",
            "rewards=[tests.run.test_stopping:slow_reward]", "reward_timeout=120", "stop_grace_s=0.5",
            f"output_dir={run}", "report_to=[]"]  # fmt: skip
    child = start(args, env={"POSTTRAIN_TEST_MARKER": str(marker)})
    wait_for(marker.exists, "the reward to be called")
    signalled = time.monotonic()
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 143, err[-2000:]
    assert time.monotonic() - signalled < 0.5 + 10  # the grace, then the way out (report, workers)
    assert "stopped by SIGTERM during a step, which was abandoned" in err and "Traceback" not in err
    assert f"there is no checkpoint in {run}, so a resumed run starts again from step 1" in err
    assert "stopped by SIGTERM" in (run / "report.html").read_text()


def test_one_ranks_sigterm_stops_both_ranks_after_the_same_step_and_they_resume_exactly(tmp_path):
    args = [*SFT, "steps=30"]
    straight = start([*args, f"output_dir={tmp_path / 'straight'}"], ranks=2)
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-3000:]
    run = tmp_path / "stopped"
    launcher = start([*args, f"output_dir={run}"], ranks=2)
    wait_for(lambda: len(logged_steps(run)) >= 3, "three logged steps")
    workers = children(launcher.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGTERM)  # one rank only, as when a scheduler signals one node first
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    stopped_at = logged_steps(run)[-1]["step"]
    assert f"stopped by SIGTERM after step {stopped_at}" in err
    assert (run / "checkpoints" / f"step-{stopped_at}" / "COMPLETE").is_file()
    resumed = start([*args, f"output_dir={run}", "--resume", "auto"], ranks=2)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]
    assert logged_steps(run) == logged_steps(tmp_path / "straight")


def test_ctrl_c_says_truly_that_there_is_no_checkpoint(tmp_path):
    """It said 'the checkpoints ... are kept' when there were none."""
    run = tmp_path / "run"
    # far more steps than can run before the signal, however late a busy machine lets this process send it
    err = signalled_sft(run, 100_000, signal.SIGINT, 130)
    assert f"interrupted (Ctrl-C); there is no checkpoint in {run}, so a resumed run starts again from step 1" in err
    assert f"output_dir={run} --resume auto" in err and "are kept" not in err
