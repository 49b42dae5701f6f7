"""`nodes list` asks every node at once: engines that accept a connection and never answer (a machine
half gone) are waited for side by side, each reported unreachable in one line, in the registry's order."""

from __future__ import annotations

import socket
import threading

from rigpilot.engine.service import nodes


def test_silent_nodes_are_probed_side_by_side_and_each_reported():
    listeners = []
    held: list[socket.socket] = []
    together = threading.Semaphore(0)
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        listeners.append(s)

    def accept(s: socket.socket) -> None:
        try:
            conn, _ = s.accept()
        except OSError:
            return
        held.append(conn)  # accepted, never answered: the probe waits for its timeout
        together.release()

    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in listeners]
    for t in threads:
        t.start()
    found = [nodes.Node(f"box{i}", f"127.0.0.1:{s.getsockname()[1]}", "t" * 43) for i, s in enumerate(listeners)]
    seen_at_once = []

    def watch() -> None:
        # Every silent node holds a connection before the first probe's 2 s timeout has run out.
        seen_at_once.append(all(together.acquire(timeout=1.5) for _ in found))

    watcher = threading.Thread(target=watch)
    watcher.start()
    listed = nodes.probe_all(found, timeout=2.0)
    watcher.join()
    for s in [*listeners, *held]:
        s.close()
    assert seen_at_once == [True]
    assert [n["name"] for n in listed] == ["box0", "box1", "box2"]
    assert all(not n["reachable"] and n["error"] and "\n" not in n["error"] for n in listed)
    assert all("token" not in n for n in listed)
