"""Fetch what sizing needs from the Hugging Face hub: config.json and safetensors headers, never weights.

Everything goes through huggingface_hub, so HF_HUB_OFFLINE, HF_HUB_CACHE,
HF_ENDPOINT and a saved token work as they do for every other HF tool. Each
hub failure becomes a one-line `UserError` that says what to do.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub import errors as hf_errors
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    NotASafetensorsRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
)

from rigpilot.engine.errors import UserError
from rigpilot.engine.models.config_file import read_config
from rigpilot.engine.models.safetensors_meta import TensorHeader, checkpoint_files, read_checkpoint

# Transport failures: requests' errors are OSErrors; httpx-based releases raise their own HTTPError family.
_NETWORK_ERRORS: tuple[type[BaseException], ...] = (OSError, getattr(hf_errors, "HTTPError", OSError))


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


class HubUnreachable(UserError):
    """The repo is not cached and the hub cannot be reached (offline mode or no network)."""


@dataclass
class HubModel:
    repo_id: str
    config: dict[str, Any]
    snapshot: Path  # cache folder holding config.json (and whatever else of the repo is cached)
    tensors: dict[str, TensorHeader] | None  # None: headers could not be had; sizing falls back to the config
    notes: list[str] = field(default_factory=list)


def offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def reachable(timeout_s: float = 2.0) -> bool:
    """Whether the hub endpoint answers a TCP connect.

    huggingface_hub retries an unreachable hub with back-off for about 25 s per
    request; a workstation without network should get its answer (from the
    cache, or a clear error) at once. Behind a proxy only the library can tell.
    """
    if offline():
        return False
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return True
    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout_s).close()
    except OSError:
        return False
    return True


def fetch(repo_id: str, *, token: str | None = None) -> HubModel:
    """config.json (through the local cache) and the safetensors headers of a hub repo."""
    online = reachable()
    config_path = Path(_download(repo_id, "config.json", token, local_only=not online))
    model = HubModel(repo_id, read_config(config_path), config_path.parent, None)
    model.tensors = _local_headers(model)
    if model.tensors is None:
        if online:
            model.tensors = _remote_headers(model, token)
        else:
            why = "offline (HF_HUB_OFFLINE)" if offline() else "the hub cannot be reached"
            model.notes.append(f"{why} and the weights are not cached: counts from the cached config.json")
    return model


def _download(repo_id: str, filename: str, token: str | None, *, local_only: bool) -> str:
    try:
        return hf_hub_download(repo_id, filename, token=token, local_files_only=local_only)
    # Order matters: GatedRepoError is a RepositoryNotFoundError, LocalEntryNotFoundError an EntryNotFoundError.
    except GatedRepoError as e:
        if token:
            raise UserError(
                f"{repo_id} is gated and this token has no access: accept its licence on huggingface.co"
            ) from e
        raise UserError(
            f"{repo_id} is gated: accept its licence on huggingface.co and give a token (HF_TOKEN or `hf auth login`)"
        ) from e
    except RepositoryNotFoundError as e:
        raise UserError(f"{repo_id}: no such model on the Hugging Face hub (or it is private and needs a token)") from e
    except RevisionNotFoundError as e:
        raise UserError(f"{repo_id}: no such revision on the Hugging Face hub") from e
    except LocalEntryNotFoundError as e:
        raise HubUnreachable(
            f"{repo_id} is not in the local cache and the hub cannot be reached; download it once or give a local folder"
        ) from e
    except EntryNotFoundError as e:
        raise UserError(f"{repo_id} has no {filename}: it is not a transformers model repo") from e
    except HFValidationError as e:
        raise UserError(f"{repo_id!r} is neither a preset, a folder nor a Hugging Face repo id") from e
    except HfHubHTTPError as e:
        raise UserError(f"{repo_id}: the Hugging Face hub refused ({_first_line(e)})") from e


def _local_headers(model: HubModel) -> dict[str, TensorHeader] | None:
    """Headers of weights already in the cache: no network, and the same answer offline."""
    try:
        if not checkpoint_files(model.snapshot):
            return None
    except UserError:  # a partly downloaded sharded checkpoint: ask the hub instead
        return None
    return read_checkpoint(model.snapshot)


def _remote_headers(model: HubModel, token: str | None) -> dict[str, TensorHeader] | None:
    try:
        meta = HfApi().get_safetensors_metadata(model.repo_id, token=token)
    except NotASafetensorsRepoError:
        model.notes.append("the repo has no safetensors weights: counts from config.json")
        return None
    except SafetensorsParsingError as e:
        raise UserError(f"{model.repo_id}: corrupt safetensors header on the hub ({_first_line(e)})") from e
    except GatedRepoError:
        model.notes.append("the weights are gated (config.json was cached): counts from config.json")
        return None
    except _NETWORK_ERRORS as e:
        model.notes.append(
            f"could not read safetensors headers from the hub ({_first_line(e)}): counts from config.json"
        )
        return None
    return {
        name: TensorHeader(info.dtype, tuple(info.shape))
        for file in meta.files_metadata.values()
        for name, info in file.tensors.items()
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
