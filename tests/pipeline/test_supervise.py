"""The watchdog's reading of a worker's messages: a stall, and the longer wait while torch compiles."""

from __future__ import annotations

import json
import os

from opus.pipeline.supervise import _Listener, stall_reason


def test_a_compile_gets_its_own_limit_never_a_shorter_one() -> None:
    assert stall_reason(11, False, stall_timeout_s=10, compile_timeout_s=100) == "no progress for 10 s; stopped"
    assert stall_reason(11, True, stall_timeout_s=10, compile_timeout_s=100) is None
    assert "torch compiled for 100 s" in stall_reason(101, True, stall_timeout_s=10, compile_timeout_s=100)
    # A compile limit below the stall limit does not make the watchdog stricter while compiling.
    assert stall_reason(9, True, stall_timeout_s=10, compile_timeout_s=5) is None
    assert stall_reason(11, True, stall_timeout_s=10, compile_timeout_s=5).endswith("(run.stall_timeout_s)")
    assert stall_reason(101, True, stall_timeout_s=10, compile_timeout_s=100).endswith("(run.compile_timeout_s)")
    assert stall_reason(9, False, stall_timeout_s=10, compile_timeout_s=5) is None
    # Where the worker was: its last progress message's phase.
    assert stall_reason(11, False, 10, 100, "P 3/8") == "no progress for 10 s (last: P 3/8); stopped"


def test_listener_follows_compile_start_and_end() -> None:
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    seen: list[dict] = []
    listener = _Listener(read_fd, seen.append)
    messages = [{"t": "progress", "done": 1, "total": 8, "what": "P"},
                {"t": "progress", "done": 1, "what": "P", "compiling": True},
                {"t": "log", "message": "a log line while compiling"},
                {"t": "progress", "done": 1, "what": "P"},  # a plain message while compiling: still compiling
                {"t": "progress", "done": 1, "what": "P", "compiling": False}]
    states = []
    for message in messages:
        listener.receive(json.dumps(message) + "\n")
        states.append(listener.compiling)
    assert states == [False, True, True, True, False] and listener.last_phase == "P 1"
    listener.receive(json.dumps({"t": "progress", "done": 3, "total": 8, "what": "P"}) + "\n")
    assert listener.last_phase == "P 3/8"  # what a stopped stage's rollback names
    assert seen[:5] == messages
    listener.receive("not json\n")  # a heartbeat all the same, and nothing passed on
    assert len(seen) == 6
    listener.stream.close()
