"""User settings, stored as JSON in the XDG config directory.

A settings file that cannot be read is never overwritten: it is set aside as
`settings.json.bad` (so nothing the user wrote is lost) and defaults are used,
with a warning the caller shows once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

APP = "rigpilot"


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP))


def state_dir() -> Path:
    return Path(platformdirs.user_state_dir(APP))


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP))


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP))


@dataclass
class Settings:
    simulated_profile: str = "4x-rtx4090"  # the machine shown when no NVIDIA GPU is present
    max_cpu_ranks: int = 4  # ranks per job on a simulated machine, each a CPU process (also capped at the CPU count)
    warnings: list[str] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def path(cls) -> Path:
        return config_dir() / "settings.json"

    @classmethod
    def load(cls) -> Settings:
        f = cls.path()
        try:
            raw = json.loads(f.read_text())
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            bad = f.with_suffix(".json.bad")
            try:
                os.replace(f, bad)
                kept = f"kept as {bad}"
            except OSError:
                kept = "left in place"
            return cls(warnings=[f"settings file {f} is unreadable ({e}); using defaults, your file is {kept}"])
        known = {x.name for x in dataclasses.fields(cls)} - {"warnings"}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def save(self) -> None:
        f = self.path()
        f.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "warnings"}
        tmp = f.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, f)  # atomic: a crash mid-write never leaves half a file
