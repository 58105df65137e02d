"""opus.cpp_build: a build killed outright leaves torch's lock file behind, and the next build must not wait on
it for ever; while another process is building, the next one waits for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from opus import cpp_build

HOLDER = """
import fcntl, pathlib, sys, time
directory = pathlib.Path(sys.argv[1])
guard = open(directory / "opus-build.lock", "a")
fcntl.flock(guard, fcntl.LOCK_EX)
(directory / "lock").touch()  # what torch's cpp_extension writes while it builds
print("building", flush=True)
time.sleep(120)
"""


def test_a_lock_left_by_a_build_killed_mid_way_is_removed_and_a_live_build_waited_for(tmp_path, capsys) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "building"
        entered = threading.Event()

        def build() -> None:
            with cpp_build.build_guard(tmp_path):
                entered.set()

        waiting = threading.Thread(target=build, daemon=True)
        waiting.start()
        assert not entered.wait(1.0)  # the holder is alive: its build may still finish
        holder.send_signal(signal.SIGKILL)
        assert entered.wait(30.0)  # the kernel dropped the dead holder's flock
        waiting.join(5.0)
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "lock").exists()
    assert f"opus: removed {tmp_path / 'lock'}, left by a build that did not finish" in capsys.readouterr().err
    with cpp_build.build_guard(tmp_path):  # nothing left: nothing said
        pass
    assert capsys.readouterr().err == ""
