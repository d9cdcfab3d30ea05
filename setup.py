import re

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "(.+)"', open("hcache/version.py", encoding="utf-8").read()).group(1)

setup(
    name="hcache",
    version=VERSION,
    description="Fast LLM state restoration from saved hidden states (HCache, EuroSys '25)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hcache", "hcache.*"]),
    python_requires=">=3.10",
    # torch is deliberately unpinned: install the build for your machine first (see README).
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "gguf>=0.10",
        "accelerate>=1.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "xxhash>=3.0",
        "triton>=3.0",
        "nvidia-ml-py>=12",
        "matplotlib>=3.7",
        # the GPU engine and the serving layer; both install and import on a CPU
        "deepspeed>=0.19,<0.20",
        "deepspeed-mii>=0.3,<0.4",
        "pydantic>=2",
        # shared tiers: a Redis server or cluster (hiredis parses large values in C)
        "redis[hiredis]>=5",
        "prometheus-client>=0.17",
        # MII's OpenAI-compatible server needs these and does not declare them
        "uvicorn",
        "pydantic-settings>=2",
        "psutil>=5.9",  # a fleet's processes; deepspeed needs it too
    ],
    package_data={"hcache.fleet": ["haproxy.cfg"]},
    extras_require={"test": ["pytest>=8", "mkdocs>=1.6", "mkdocs-material>=9"]},
    entry_points={"console_scripts": ["hcache=hcache.cli:main"]},
)
