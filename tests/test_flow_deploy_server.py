"""`python -m flows.deploy` against a real `prefect server` process: serve, `prefect deployment run`, completion.

A served deployment runs each flow run in a new process that loads
flows/batch_generate.py and validates the parameters from JSON (a parameter
model that only works in-process fails there), so this test starts everything
as separate processes, as a user would: the server, the serving process, and
the `prefect deployment run --watch` command. About 40-60 s on 2 busy cores.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from pipeline import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except OSError:
        return None, b""


def _post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _wait(what: str, ok, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for p in procs:
            assert p.poll() is None, f"{what}: a process exited early:\n{p.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.stdout.read() if proc.stdout else ""


@pytest.fixture
def prefect_server(tmp_path):
    """A `prefect server start` process on a free loopback port; the environment its clients need."""
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PYTHONPATH": os.pathsep.join(
               [str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait("the Prefect server", lambda: _get(f"{env['PREFECT_API_URL']}/health")[0] == 200, 120, [proc])
        yield env
    finally:
        _stop(proc)


def test_served_deployment_runs_to_completion(prefect_server, tmp_path):
    env = prefect_server
    api = env["PREFECT_API_URL"]
    inp = tmp_path / "prompts.parquet"
    pl.DataFrame({"id": ["a", "b", "c"], "prompt": ["Say yes.", "Say no.", "Say hi."]}).write_parquet(inp)
    out = tmp_path / "labels"
    spec_file = tmp_path / "nightly.yaml"
    spec_file.write_text(
        f"spec:\n  input: {inp}\n  output: {out}\n  max_tokens: 2\n  progress: false\n"
        f"deployment:\n  name: nightly-test\n  cron: '0 2 * * *'\n  shard_retries: 0\n")
    # the serving process looks for scheduled runs every second, not every 10 s (Prefect's default
    # PREFECT_RUNNER_POLL_FREQUENCY): the run created below starts within a second of being scheduled
    serve = subprocess.Popen([sys.executable, "-m", "flows.deploy", str(spec_file)],
                             env={**env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait("the deployment", lambda: _get(f"{api}/deployments/name/batch-generate/nightly-test")[0] == 200,
              120, [serve])
        run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "batch-generate/nightly-test",
                              "--watch", "--watch-timeout", "300"], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=330)
        log = _stop(serve)
    finally:
        _stop(serve)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + log[-3000:]
    assert "Flow run finished successfully in 'Completed'" in run.stdout
    assert "Validation of flow parameters failed" not in log

    runs = _post(f"{api}/flow_runs/filter", {"limit": 5})
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
    assert runs[0]["parameters"]["spec"]["output"] == str(out)

    parts = sorted(out.glob("part-*.parquet"))
    ids = [i for p in parts for i in pl.read_parquet(p)["id"].to_list()]
    assert sorted(ids) == ["a", "b", "c"]
    m = read_metrics(str(out))
    assert m["status"].to_list() == ["ok"] and m["rows_ok"].to_list() == [3]


# `python -m flows.deploy` whose temporary Prefect server never answers (a slow machine's start, stretched
# out): the server process ignores SIGINT (as a server process does when the terminal's Ctrl-C goes only to
# the command) and records its pid; the deploy module runs as `python -m flows.deploy` does.
NEVER_ANSWERS = """
import os, runpy, subprocess, sys
from prefect.server.api.server import SubprocessASGIServer
def never_answers(self):
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                             "time.sleep(600)"])
    with open(os.environ["SERVER_PID_FILE"], "w") as f:
        f.write(str(proc.pid))
    return proc
SubprocessASGIServer._run_uvicorn_command = never_answers
sys.argv = ["flows.deploy", *sys.argv[1:]]
runpy.run_module("flows.deploy", run_name="__main__", alter_sys=True)
"""


def default_sigint() -> None:
    """A child's SIGINT back to the default (a KeyboardInterrupt in Python): a suite started with SIGINT
    ignored (`nohup pytest &`, a background job) passes SIG_IGN on to its children, which would then
    never see the Ctrl-C these tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_temporary_server_starts_stops_it_and_exits_in_one_line(tmp_path):
    """Without PREFECT_API_URL, `flow.serve` started Prefect's temporary server from Prefect's event-loop
    thread: a Ctrl-C then waited for the start's 90 s timeout (a second one was ignored too). The command
    now starts the server itself; a Ctrl-C during the start stops the server process and ends in the
    command's one line, exit 130."""
    import psutil

    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"spec:\n  input: {tmp_path / 'in.parquet'}\n  output: {tmp_path / 'out'}\n"
                         f"deployment:\n  cron: '0 2 * * *'\n")
    pid_file = tmp_path / "server.pid"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "SERVER_PID_FILE": str(pid_file),
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    proc = subprocess.Popen([sys.executable, "-c", NEVER_ANSWERS, str(spec_file)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        _wait("the temporary server's start", pid_file.exists, 120, [proc])
        server = psutil.Process(int(pid_file.read_text()))
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - signalled < 15  # it waited for the 90 s startup timeout
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == "flows.deploy: stopped by SIGINT before the deployment was served", err
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE  # the server process was stopped
