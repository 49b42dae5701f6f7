"""Whether a process is still running, as the helpers that stop daemons and chroots judge it."""

from pathlib import Path


def alive(pid: int) -> bool:
    """Still running: a zombie (dead, waiting for its parent to read its status) is not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
