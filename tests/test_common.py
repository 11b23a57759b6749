"""
common.py's primitives: atomic strict-JSON writes, exclusive temporaries that nothing planted can
redirect and that a killed writer does not leave forever, the pid lock and a cell's lock (train.py
stops at a cell another process trains), check_writable, read_json.
$ python -m pytest tests/test_common.py -q
"""

import json
import os
import socket
import subprocess
import sys

import pytest

import common
import train
from common import ConfigError
from helpers import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = socket.gethostname()


def finished_pid():
    """The pid of a process that has ended (so no process on this host has it, for now)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_write_json_that_fails_leaves_no_tmp_and_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    common.write_json(str(path), {"a": 1})

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(json, "dump", full_disk)
        with pytest.raises(common.DataError) as err:
            common.write_json(str(path), {"a": 2})
    assert (
        str(err.value)
        == f"cannot write {path} (No space left on device); free disk space or check the permissions of {tmp_path}"
    )
    assert os.listdir(tmp_path) == ["result.json"] and json.loads(path.read_text()) == {"a": 1}  # the old file stays
    (tmp_path / "file").write_text("x")
    with pytest.raises(common.DataError, match=r"cannot write .*file/x.json \(Not a directory\); free disk space"):
        common.write_json(str(tmp_path / "file" / "x.json"), {})  # a path under a file fails even for root


def test_write_json_into_a_read_only_directory_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):
        pytest.skip("running as root: a read-only directory is still writable")
    with pytest.raises(common.DataError, match=r"\(Permission denied\); free disk space or check the permissions"):
        common.write_json(str(locked / "x.json"), {})
    assert os.listdir(locked) == []


def test_write_json_is_strict_and_its_temporary_is_this_process_own(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    common.write_json(str(path), {"a": 1})
    (tmp_path / "result.json.tmp").write_text("another writer's")  # not ours: left alone
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=f"{path}: Out of range float values"):
            common.write_json(str(path), {"loss": [1.0, bad]})
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == ["result.json", "result.json.tmp"]
    seen, real_dump = [], json.dump
    monkeypatch.setattr(json, "dump", lambda obj, f, **kw: (seen.append((f.name, kw)), real_dump(obj, f, **kw)))
    common.write_json(str(path), {"a": 2})
    assert seen == [(f"{path}.{os.getpid()}.{socket.gethostname()}.tmp", dict(indent=1, allow_nan=False))]
    assert json.loads(path.read_text()) == {"a": 2} and (tmp_path / "result.json.tmp").read_text() == "another writer's"


def test_write_text_is_atomic_and_takes_the_path_first(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    common.write_text(str(path), "# first\n")
    assert path.read_text() == "# first\n"
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(
        common.DataError, match=r"^cannot write .*report.md \(No space left on device\); free disk space"
    ):
        common.write_text(str(path), "# second\n")
    assert path.read_text() == "# first\n" and os.listdir(tmp_path) == ["report.md"]


def test_a_symlink_planted_at_a_temporary_is_never_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path, lock = tmp_path / "result.json", tmp_path / "lock"
    for planted in (
        common.temporary_name(str(path)),
        common.temporary_name(str(lock)),
        str(tmp_path / f".write_test.{os.getpid()}.tmp"),
    ):  # the probe name check_writable used
        os.symlink(victim, planted)
    common.write_json(str(path), {"a": 1})
    with common.pid_lock(str(lock), "busy"):
        assert lock.read_text() == f"{os.getpid()} {HOST}"
    common.check_writable(str(tmp_path), "choose another folder")
    assert victim.read_text() == "precious" and json.loads(path.read_text()) == {"a": 1}
    assert sorted(os.listdir(tmp_path)) == sorted([".write_test.%d.tmp" % os.getpid(), "result.json", "victim"])
    # the temporary is created exclusively: one that is not removed first (a race) stops the write
    monkeypatch.setattr(common, "remove_stale_temporaries", lambda path: None)
    os.symlink(victim, common.temporary_name(str(path)))
    with pytest.raises(
        common.DataError,
        match=r"^cannot write .*result.json: .*result.json\.\d+\..*\.tmp is in the way "
        r"\(not a file this process made\); remove it$",
    ):
        common.write_json(str(path), {"a": 2})
    assert victim.read_text() == "precious" and json.loads(path.read_text()) == {"a": 1}


def test_a_killed_writers_temporaries_are_removed_by_the_next_write_of_that_path(tmp_path):
    dead, host = finished_pid(), HOST
    stale = [
        tmp_path / f"result.json.{dead}.{host}.tmp",  # a writer killed mid-write
        tmp_path / f"result.json.{os.getpid()}.{host}.tmp",  # an earlier process that had this pid
        tmp_path / f"lock.{dead}.{host}.tmp",
    ]  # a pid_lock killed before linking its lock
    kept = [
        tmp_path / f"result.json.{os.getppid()}.{host}.tmp",  # a live writer's
        tmp_path / f"result.json.{dead}.another-host.tmp",  # another host's: its pid cannot be checked here
        tmp_path / f"other.json.{dead}.{host}.tmp",  # another path's
        tmp_path / f"result.json.backup.{dead}.{host}.tmp",
    ]  # not the pattern
    for p in stale + kept:
        p.write_text("partial")
    (tmp_path / f"result.json.{dead + 1}.{host}.tmp").mkdir()  # a folder is nobody's temporary: left, no error
    common.write_json(str(tmp_path / "result.json"), {"a": 1})
    with common.pid_lock(str(tmp_path / "lock"), "busy"):
        pass
    assert sorted(os.listdir(tmp_path)) == sorted(
        [p.name for p in kept] + ["result.json", f"result.json.{dead + 1}.{host}.tmp"]
    )


TERMINATED_MID_WRITE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import common
signal.signal(signal.SIG{name}, signal.SIG_DFL)  # its default action, as from a terminal (nohup ignores SIGHUP)
def write(tmp):
    with open(tmp, "w") as f:
        f.write("half a report")
    os.kill(os.getpid(), signal.SIG{name})  # as timeout(1) or a closed terminal would, before the rename
common.write_text(sys.argv[1], "old")
common.write_atomic(sys.argv[1], write)
print("not reached")
"""


