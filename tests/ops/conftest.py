import pytest


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels on the interpreter; the kernel is wrapped at launch, so setting it now suffices."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
