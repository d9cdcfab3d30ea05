"""``python -m hcache.mii.launch <MII's server arguments>``: one of MII's server processes (model replica, load
balancer or REST gateway) with hcache installed, started by :func:`hcache.mii.serve` in place of
``python -m mii.launch.multi_gpu_server``. The resolved hcache config comes in the environment (``HCACHE_MII_CONFIG``),
not on the command line, where every local user could read the store paths and namespace."""
from __future__ import annotations

import argparse
import os

from .backend import CONFIG_ENV, install_server
from ..config import ResolvedConfig


def main() -> None:
    from mii.launch.multi_gpu_server import b64_encoded_config
    from mii.launch.multi_gpu_server import main as mii_main

    config = ResolvedConfig.model_validate_json(os.environ.pop(CONFIG_ENV))
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-config", required=True, type=b64_encoded_config)
    parser.add_argument("--restful-gateway", action="store_true")
    args, _ = parser.parse_known_args()
    install_server(config, args.model_config, args.restful_gateway)  # for the life of this process
    mii_main()


if __name__ == "__main__":
    main()
