"""Helpers the tests share, and the scripts and fault injections that tests run in processes of their own."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parent.parent  # the hcache under test, installed or not
FAULT_DIR = str(SUPPORT / "fault_injection")  # on PYTHONPATH, its sitecustomize injects faults into a server
