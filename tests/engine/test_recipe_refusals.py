"""A recipe the capability contract refuses is refused at submission, before anything is created: one line from
the CLI (`rigpilot run train … --optimizer-in-backward --grad-accum 2`), a coded error (`recipe_refused`, with
the setting and its value) from the socket, against a real engine service on the simulated 4×RTX 4090."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rigpilot.engine import paths
from rigpilot.engine.cli.entry import main as cli_main

from support.engine import Engine, engine_home
from support.paths import SHAKESPEARE, TINY_LLAMA_CONFIG

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    base = tmp_path_factory.mktemp("recipe")
    with pytest.MonkeyPatch.context() as mp:
        engine_home(base, mp)
        e = Engine(base)
        e.start()
        try:
            yield e
        finally:
            e.stop()


TRAIN = ["run", "train", "--model", str(TINY_LLAMA_CONFIG), "--method", "scratch", "--data", str(SHAKESPEARE)]
CASES = [
    (
        ["--optimizer-in-backward", "--grad-clip", "0", "--grad-accum", "2"],
        "gradients cannot be accumulated over 2 micro-batches",
    ),
    (["--optimizer-in-backward", "--grad-clip", "1"], "so it cannot clip: use gradient clipping 0"),
    (["--fp8", "--precision", "bf16"], "this job runs as CPU ranks"),
    # A switch reads as its flag in a conflict, not "--fp8 True".
    (["--fp8", "--precision", "fp16"], "rigpilot: error: --fp8 needs --precision bf16 (it is fp16)"),
    # Under DDP the step in backward frees no gradient: refused, whatever an old job.json asked.
    (["--optimizer-in-backward", "--grad-clip", "0", "--dp", "2"], "saves no memory under DDP"),
]


@pytest.mark.parametrize(("flags", "words"), CASES)
def test_a_refused_recipe_is_one_line_from_the_cli_and_nothing_is_created(
    engine: Engine, capsys: pytest.CaptureFixture[str], flags: list[str], words: str
) -> None:
    rc = cli_main([*TRAIN, *flags, "--detach"])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if not ln.startswith("note: ")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("rigpilot: error: "), (rc, out, err)
    assert words in lines[0] and "Traceback" not in out + err
    assert not list(paths.jobs_dir().iterdir()) if paths.jobs_dir().exists() else True


def test_the_socket_answers_the_refusal_with_its_code_and_setting(engine: Engine) -> None:
    from rigpilot.engine.api.client import EngineError

    spec = {
        "kind": "train", "model": str(TINY_LLAMA_CONFIG),
        "train": {"method": "scratch", "dataset": [str(SHAKESPEARE)], "optimizer_in_backward": True, "grad_accum": 2,
                  "grad_clip": 0.0},
    }  # fmt: skip
    with engine.client() as c, pytest.raises(EngineError) as e:
        c.request("submit", spec=spec, cwd=str(Path.cwd()))
    assert e.value.reason == "recipe_refused"
    assert e.value.fields == {"setting": "train.optimizer_in_backward", "value": True}


def test_an_accepted_recipe_passes_the_check(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--optimizer", "adamw8bit", "--precision", "bf16", "--master-weights", "bf16", "--optimizer-in-backward"]
    rc = cli_main([*TRAIN, *flags, "--grad-clip", "0", "--check"])
    out, err = capsys.readouterr()
    assert rc == 0, (out, err)
