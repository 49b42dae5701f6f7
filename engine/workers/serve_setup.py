"""What the engine at submission and the worker both check of a serve job: where it listens (`serve.listen`)
and what that takes, and its adapters' folders. Torch-free: the engine never imports torch.


Loopback by default. Any other address is reachable from elsewhere, so it needs both an API key (made
once for the job, kept 0600 in its folder, sent as `Authorization: Bearer`) and TLS (the engine's own
certificate, engine.api.tls, which the engine names in the spec at submission); without either the job
is refused.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.paths import write_private

API_KEY_FILE = "api-key"  # in the job's folder, 0600
# The phase of the status record a serve job reports once it listens: its url, model, adapters, api_key_file.
SERVING = "serving"
# The kind of the periodic load record rank 0 writes (engine.workers.serve._Meter), and how often at most: the
# app's load charts read the one as their records and the other as the spacing that tells idle gaps apart.
LOAD_RECORD = "serve"
METRICS_EVERY_S = 2.0


def serving_status(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The "serving" status record among a serve job's metric records (the CLI, the app and the tests wait for
    it), or None while it has not listened yet."""
    for r in records:
        if r.get("kind") == "status" and r.get("phase") == SERVING and isinstance(r.get("url"), str):
            return r
    return None


def parse_listen(addr: str) -> tuple[str, bool]:
    """(the IP address to bind, whether it is loopback); "localhost" is 127.0.0.1. Host names are refused: a
    name may resolve elsewhere tomorrow, and what it binds should be plain in job.json."""
    text = addr.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if text == "localhost":
        text = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise UserError(f"--listen {addr[:80]!r}: give an IP address of this machine (127.0.0.1, 0.0.0.0, ::, or one of "
                        "its interfaces'), not a host name; the port is --port", reason="serve_listen_invalid",
                        listen=addr[:80]) from None  # fmt: skip
    return str(ip), ip.is_loopback


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def url_host(host: str) -> str:
    """The host part of the URL the job reports: this machine's name where it listens on every interface."""
    if ipaddress.ip_address(host).is_unspecified:
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def api_key(job_dir: Path) -> tuple[str, Path]:
    """The job's API key and its file: the one already made (a restarted job keeps its clients' key), else a new one."""
    path = job_dir / API_KEY_FILE
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if not key:
        key = "rp-" + secrets.token_urlsafe(32)
        write_private(path, key + "\n")
    return key, path


def check_adapter_folder(name: str, folder: str) -> None:
    """A peft LoRA folder, or one line saying why not."""
    config = Path(folder) / "adapter_config.json"
    try:
        kind = json.loads(config.read_text()).get("peft_type")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"adapter {name}: {folder} has no readable adapter_config.json (a LoRA adapter folder, as "
                        "a LoRA job or peft's save_pretrained writes it)", reason="serve_adapter_invalid",
                        adapter=name, folder=folder) from None  # fmt: skip
    if kind != "LORA":
        raise UserError(f"adapter {name}: {folder} is a {kind} adapter; only LoRA adapters are served",
                        reason="serve_adapter_invalid", adapter=name, folder=folder, peft_type=kind)  # fmt: skip
