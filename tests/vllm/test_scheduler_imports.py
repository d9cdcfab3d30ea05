"""vLLM's scheduler side of hcache's connector imports neither torch nor the data plane (the loader, the
paged layout, the copy process, the store stack, the chunk format): vLLM splits its own offloading the same
way, a manager for the scheduler and handlers for the worker. Run where torch cannot be imported at all."""

import subprocess
import sys

# The scheduler's side: its connector half, the index, the messages both sides exchange, the load jobs.
SCHEDULER_SIDE = ["hcache.vllm.scheduler", "hcache.vllm.index", "hcache.vllm.messages", "hcache.paged.load_job"]
# What belongs to the worker's side (or to vLLM, which imports torch), none of which the scheduler's may load.
DATA_PLANE = [
    "torch",
    "vllm",
    "hcache.paged.loader",
    "hcache.ops.paged_layout",
    "hcache.paged.copy_process",
    "hcache.serving",
    "hcache.transfer",
    "hcache.storage.host_tier",
    "hcache.storage.host_pool",
    "hcache.storage.chunk",
    "hcache.vllm.worker",
    "hcache.vllm.metadata",
]

_PROBE = f"""
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")

sys.meta_path.insert(0, NoTorch())
for name in {SCHEDULER_SIDE!r}:
    __import__(name)
print(" ".join(m for m in {DATA_PLANE!r} if m in sys.modules))
"""


def test_the_scheduler_side_imports_without_torch_and_loads_no_data_plane():
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [], f"the scheduler's side loaded {run.stdout.strip()}"


def test_the_probe_does_block_torch():
    """The blocker itself: a module of the worker's side fails to import under it."""
    probe = _PROBE.replace("hcache.vllm.index", "hcache.paged.loader", 1)
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "torch is not installed here" in run.stderr
