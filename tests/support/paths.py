"""The checkout's folders, computed once, from where this file sits (tests/support/)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
TINY_LLAMA_CONFIG = REPO / "examples" / "models" / "tiny-llama" / "config.json"
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"
CHAT = REPO / "examples" / "data" / "chat.jsonl"
# Real nvidia-smi outputs live beside the checkout (../shared), also in CI.
SMI_DATA = REPO.parent / "shared" / "testdata" / "nvidia-smi"
