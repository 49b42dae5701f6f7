"""Requests about scaling studies (engine.jobs.scaling): the same training on 1, 2, 4 … GPUs, one job per count."""

from __future__ import annotations

from typing import Annotated, Any

from rigpilot.engine.api.protocol import Limit, Path_, Text
from rigpilot.engine.jobspec.spec import TRAIN_SETTINGS as _TRAIN
from rigpilot.engine.service.connection import Connection
from rigpilot.engine.service.handling import Engine, RequestGroup

REQUESTS = RequestGroup()


@REQUESTS.request(
    "scaling_start",
    required={"gpus": Annotated[list[Annotated[int, Limit(1, 4096)]], Limit(max_len=8)]},
    optional={
        "job": Text, "model": Path_, "trust_remote_code": bool,
        # A study's jobs are training jobs: their settings' allowed values are the job's (engine.jobspec.spec).
        "dataset": Annotated[list[Path_], Limit(max_len=256)], "method": Annotated[str, _TRAIN["method"]],
        "precision": Annotated[str, _TRAIN["precision"]], "seq_len": Annotated[int, _TRAIN["seq_len"]],
        "global_batch": Annotated[int, Limit(1, 1 << 20)], "micro_batch": Annotated[int, _TRAIN["micro_batch"]] | None,
        "steps": Annotated[int, Limit(1, 1_000_000)], "warmup": Annotated[int, Limit(0, 1_000_000)],
        "cwd": Path_ | None,
    },
)  # fmt: skip
def scaling_start(engine: Engine, conn: Connection, gpus: list[int], cwd: str | None = None, **request: Any) -> Any:
    return {"study": engine.studies.start({"gpus": gpus, **request}, cwd)}


@REQUESTS.request("scaling_study", required={"study": Text})
def scaling_study(engine: Engine, conn: Connection, study: str) -> Any:
    return {"study": engine.studies.get(study)}


@REQUESTS.request("scaling_studies", optional={"job": Text | None})
def scaling_studies(engine: Engine, conn: Connection, job: str | None = None) -> Any:
    return {"studies": engine.studies.list(job)}


@REQUESTS.request("scaling_cancel", required={"study": Text})
def scaling_cancel(engine: Engine, conn: Connection, study: str) -> Any:
    return {"study": engine.studies.cancel(study)}
