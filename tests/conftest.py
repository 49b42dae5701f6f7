import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

REPO = Path(__file__).resolve().parents[1]
# Real nvidia-smi outputs live beside the checkout (../shared), also in CI.
SMI_DATA = REPO.parent / "shared" / "testdata" / "nvidia-smi"


@pytest.fixture
def smi_data() -> Path:
    if not SMI_DATA.is_dir():
        pytest.fail(f"test data missing: {SMI_DATA} (the shared/ folder must sit beside the checkout)")
    return SMI_DATA
