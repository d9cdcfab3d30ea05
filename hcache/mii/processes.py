"""Starting and stopping a deployment's processes: MII's servers launched through :mod:`hcache.mii.launch`
(the patches of ``MIIServer`` that do so are installed by
:func:`hcache.mii.patches.launching_with_hcache`), hcache's OpenAI-compatible server beside
them, and every process of theirs ended, the model servers given time to store what they saved."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ..errors import ServerStartError
from ..machine import process_tree

# How ``hcache serve`` drives the OpenAI server it starts (:func:`openai_server`): its signals and its grace,
# read by the server's ``__main__`` too. The server stands on the deployment, so the deployment owns them.
DRAIN_SIGNAL, READY_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
FINISH_S = 2.0  # after the shutdown grace, the longest a request being ended is waited for
# After SIGTERM and the drain, how long requests in flight may take to finish: a 150-token reply at the
# 110 ms a token measured idle on a 2-core CPU (issue 46), within Kubernetes' default 30 s termination
# grace together with the 3 s drain and the deployment's stop.
DEFAULT_SHUTDOWN_GRACE_S = 20.0

CONFIG_ENV = "HCACHE_MII_CONFIG"  # how server processes get the hcache config: not on their command lines
LOG_LEVEL_ENV = "HCACHE_LOG_LEVEL"  # the level server processes log at: hcache's where they were started
START_ERROR_ENV = "HCACHE_START_ERROR"  # the file a server process that fails writes its reason to, in one line


class Launch:
    """One ``mii.serve``'s start: the hcache config its processes get, the processes (collected in
    ``launched``), and the files to remove after: MII's hostfiles and the servers' error file.

    The processes log as hcache's logger here does (``hcache -v``: INFO): below INFO, DeepSpeed's launcher
    is quiet (``--log_level error``: no training-launcher lines), and so are MII's and the REST gateway's
    INFO messages (:mod:`hcache.mii.launch`). MII writes two hostfiles to the temporary directory as it
    starts, reads them then, and leaves them behind. A server that fails writes why to ``error_file``, which
    the wait for the servers reports (:func:`waiting_briefly`)."""

    def __init__(self, hcache, launched: list[subprocess.Popen]):
        self.hcache, self.launched = hcache, launched
        self.level = logging.getLogger("hcache").getEffectiveLevel()
        fd, self.error_file = tempfile.mkstemp(prefix="hcache-start-error-")
        os.close(fd)
        self.files = [self.error_file]

    def remove_files(self) -> None:
        for path in self.files:
            with contextlib.suppress(OSError):
                os.remove(path)


def noting_hostfile(init, launch: Launch):
    """``MIIServer.__init__``, noting the hostfile MII writes when it is given none."""

    def noting_init(self, mii_config):
        given = mii_config.hostfile
        try:
            init(self, mii_config)
        finally:
            if mii_config.hostfile != given:
                launch.files.append(mii_config.hostfile)

    return noting_init


def noting_replica_hostfile(ds_launch_str, launch: Launch):
    """``MIIServer._generate_ds_launch_str``, noting the replica's hostfile (written for DeepSpeed's launcher,
    which is not given it)."""

    def noting_ds_launch_str(self, replica_config, hostfile, use_multiple_hosts):
        launch.files.append(hostfile)
        return ds_launch_str(self, replica_config, hostfile, use_multiple_hosts)

    return noting_ds_launch_str


def through_hcache_launch(_mii_launch, launch: Launch):
    """``MIIServer._launch_server_process``: ``python -m hcache.mii.launch`` in place of MII's module, in
    MII's own command line otherwise, with the hcache config in the environment."""
    from mii.backend.server import config_to_b64_str

    def launch_server_process(self, model_config, msg_server_type, ds_launch_str="", server_args=None):
        launcher = ds_launch_str.split()
        if launcher[:1] == ["deepspeed"]:  # DeepSpeed's launcher from this Python, not the first on PATH
            launcher[:1] = [sys.executable, "-m", "deepspeed.launcher.runner"]
            if launch.level > logging.INFO:
                launcher[3:3] = ["--log_level", "error"]
        cmd = [
            *launcher,
            sys.executable,
            "-m",
            "hcache.mii.launch",
            "--model-config",
            config_to_b64_str(model_config),
            *" ".join(server_args or []).split(),
        ]
        # The hcache config (store paths, namespace) goes in the environment, which only this user can read,
        # not on the command line, which every local user can. A session of its own: Ctrl-C reaches only
        # the serving process, which stops the deployment in order (``terminate_server``) rather than each
        # process dying where it stands, and ``stop`` can end the launcher with the server it started.
        env = dict(
            os.environ,
            **{
                CONFIG_ENV: launch.hcache.model_dump_json(),
                LOG_LEVEL_ENV: logging.getLevelName(launch.level),
                START_ERROR_ENV: launch.error_file,
            },
        )
        process = subprocess.Popen(cmd, env=env, start_new_session=True)
        process.hcache_saves = msg_server_type == "MII server"  # the others hold no state
        launch.launched.append(process)
        return process

    return launch_server_process


