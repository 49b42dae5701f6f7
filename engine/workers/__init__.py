"""The worker side of a job: what each rank runs under torchrun.

Entry point (the engine service starts it; so can a person, by hand):

    python -m torch.distributed.run --nproc-per-node N --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:<port> -m rigpilot.engine.workers <job_dir>

Every rank reads `<job_dir>/job.json` (`rigpilot.engine.jobspec.spec.JobSpec`) and runs the
job's kind: "train", "infer", "calibrate" or "script". Progress goes through
`rigpilot.engine.report` into `<job_dir>/metrics/rank<N>.jsonl`; results into
`<job_dir>/output/`; checkpoints into `<job_dir>/checkpoints/`.

A rank that fails prints one line starting with `rigpilot-worker: error:` as
the last line of its log and exits with one of the codes below, which the
service can tell apart without parsing logs. This module imports no torch so
the service can read the codes.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1  # a bug or an unexpected failure: the traceback is in the log
EXIT_USER_ERROR = 2  # bad input the user can fix (dataset, model, parallelism), same as the CLI's code
EXIT_OUT_OF_MEMORY = 3  # torch.OutOfMemoryError; the allocator's numbers were reported first
EXIT_DISK_FULL = 4  # a write found no room (engine.diskspace); a checkpoint being written was removed
EXIT_CANCELLED = 143  # SIGTERM: the current step finished and a complete checkpoint was written (128 + 15)

ERROR_PREFIX = "rigpilot-worker: error:"