TERMINATED_ONCE_CREATED = """
import os, signal, sys
sys.path.insert(0, {root!r})
import common
def open_then_terminated(*args):  # SIGTERM lands just after the temporary is created, before anything is written
    f = open(*args)
    os.kill(os.getpid(), signal.SIGTERM)
    return f
common.write_text(sys.argv[1], "old")
common.open = open_then_terminated
common.write_text(sys.argv[1], "new")
print("not reached")
"""


def test_a_write_killed_just_after_creating_its_temporary_leaves_none(tmp_path):
    import signal

    proc = subprocess.run(
        [sys.executable, "-c", TERMINATED_ONCE_CREATED.format(root=ROOT), str(tmp_path / "report.md")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGTERM and proc.stdout == ""
    assert os.listdir(tmp_path) == ["report.md"] and (tmp_path / "report.md").read_text() == "old"


@pytest.mark.parametrize("name", ["TERM", "HUP"])
def test_a_write_killed_by_sigterm_or_sighup_leaves_no_temporary(tmp_path, name):
    import signal

    proc = subprocess.run(
        [sys.executable, "-c", TERMINATED_MID_WRITE.format(root=ROOT, name=name), str(tmp_path / "report.md")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -getattr(signal, f"SIG{name}") and proc.stdout == ""  # it died of the signal
    assert os.listdir(tmp_path) == ["report.md"] and (tmp_path / "report.md").read_text() == "old"
    # a handler someone installed (train.py's stop at a step boundary) is kept, in force while writing too
    seen, hangup = [], signal.getsignal(signal.SIGHUP)  # SIG_IGN under nohup
    before = signal.signal(signal.SIGTERM, lambda *a: seen.append(a[0]))
    try:
        common.write_atomic(
            str(tmp_path / "x"), lambda tmp: (os.kill(os.getpid(), signal.SIGTERM), open(tmp, "w").close())
        )
        assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert signal.getsignal(signal.SIGHUP) == hangup  # restored after each write


LOCK = """
import sys
sys.path.insert(0, {root!r})
from common import DataError, pid_lock
try:
    with pid_lock(sys.argv[1], "the folder is in use"):
        print("locked")
except DataError as e:
    sys.exit(f"error: {{e}}")
"""


@pytest.mark.parametrize("kind", ["dangling symlink", "symlink to a lock", "folder", "fifo"])
def test_a_lock_that_is_not_a_file_is_one_line_at_once(tmp_path, kind):
    lock = tmp_path / "lock"
    if kind == "dangling symlink":
        os.symlink(tmp_path / "nowhere", lock)
    elif kind == "symlink to a lock":
        (tmp_path / "real").write_text(f"{finished_pid()} {HOST}")
        os.symlink(tmp_path / "real", lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    # a subprocess with a timeout: the lock loop must end, not spin
    proc = subprocess.run(
        [sys.executable, "-c", LOCK.format(root=ROOT), str(lock)], capture_output=True, text=True, timeout=30
    )
    what = {"folder": "a folder", "fifo": "not a file"}.get(kind, "a symlink")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: {lock} is {what}, not a lock (a file holding a pid and a host); remove it\n"
    assert os.path.lexists(lock) and sorted(os.listdir(tmp_path)) == sorted(
        ["lock"] + ["real"] * (kind == "symlink to a lock")
    )


def test_a_lock_held_by_a_dead_process_is_taken_over_and_a_live_one_is_not(tmp_path):
    lock = tmp_path / "lock"
    for dead in (
        f"{finished_pid()} {HOST}",
        f"{finished_pid()} {HOST}\n",
    ):  # a newline (echo, an editor): still this host's
        lock.write_text(dead)
        with common.pid_lock(str(lock), "busy"):
            assert lock.read_text() == f"{os.getpid()} {HOST}"
        assert not lock.exists()
    for holder in (f"{os.getppid()} {HOST}", "12 another-host", f"{10**30} {HOST}"):  # 10**30: no pid is that large
        lock.write_text(holder)
        if holder.startswith(str(10**30)):
            with common.pid_lock(str(lock), "busy"):  # no such process: stale
                pass
            continue
        with pytest.raises(
            common.DataError, match=rf"^busy by pid {holder.split()[0]} on {holder.split()[1]}; wait for it"
        ):
            with common.pid_lock(str(lock), "busy"):
                pass
        assert lock.read_text() == holder and os.listdir(tmp_path) == ["lock"]


def test_a_lock_of_this_very_pid_is_stale_unless_this_process_holds_it(tmp_path):
    # a container or pid-namespace restart: the new process has the old one's pid and host, and holds no lock yet
    lock = tmp_path / "lock"
    lock.write_text(f"{os.getpid()} {HOST}")
    with common.pid_lock(str(lock), "busy"):
        assert lock.read_text() == f"{os.getpid()} {HOST}" and os.listdir(tmp_path) == ["lock"]
        with pytest.raises(common.LockHeld, match=rf"^busy by pid {os.getpid()} on {HOST}; wait"):
            common.take_lock(str(lock), "busy")  # the lock this process holds is still held
    assert not lock.exists() and not common.held_locks


@pytest.mark.parametrize("text", ["garbage\x1b[31m red\nmore", "12 \x00host", "x"])
def test_a_lock_naming_no_process_is_held_and_shown_escaped(tmp_path, text):
    lock = tmp_path / "lock"
    lock.write_text(text)
    with pytest.raises(common.LockHeld) as err:
        common.take_lock(str(lock), "busy")
    message = str(err.value)
    assert message.startswith("busy by a lock naming no process (") and f"remove {lock} if" in message, message
    assert message.isprintable() and not err.value.alive, "a lock's raw control characters reach the terminal"
    assert lock.read_text() == text


def test_two_workers_taking_over_one_stale_lock_leave_it_to_the_first(tmp_path, monkeypatch):
    # B read the dead pid, then A took the lock over (here: A's lock, a live pid, is at the name) before
    # B acted on its read: B must find A's lock, not remove it and take the cell too
    lock, dead, live = tmp_path / "lock", f"{finished_pid()} {HOST}", f"{os.getppid()} {HOST}"
    lock.write_text(live)
    read_lock, reads = common.read_lock, []

    def stale_first_read(path):
        reads.append(path)
        return tuple(dead.split()) if len(reads) == 1 else read_lock(path)

    monkeypatch.setattr(common, "read_lock", stale_first_read)
    with pytest.raises(common.LockHeld, match=rf"^busy by pid {os.getppid()} on {HOST}; wait for it"):
        common.take_lock(str(lock), "busy")
    assert lock.read_text() == live and os.listdir(tmp_path) == ["lock"]
    lock.write_text(dead)  # a stale lock that no one else touches is still taken over, and nothing is left beside it
    with common.pid_lock(str(lock), "busy"):
        assert lock.read_text() == f"{os.getpid()} {HOST}" and os.listdir(tmp_path) == ["lock"]


def test_check_writable_makes_the_folder_and_leaves_nothing_in_it(tmp_path):
    folder = tmp_path / "a" / "b"
    common.check_writable(str(folder), "choose another --out_dir")
    assert folder.is_dir() and os.listdir(folder) == []
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(common.DataError) as err:
            common.check_writable(str(bad), "choose another --out_dir")
        assert str(err.value).startswith(f"cannot write into {bad} (") and str(err.value).endswith(
            "); choose another --out_dir"
        )


def test_read_json_is_strict(tmp_path):
    path = tmp_path / "x.json"
    for text, why in (
        ('{"loss": NaN}', "NaN is not JSON"),
        ('[Infinity]', "Infinity is not JSON"),
        ('[-Infinity]', "-Infinity is not JSON"),
        ('{"a": 1', "Expecting"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            common.read_json(str(path))
    path.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(ValueError):  # not UTF-8: a UnicodeDecodeError, which is a ValueError
        common.read_json(str(path))
    path.write_text('{"a": [1, 2.5, null]}')
    assert common.read_json(str(path)) == {"a": [1, 2.5, None]}
    with pytest.raises(FileNotFoundError):
        common.read_json(str(tmp_path / "missing.json"))


def test_a_cell_is_trained_by_one_process_at_a_time(shards, tmp_path, capsys):
    cell, host = tmp_path / "o" / "attnres" / "seed0", socket.gethostname()
    lock = cell / "lock"
    with common.cell_lock(str(cell), True) as holder:
        assert holder is None and lock.read_text() == f"{os.getpid()} {host}"
        with common.cell_lock(str(cell), True) as holder:  # held: who holds it, and the lock stays theirs
            assert holder == f"pid {os.getpid()} on {host}"
        assert lock.read_text() == f"{os.getpid()} {host}"
    assert not lock.exists()
    # a lock whose process is gone from this host is taken over, and released however the cell ends
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    lock.write_text(f"{gone.pid} {host}")
    with pytest.raises(KeyboardInterrupt):
        with common.cell_lock(str(cell), True) as holder:
            assert holder is None and lock.read_text() == f"{os.getpid()} {host}"
            raise KeyboardInterrupt
    assert not lock.exists()
    # another host's lock cannot be checked from here; ranks other than 0 take none
    lock.write_text(f"{gone.pid} elsewhere")
    with common.cell_lock(str(cell), True) as holder:
        assert holder == f"pid {gone.pid} on elsewhere"
    with common.cell_lock(str(cell), False) as holder:
        assert holder is None and lock.read_text() == f"{gone.pid} elsewhere"
    # train.py leaves a cell that a live process trains to it, says so, and writes no report
    lock.write_text(f"{os.getppid()} {host}")
    train.main(tiny(shards, tmp_path / "o", "--arms=attnres"))
    out = capsys.readouterr().out
    assert (
        f"[attnres seed0] being trained by pid {os.getppid()} on {host}: left to it (if that process is gone, "
        f"rm {lock} and run again)" in out
    ), "a reused pid would hold the cell without naming its lock"
    assert "the last worker to finish writes the report" in out
    assert sorted(os.listdir(cell)) == ["lock"] and not os.path.exists(tmp_path / "o" / "report.md")


def test_a_worker_restarted_with_its_old_pid_trains_the_cell_and_a_garbage_lock_is_named(shards, tmp_path, capsys):
    cell = tmp_path / "attnres" / "seed0"
    cell.mkdir(parents=True)
    (cell / "lock").write_text(f"{os.getpid()} {HOST}")  # left by this pid before a container restart
    train.main(tiny(shards, tmp_path, "--arms=attnres", "--max_iters=2", "--eval_interval=2"))
    assert (cell / "result.json").exists() and not (cell / "lock").exists()
    capsys.readouterr()
    other = tmp_path / "o"
    (other / "attnres" / "seed0").mkdir(parents=True)
    (other / "attnres" / "seed0" / "lock").write_text("\x1b]0;pwned\x07 x")
    train.main(tiny(shards, other, "--arms=attnres", "--max_iters=2", "--eval_interval=2"))
    out = capsys.readouterr().out
    assert (
        "being trained by a lock naming no process ('\\x1b]0;pwned\\x07 x'): left to it (if that process is "
        f"gone, rm {other / 'attnres' / 'seed0' / 'lock'} and run again)" in out
    ), out
    assert "\x1b" not in out


def test_a_lock_appears_with_its_content_and_an_empty_one_is_taken_over(tmp_path):
    cell = tmp_path / "arm" / "seed0"
    cell.mkdir(parents=True)
    (cell / "lock").write_text("")  # an older version killed between creating the lock and writing it
    with common.cell_lock(str(cell), True):
        assert (cell / "lock").read_text().split()[0] == str(os.getpid())
        assert sorted(os.listdir(cell)) == ["lock"]  # the written file it was linked from is gone
    assert os.listdir(cell) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot create the cell folder .*file/seed0 .*move away the file"):
        with common.cell_lock(str(tmp_path / "file" / "seed0"), True):
            pass
