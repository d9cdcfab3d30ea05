"""``python -m hcache.mii.launch --hcache-config B64 <MII's server arguments>``: one of MII's server processes
(model replica, load balancer or REST gateway) with hcache's engine installed, started by
:func:`hcache.mii.serve` in place of ``python -m mii.launch.multi_gpu_server``."""
from __future__ import annotations

import argparse
import sys

from .backend import install
from .config import HCacheConfig


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--hcache-config", required=True, type=HCacheConfig.from_b64)
    args, mii_args = parser.parse_known_args()
    install(args.hcache_config)  # for the life of this process
    from mii.launch.multi_gpu_server import main as mii_main

    sys.argv = [sys.argv[0], *mii_args]
    mii_main()


if __name__ == "__main__":
    main()
