"""One process per store directory: the lock is taken, another process is refused with an error that names
the holder, and the lock is given back on release and when its holder dies, however it dies. Other
processes are real ones: a flock is held per open file, so only another process can contend for it."""

import os
import signal
import subprocess
import sys

import pytest

from hcache.errors import StorageError
from hcache.storage import dir_lock

_TAKE = """
import sys
from hcache.storage import dir_lock
from hcache.errors import StorageError
try:
    dir_lock.acquire(__import__("pathlib").Path(sys.argv[1]), shared=sys.argv[2] == "shared")
    print("taken", flush=True)
except StorageError as exc:
    print("refused:", exc, flush=True)
    sys.exit(0)
if len(sys.argv) > 3:  # hold it until told to go (or killed)
    sys.stdin.read()
"""


def _other(directory, mode: str = "private") -> str:
    """What another process gets when it takes the lock (and lets it go when it exits)."""
    done = subprocess.run(
        [sys.executable, "-c", _TAKE, str(directory), mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _holder(directory, mode: str = "private") -> subprocess.Popen:
    """Another process that takes the lock and holds it until its stdin closes or it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _TAKE, str(directory), mode, "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "taken"
    return proc


def test_the_lock_is_taken_and_another_process_is_refused_naming_this_one(tmp_path):
    release, first = dir_lock.acquire(tmp_path)
    try:
        assert first and (tmp_path / dir_lock.LOCK_NAME).read_text() == str(os.getpid())
        answer = _other(tmp_path)
        assert answer.startswith("refused:") and f"in use by another process (pid {os.getpid()})" in answer
        assert "a directory of its own" in answer  # says what to do
    finally:
        release()
    assert _other(tmp_path) == "taken"  # released: the next process takes it


def test_store_objects_of_one_process_share_the_lock_until_the_last_releases_it(tmp_path):
    release_a, first_a = dir_lock.acquire(tmp_path)
    release_b, first_b = dir_lock.acquire(tmp_path)
    assert first_a and not first_b  # only the first may delete temporary files at start-up
    with pytest.raises(StorageError, match="open here as private already"):
        dir_lock.acquire(tmp_path, shared=True)
    release_a()
    assert _other(tmp_path).startswith("refused:")  # b still holds it
    release_b()
    assert _other(tmp_path) == "taken"


@pytest.mark.parametrize("signum", [signal.SIGKILL, None], ids=["killed", "exited"])
def test_the_kernel_gives_the_lock_back_when_its_holder_dies(tmp_path, signum):
    holder = _holder(tmp_path)
    with pytest.raises(StorageError, match=f"pid {holder.pid}"):
        dir_lock.acquire(tmp_path)
    if signum is None:
        holder.stdin.close()  # it exits without releasing anything
    else:
        holder.send_signal(signum)
    holder.wait(timeout=30)
    release, first = dir_lock.acquire(tmp_path)
    assert first
    release()


def test_shared_holders_admit_each_other_and_refuse_a_private_one(tmp_path):
    holder = _holder(tmp_path, "shared")
    try:
        release, _ = dir_lock.acquire(tmp_path, shared=True)  # a second shared opener: admitted
        answer = _other(tmp_path, "private")
        assert answer.startswith("refused:") and "(pid shared)" in answer
        release()
        assert _other(tmp_path, "shared") == "taken"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert _other(tmp_path, "private") == "taken"


def test_a_forked_child_neither_inherits_the_lock_nor_drops_it(tmp_path):
    release, _ = dir_lock.acquire(tmp_path)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the parent's lock is not its own to share, and closing its copy leaves it held
            try:
                dir_lock.acquire(tmp_path)
                os._exit(1)
            except StorageError:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert _other(tmp_path).startswith("refused:")  # the child's exit left the parent's lock held
    finally:
        release()


def test_a_release_run_by_the_garbage_collector_inside_acquire_neither_deadlocks_nor_is_lost(tmp_path, monkeypatch):
    """A store's finalizer releases its directory, and the collector may run it in a thread that holds the
    module's mutex, inside acquire (a whole-suite run once hung there): the release waits for nothing, and is
    done as the mutex is let go."""
    import threading

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    release_first, _ = dir_lock.acquire(first)
    hold = dir_lock._hold

    def collected_meanwhile(*args):
        release_first()  # as the collector runs the first store's finalizer here
        return hold(*args)

    monkeypatch.setattr(dir_lock, "_hold", collected_meanwhile)
    taken = []
    thread = threading.Thread(target=lambda: taken.append(dir_lock.acquire(second)), daemon=True)
    thread.start()
    thread.join(10)
    assert taken, "acquire deadlocked on a release made inside it"
    assert first.resolve() not in dir_lock._held and _other(first) == "taken"  # released, not lost
    taken[0][0]()
    assert second.resolve() not in dir_lock._held
