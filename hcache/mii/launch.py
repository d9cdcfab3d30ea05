"""``python -m hcache.mii.launch <MII's server arguments>``: one of MII's server processes (model replica, load
balancer or REST gateway) with hcache installed, started by :func:`hcache.mii.serve` in place of
``python -m mii.launch.multi_gpu_server``. The resolved hcache config comes in the environment (``HCACHE_MII_CONFIG``),
not on the command line, where every local user could read the store paths and namespace. The process logs
at the level of ``HCACHE_LOG_LEVEL`` (hcache's, where it was started: INFO with ``hcache -v``), so that
``hcache serve -v`` shows the model server's restores; below INFO, MII's and the REST gateway's (werkzeug's)
INFO messages and MII's printed progress are not shown."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from ..config import ResolvedConfig
from ..errors import HCacheError
from ..machine import process_tree
from ..machine.owner import end_with_owner
from .patches import install_server
from .processes import CONFIG_ENV, LOG_LEVEL_ENV, START_ERROR_ENV


def _logging() -> None:
    level = os.environ.get(LOG_LEVEL_ENV, "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not logging.getLogger().isEnabledFor(logging.INFO):
        # MII sets its logger's level when it is first imported: a filter stays. werkzeug logs each request.
        logging.getLogger("MII").addFilter(lambda record: record.levelno >= logging.WARNING)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)


def main() -> None:
    _logging()
    end_with_owner()  # hcache serve's: gone, killed with its process group or not, this server ends
    from mii.launch.multi_gpu_server import b64_encoded_config
    from mii.launch.multi_gpu_server import main as mii_main

    config = ResolvedConfig.model_validate_json(os.environ.pop(CONFIG_ENV))
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-config", required=True, type=b64_encoded_config)
    parser.add_argument("--restful-gateway", action="store_true")
    args, _ = parser.parse_known_args()
    try:
        with install_server(config, args.model_config, args.restful_gateway):  # undone once MII's server has stopped
            if not logging.getLogger().isEnabledFor(logging.INFO):
                # MII prints its progress ("Starting server on port ...", "About to start server", "Started").
                # Its and DeepSpeed's loggers, made on import above, keep the stream they were made with; errors
                # go to stderr.
                sys.stdout = open(os.devnull, "w")  # for the life of this process
            mii_main()
    except Exception as exc:
        _tell_starter(exc)
        if not isinstance(exc, HCacheError):
            raise  # not hcache's refusal: its traceback says where
        print(f"hcache: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    process_tree.exit_now()  # MII's server has returned: a model server has stored everything (hcache.mii.loop)


def _tell_starter(exc: Exception) -> None:
    """Write why this server failed, in one line, where the process that started it reads it
    (:func:`hcache.mii.processes.waiting_briefly`), while it is starting. The starter removes the file once
    the start is over, so a later failure finds none and writes nothing (mode r+ makes no file); failing to
    write must not hide ``exc``."""
    line = str(exc) if isinstance(exc, HCacheError) else f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(OSError, KeyError), open(os.environ[START_ERROR_ENV], "r+") as file:
        file.truncate()
        file.write(" ".join(line.split()))


if __name__ == "__main__":
    main()
