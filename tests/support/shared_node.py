"""A serving node in a process of its own: ``python shared_node.py CONFIG_JSON``. It serves each prompt of
the config with a runtime over the given local directory and shared stores, closes the runtime (every
chunk written to every tier), and prints each result's output ids and restored tokens as JSON."""

import json
import sys

from hcache.serving.runtime import HCacheRuntime
from hcache.storage.store_config import StoreConfig


def main() -> None:
    config = json.loads(sys.argv[1])
    store = StoreConfig(shared=tuple(config["shared"]), fsync=False)
    with HCacheRuntime(config["model"], config["store_dir"], store=store, save="all") as runtime:
        results = [runtime.generate(p, config["new_tokens"]) for p in config["prompts"]]
    print(json.dumps([{"output_ids": r.output_ids, "restored_tokens": r.restored_tokens} for r in results]))


if __name__ == "__main__":
    main()
