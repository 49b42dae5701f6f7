"""`python -m rigpilot.engine.workers <job_dir>`: one rank of a job (see engine/workers/__init__.py for the contract)."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from rigpilot.engine.diskspace import DiskFull, disk_full, is_disk_full, no_room
from rigpilot.engine.errors import UserError, jsonable
from rigpilot.engine.jobspec.secrets import plain
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.report import METRICS_DIR_ENV, report
from rigpilot.engine.workers import (
    ERROR_PREFIX,
    EXIT_CANCELLED,
    EXIT_CRASH,
    EXIT_DISK_FULL,
    EXIT_OUT_OF_MEMORY,
    EXIT_USER_ERROR,
)
from rigpilot.engine.workers.script import ScriptExit


def read_spec(job_dir: Path) -> JobSpec:
    path = job_dir / "job.json"
    if not path.is_file():
        raise UserError(f"{path} not found: not a job folder")
    try:
        return JobSpec.read(job_dir)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: not a valid job spec ({e})") from e


# Set once a kind whose resources the worker owns has started (not "script": a user's script may
# register atexit handlers that must run).
_skip_interpreter_teardown = False


class JobCancelled(BaseException):
    """SIGTERM while there is nothing to save (loading, generating, measuring): stop at once.

    A BaseException, so no library's `except Exception` swallows it.
    """


def _stop_now(signum: int, frame: Any) -> None:
    raise JobCancelled


def _import_phases() -> None:
    """Report the start-up phases the job view shows while torch and transformers are imported.

    A rank forked by the warm worker (engine.launch.warm) has them imported already and passes both at once.
    """
    report(kind="status", phase="importing", module="torch")
    import torch  # noqa: F401

    report(kind="status", phase="importing", module="transformers")
    import transformers  # noqa: F401


def run(spec: JobSpec, job_dir: Path) -> int:
    global _skip_interpreter_teardown
    if spec.kind in {"train", "infer", "calibrate", "doctor", "serve"}:
        _skip_interpreter_teardown = True
        # The training loop swaps in its own handler, which finishes the step and checkpoints.
        signal.signal(signal.SIGTERM, _stop_now)
        _import_phases()
    if spec.kind == "train":
        from rigpilot.engine.workers.train import run_train

        return run_train(spec, job_dir)
    if spec.kind == "infer" and spec.infer is not None and spec.infer.backend == "vllm":
        # Chosen at submit (engine.capability.choose_infer_backend): one process, vLLM starts its own workers.
        from rigpilot.engine.workers.infer_vllm import run_infer_vllm

        return run_infer_vllm(spec, job_dir)
    if spec.kind == "infer":
        from rigpilot.engine.workers.infer import run_infer

        return run_infer(spec, job_dir)
    if spec.kind == "serve":
        from rigpilot.engine.workers.serve import run_serve

        return run_serve(spec, job_dir)
    if spec.kind == "calibrate":
        from rigpilot.engine.workers.calibrate import run_calibrate

        return run_calibrate(spec, job_dir)
    if spec.kind == "doctor":
        from rigpilot.engine.workers.doctor import run_doctor

        return run_doctor(spec, job_dir)
    if spec.kind == "script":
        from rigpilot.engine.workers.script import run_script

        return run_script(spec, job_dir)
    raise UserError(f"unknown job kind {spec.kind!r}: use train, infer, serve, calibrate, doctor or script")


def first_line(e: BaseException) -> str:
    """`Type: first non-blank line of the message` (some errors start their message with a newline)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def fail(message: str) -> None:
    """The last line of the rank's log: one line a person (and the service) can read."""
    try:
        sys.stdout.flush()
        print(f"{ERROR_PREFIX} {' '.join(message.split())}", file=sys.stderr, flush=True)
    except OSError:  # the log is on a full disk too: the exit code still says why
        pass


def _report_quietly(**values: Any) -> None:
    """report(), where a full disk must not turn the rank's own failure report into a second failure."""
    try:
        report(**values)
    except OSError:
        pass


def _refusal_facts(e: UserError) -> dict[str, Any]:
    """The refusal's reason and its scalar fields beside the record's own keys, as a disk_full record has
    them: the job's error is worded from these, never from the line."""
    own = {"time", "rank", "run", "step", "kind", "error", "message", "reason"}
    facts = {k: v for k, v in jsonable(e.fields).items() if k not in own and _flat(v)}
    return {"reason": e.reason, **facts}


def _flat(v: Any) -> bool:
    """A scalar, or a list of scalars (a refusal's `choices`): what a record carries beside its own keys."""
    scalar = (int, float, str, bool)
    return isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))


def _disk_full(e: BaseException, job_dir: Path) -> DiskFull:
    """A DiskFull for an ENOSPC met outside a checkpoint (a metrics line, the log, the exported model)."""
    if isinstance(e, DiskFull):
        return e
    name = getattr(e, "filename", None) if isinstance(e, OSError) else None
    return disk_full(Path(name).parent if isinstance(name, str) else job_dir)


def _report_oom(error: BaseException) -> None:
    import torch

    numbers: dict[str, int | str] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        numbers = {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "free": free,
            "total": total,
        }
    first_line = str(error).splitlines()[0] if str(error) else ""
    report(None, kind="error", error="out_of_memory", message=first_line, **numbers)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        fail("usage: python -m rigpilot.engine.workers <job_dir>")
        return EXIT_USER_ERROR
    job_dir = Path(argv[0]).resolve()
    os.environ.setdefault(METRICS_DIR_ENV, str(job_dir / "metrics"))
    try:
        spec = read_spec(job_dir)
        # Before torch and transformers are imported: some of them are read at import time.
        # Masked secrets (engine.jobspec.secrets) reach the ranks through the environment the engine set.
        os.environ.update(plain(spec.env))
        return run(spec, job_dir)
    except DiskFull as e:
        return _fail_disk_full(e)
    except UserError as e:
        _report_quietly(kind="error", error="user_error", message=str(e), **_refusal_facts(e))
        fail(str(e))
        return EXIT_USER_ERROR
    except JobCancelled:
        _report_quietly(kind="status", phase="cancelled", exit_code=EXIT_CANCELLED)
        print("rigpilot-worker: cancelled (SIGTERM) before there was anything to save", file=sys.stderr, flush=True)
        return EXIT_CANCELLED
    except ScriptExit as e:
        _report_quietly(kind="error", error="script_exit", message=str(e), exit_code=e.code)
        fail(str(e))
        return e.code
    except Exception as e:
        if is_disk_full(e) or no_room(job_dir):
            return _fail_disk_full(_disk_full(e, job_dir))
        if type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("torch"):
            _report_oom(e)
            fail(f"out of GPU memory: {str(e).splitlines()[0] if str(e) else ''}")
            return EXIT_OUT_OF_MEMORY
        traceback.print_exc()
        _report_quietly(kind="error", error="crash", message=first_line(e))
        fail(first_line(e))
        return EXIT_CRASH
    finally:
        if "torch" in sys.modules:
            from rigpilot.engine.workers.parallel_dims import shutdown

            try:
                shutdown()
            except Exception:  # a broken group must not hide the job's own outcome
                pass


def _fail_disk_full(e: DiskFull) -> int:
    _report_quietly(kind="error", error="disk_full", message=str(e), **e.fields)
    fail(str(e))
    return EXIT_DISK_FULL


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    if _skip_interpreter_teardown:
        # Tearing down an interpreter that holds torch and transformers takes a second or more on
        # every rank, and nothing is left to clean up: the process group is gone, metrics are written
        # line by line, and the outputs were written and renamed into place already.
        os._exit(code)
    sys.exit(code)