def waiting_briefly(_mii_wait, launch: Launch):
    """``MIIServer._wait_until_server_is_live``: MII's own wait sleeps 5 s a round, even once the servers are
    up, so a node would start seconds late; this one polls, and fails once a server has exited, with the one
    line it wrote saying why (:class:`ServerStartError`)."""

    def wait_until_live(self, processes, replicas):
        for process, replica in zip(processes, replicas):
            while not all(self._is_socket_open(replica.hostname, port) for port in replica.tensor_parallel_ports):
                if process is not None and process.poll() is not None:
                    reason = Path(launch.error_file).read_text().strip() or "its output above says why"
                    raise ServerStartError(
                        f"the model server exited with status {process.returncode} while starting: {reason}"
                    )
                time.sleep(0.2)

    return wait_until_live


def openai_server(
    model_dir: str,
    balancer_port: int,
    port: int,
    host: str = "localhost",
    *,
    max_model_len: int | None = None,
    names: list[str] | None = None,
    starting: bool = False,
    shutdown_grace: float | None = None,
    verbose: bool = False,
) -> subprocess.Popen:
    """hcache's OpenAI-compatible server (:mod:`hcache.openai`) on ``host``, in front of a deployment's load
    balancer. ``starting``: the deployment is still starting; ``/health`` answers 503 until the server gets
    ``READY_SIGNAL``."""
    command = [
        sys.executable,
        "-m",
        "hcache.openai",
        "--model",
        model_dir,
        "--load-balancer",
        f"localhost:{balancer_port}",
        "--host",
        host,
        "--port",
        str(port),
    ]
    for name in names or []:
        command += ["--served-model-name", name]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if shutdown_grace is not None:
        command += ["--shutdown-grace", str(shutdown_grace)]
    command += ["--starting"] * starting + ["--verbose"] * verbose
    return subprocess.Popen(
        command, start_new_session=True
    )  # Ctrl-C reaches the serving process, which drains this one first


def stop(processes: list[subprocess.Popen], grace_s: float = 15) -> None:
    """End a deployment's processes after ``terminate_server``, each with all it started (each leads a
    session, see :func:`through_hcache_launch`). The load balancer and the REST gateway hold no state and end
    at once (MII 0.3's gateway, with ``restful_processes > 1``, handles ``/terminate`` in a forked child and
    so never stops). A model server writes its saved chunks as it stops: it gets up to ``grace_s`` for that.
    Then its session ends: once the server has exited, what is left holds nothing (DeepSpeed's launchers, which
    notice their child's exit only once a second, and take a second more to handle SIGTERM under load) and is
    killed at once; a server still running gets SIGTERM first, SIGKILL 5 s later."""
    for process in processes:
        if not getattr(process, "hcache_saves", True):
            process_tree.signal_session(process, signal.SIGTERM)
    if process_tree.wait(lambda: not any(_model_server_running(p) for p in processes), grace_s):
        for process in processes:
            process_tree.signal_session(process, signal.SIGKILL)
    process_tree.end_sessions(processes, grace_s=5.0)


def _model_server_running(process: subprocess.Popen) -> bool:
    """Whether ``process``'s model server (hcache's launch module, under DeepSpeed's launcher) still runs."""
    if not getattr(process, "hcache_saves", True):
        return False
    for p in process_tree.session(process):
        try:
            if p.cmdline()[1:3] == ["-m", "hcache.mii.launch"]:  # the server, not the launchers naming it
                return True
        except psutil.Error:
            pass
    return False
