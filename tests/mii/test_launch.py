"""How ``hcache serve`` starts MII's processes, without starting them: what they are told about logging, that
a server failing as it starts is reported in the line it wrote, and that MII's temporary hostfiles do not
outlive the start. (A real deployment: ``tests/mii/test_mii.py``.)"""

import logging
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
from mii.backend.server import MIIServer
from mii.config import MIIConfig

from hcache.errors import ServerStartError
from hcache.mii.launch import _tell_starter
from hcache.mii.patches import launching_with_hcache
from hcache.mii.processes import START_ERROR_ENV


class _Exited:
    """A server process that exited as it started: MII's start stops there."""

    pid, returncode = 0, 1

    def poll(self):
        return 1


@pytest.mark.parametrize(
    "verbose, reason",
    [
        (False, "store.quota_bytes is too small"),  # once a RuntimeError naming no reason, after a traceback
        (True, ""),
    ],
)
def test_mii_starts_its_processes_as_quiet_as_hcache_and_leaves_no_hostfile(
    tmp_path, monkeypatch, caplog, verbose, reason
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where MII writes its hostfiles
    started = []

    def popen(cmd, env=None, **kwargs):
        started.append((cmd, env, sorted(p.name for p in tmp_path.iterdir())))
        with open(env[START_ERROR_ENV], "w") as file:  # as hcache.mii.launch does when its server fails
            file.write(reason)
        return _Exited()

    monkeypatch.setattr("hcache.mii.processes.subprocess", SimpleNamespace(Popen=popen))  # hcache's launch alone
    config = MIIConfig(
        model_config={"model_name_or_path": "/no-model", "tokenizer": "/no-model", "task": "text-generation"},
        deployment_name="test",
        port_number=50990,
    )
    caplog.set_level(logging.INFO if verbose else logging.WARNING, logger="hcache")
    with pytest.raises(ServerStartError, match=f"exited with status 1 while starting: {reason or 'its output above'}"):
        with launching_with_hcache(SimpleNamespace(model_dump_json=lambda: "{}"), []):
            MIIServer(config)
    [(cmd, env, hostfiles)] = started[:1]
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"] and "hcache.mii.launch" in cmd
    assert (cmd[3:5] == ["--log_level", "error"]) is not verbose  # DeepSpeed's launcher: no training-launcher lines
    assert env["HCACHE_LOG_LEVEL"] == ("INFO" if verbose else "WARNING")
    assert len(hostfiles) == 3  # MII's (one for the deployment, one for the replica) and the servers' error file
    assert not list(tmp_path.iterdir())  # removed once the start is over, failed as here or not


def test_a_server_tells_its_starter_why_it_failed_only_while_it_starts(tmp_path, monkeypatch):
    """Once, a server failing after its start wrote the error file its starter had removed, leaving it in
    /tmp; and an error writing it replaced the server's own."""
    error_file = tmp_path / "hcache-start-error-x"
    monkeypatch.setenv(START_ERROR_ENV, str(error_file))
    error_file.touch()  # as the starter makes it
    _tell_starter(RuntimeError("the store\ncannot open"))
    assert error_file.read_text() == "RuntimeError: the store cannot open"
    error_file.unlink()  # the start is over
    _tell_starter(RuntimeError("later"))
    assert not error_file.exists()
    monkeypatch.setenv(START_ERROR_ENV, str(tmp_path))  # a directory: open fails
    _tell_starter(RuntimeError("unwritable"))
    monkeypatch.delenv(START_ERROR_ENV)
    _tell_starter(RuntimeError("not started by hcache serve"))


@pytest.mark.parametrize("level, quiet", [("WARNING", True), ("INFO", False)])
def test_a_server_process_logs_at_hcaches_level(level, quiet):
    script = """
import logging, sys
from hcache.mii.launch import _logging
_logging()
hcache, mii, werkzeug = (logging.getLogger(name) for name in ("hcache", "MII", "werkzeug"))
record = logging.LogRecord("MII", logging.INFO, "x.py", 0, "info", (), None)
print(hcache.isEnabledFor(logging.INFO), bool(mii.filter(record)), werkzeug.isEnabledFor(logging.INFO))
"""
    env = dict(os.environ, HCACHE_LOG_LEVEL=level)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(not quiet)] * 3


def test_deepspeed_is_told_its_accelerator_and_does_not_warn_that_it_guessed():
    """On a machine without a GPU DeepSpeed warned, in the serving process and in each one MII starts, that
    it fell back to the CPU; hcache names the accelerator where torch sees no CUDA device."""
    script = """
import os, torch
from hcache.mii.deployment import _quiet_libraries
_quiet_libraries()
import mii
from deepspeed.accelerator import get_accelerator
print(os.environ.get("DS_ACCELERATOR"), get_accelerator().device_name(), torch.cuda.is_available())
"""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # hcache.mii.serve in this process sets it
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    named, device, cuda = result.stdout.split()[-3:]
    assert (named, device) == (("None", "cuda") if cuda == "True" else ("cpu", "cpu"))
    assert "Setting accelerator" not in result.stdout + result.stderr
