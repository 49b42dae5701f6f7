"""The README's `examples/…` paths work wherever Rigpilot is installed: the shipped examples stand in, and say so.

The installed package runs every README command that uses them (tests/packaging/test_packaging.py); here, the rule itself,
from folders with and without an examples/ of their own, through the real command line.
"""

from __future__ import annotations

import json
import shutil

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.examples import EXAMPLES, shipped_example

TINY = "examples/models/tiny-llama"


def test_the_shipped_examples_are_where_the_package_data_is():
    assert (EXAMPLES / "models/tiny-llama/config.json").is_file() and (EXAMPLES / "data/shakespeare.txt").is_file()


@pytest.mark.parametrize("given, expected", [
    ("examples/data/shakespeare.txt", "data/shakespeare.txt"),
    ("./examples/models/tiny-llama", "models/tiny-llama"),
    ("examples/data/no-such-file.txt", None),  # not shipped: left alone, and "does not exist" says so
    ("examples/../README.md", None),  # never outside the examples
    ("examples", None),
    ("examples/", None),
    ("data/shakespeare.txt", None),  # only what starts with examples/
    ("llama-2-7b", None),
])  # fmt: skip
def test_which_paths_the_shipped_examples_stand_in_for(tmp_path, given, expected):
    found = shipped_example(given, tmp_path)
    assert found == (EXAMPLES / expected if expected else None)


def test_a_folder_with_its_own_examples_keeps_them(tmp_path):
    (tmp_path / "examples/data").mkdir(parents=True)
    (tmp_path / "examples/data/shakespeare.txt").write_text("my own\n")
    assert shipped_example("examples/data/shakespeare.txt", tmp_path) is None


def test_the_command_line_uses_the_shipped_example_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["plan", "--model", TINY, "--task", "train", "--simulate", "4x-rtx4090", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err == f"rigpilot: no {TINY} here; using the example Rigpilot ships: {EXAMPLES / 'models/tiny-llama'}\n"
    assert json.loads(out)["schema"].startswith("rigpilot.plan")


def test_the_command_line_uses_a_local_examples_folder_as_given(tmp_path, monkeypatch, capsys):
    shutil.copytree(EXAMPLES / "models/tiny-llama", tmp_path / TINY)
    monkeypatch.chdir(tmp_path)
    rc = main(["plan", "--model", TINY, "--task", "train", "--simulate", "4x-rtx4090", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", err
    assert json.loads(out)["workload"]["model"] == TINY  # as given: the folder it names is this one's own


def test_the_app_options_come_first_or_say_so(capsys):
    assert main(["--self-test"]) == 2  # reached argparse: it was not the first word the launcher saw
    assert capsys.readouterr().err == "rigpilot: error: --self-test comes first, on its own: rigpilot --self-test [DIR]\n"


def test_every_option_that_names_a_file_takes_the_shipped_example(tmp_path, monkeypatch, capsys):
    """The train data and the prompts file as well as the model: their options' names come from the settings'
    declarations, and a renamed one must still be looked at (the packaging test found --data left out once)."""
    from rigpilot.engine.cli.entry import _use_shipped_examples, build_parser

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    train = parser.parse_args(["run", "train", "--model", TINY, "--data", "examples/data/shakespeare.txt",
                               "--data", "mine.txt"])  # fmt: skip
    _use_shipped_examples(train)
    assert train.dataset == [str(EXAMPLES / "data/shakespeare.txt"), "mine.txt"]
    infer = parser.parse_args(["run", "infer", "--model", TINY, "--prompts", "examples/data/chat.jsonl"])
    _use_shipped_examples(infer)
    assert infer.prompts_file == str(EXAMPLES / "data/chat.jsonl")
    assert capsys.readouterr().err.count("using the example Rigpilot ships") == 4  # two models, two files
