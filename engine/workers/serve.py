"""Serving (kind "serve"): an OpenAI-compatible server for the job's model, on one rank or split by tensor
parallelism or into pipeline stages (rank 0 serves, the others repeat its batch's steps:
engine.workers.serve_lockstep, engine.workers.serve_pipeline), until cancelled.

Two threads. The main thread loads the model and then runs the generation loop (engine.workers.serve_batch:
continuous batching, requests joining and leaving the running batch between decode steps); uvicorn runs the
HTTP side (engine.workers.serve_http) on a thread of its own, so torch is only ever called from one thread
and the event loop never waits on a forward.

The server listens on loopback unless `listen` says otherwise (engine.workers.serve_setup: beyond loopback,
an API key and TLS). LoRA adapters are served by name beside the base (engine.workers.serve_adapters). Once
it listens the job reports a status record, phase "serving", with its `url` (…/v1), `model` (the base's name
in requests), `adapters` (their names, comma-separated) and, beyond loopback, `api_key_file` and
`tls_fingerprint` (the engine's self-signed certificate, for clients to pin); then every
METRICS_EVERY_S, while anything happens, a "serve" record: requests finished, requests/s, tokens/s, mean time
to first token, queue depth, the requests in the batch, those dropped because their client left, and the KV
cache's bytes.

SIGTERM (the engine's cancel) stops the server accepting, lets the requests in flight finish for up to
DRAIN_S, drops what is left, and exits with EXIT_CANCELLED: the job ends cancelled.
"""

from __future__ import annotations

import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from rigpilot.engine.errors import UserError
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.report import report
from rigpilot.engine.workers import EXIT_CANCELLED
from rigpilot.engine.workers.infer import build_replica_model
from rigpilot.engine.workers.metrics import peak_memory, status
from rigpilot.engine.workers.parallel_dims import init_runtime
from rigpilot.engine.workers.parallelize import precision_dtype
from rigpilot.engine.workers.serve_adapters import attach_adapters
from rigpilot.engine.workers.serve_batch import Batcher, Counters, KVBatch
from rigpilot.engine.workers.serve_http import ServedModel, build_app
from rigpilot.engine.workers.serve_lockstep import Channel, Leader, follow
from rigpilot.engine.workers.serve_pipeline import StageForward
from rigpilot.engine.workers.serve_setup import (
    LOAD_RECORD,
    METRICS_EVERY_S,
    SERVING,
    api_key,
    family,
    parse_listen,
    url_host,
)

SWITCH_INTERVAL_S = 0.0005
DRAIN_S = 10  # how long requests in flight may finish after a SIGTERM (the engine's grace is longer)


def served_name(spec: JobSpec) -> str:
    """The base's name in requests: `base_name` where given, the job's name, else the model as submitted (its
    folder's name)."""
    if spec.serve is not None and spec.serve.base_name:
        return spec.serve.base_name
    if spec.name:
        return spec.name
    model = (spec.model or "model").rstrip("/")
    return Path(model).name if Path(model).is_absolute() else model


def run_serve(spec: JobSpec, job_dir: Path) -> int:
    s = spec.serve
    if s is None:
        raise UserError("serve job without serve settings")
    runtime = init_runtime(spec)
    dims = runtime.dims
    split = runtime.world_size > 1
    if runtime.world_size not in (dims.tp, dims.pp) or (split and s.adapters):  # refused at submission too
        raise UserError(f"serving runs on one rank, tensor parallel or pipelined, without adapters on a split "
                        f"model in this version, not "
                        f"{runtime.world_size} ranks (tp {dims.tp}, pp {dims.pp})", reason="serve_layout_unsupported",
                        ranks=runtime.world_size, tp=dims.tp, pp=dims.pp)  # fmt: skip
    dtype = precision_dtype(s.precision)
    if runtime.device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16  # few CPU kernels take fp16
    status("loading model")
    host, loopback = parse_listen(s.listen)
    if not loopback and not (s.tls_cert and s.tls_key):
        raise UserError(f"listening on {host} needs TLS, and this job names no certificate (submit it through the "
                        "engine, which names its own)", reason="serve_tls_unavailable", listen=host)  # fmt: skip
    key, key_file = api_key(job_dir) if not loopback else (None, None)
    name = served_name(spec)
    if name in s.adapters:  # the engine refuses this at submission; a job.json written by hand may not be
        raise UserError(f"adapter {name!r} has the base model's name: give it another", reason="serve_adapter_invalid",
                        adapter=name)  # fmt: skip
    if runtime.rank != 0:
        # Rank 0 stops the others once its requests are done (serve_lockstep); a SIGTERM here would leave it
        # alone in a broadcast.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    model, tokenizer, config = build_replica_model(spec, runtime, dtype, s.seed)
    forward = StageForward(runtime, config, dtype) if dims.pp > 1 else None
    if runtime.rank != 0:
        follow(KVBatch(model, config, runtime.device, forward), Channel(runtime.device))
        status("cancelled", exit_code=EXIT_CANCELLED)
        return EXIT_CANCELLED
    if s.adapters:
        status("loading adapters", adapters=",".join(s.adapters))
    model = attach_adapters(model, s.adapters, runtime.device)
    local = KVBatch(model, config, runtime.device, forward)
    kv = Leader(local, Channel(runtime.device)) if split else local
    batcher = Batcher(kv, tokenizer, config, runtime.device, s.max_batch, s.seed, adapters=bool(s.adapters))
    served = ServedModel(
        name, tokenizer, getattr(config, "max_position_embeddings", None), s.max_new_tokens, s.max_prompt_tokens,
        s.max_concurrent, batcher.submit, tuple(s.adapters), key,
    )  # fmt: skip
    # The HTTP thread waits for the GIL while a forward holds it between torch calls: at the default 5 ms
    # switch interval, every token's event and every new request waited up to that long.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    sock = _listen(host, s.port)
    server = _start_http(served, sock, (s.tls_cert, s.tls_key) if not loopback else None)
    scheme = "http" if loopback else "https"
    url = f"{scheme}://{url_host(host)}:{sock.getsockname()[1]}/v1"
    status(SERVING, url=url, model=name, adapters=",".join(s.adapters), max_batch=s.max_batch,
           max_concurrent=s.max_concurrent, api_key_file=str(key_file) if key_file else None,
           tls_fingerprint=(s.tls_fingerprint or None) if not loopback else None)  # fmt: skip
    print(f"[rank0] serving {name} at {url}", flush=True)
    meter = _Meter(batcher.counters, runtime.device)
    while not stop.is_set():
        batcher.run_once()
        meter.tick(batcher)
        if isinstance(kv, Leader):
            kv.channel.heartbeat()
    server.should_exit = True  # stop accepting; connections in flight go on
    drain_until = time.monotonic() + DRAIN_S
    while batcher.busy and time.monotonic() < drain_until:
        batcher.run_once()
    dropped = batcher.drop_all()
    if isinstance(kv, Leader):
        kv.stop()
    meter.tick(batcher, force=True)
    status("cancelled", exit_code=EXIT_CANCELLED, dropped=dropped)
    print(f"rigpilot-worker: SIGTERM: server stopped ({dropped} request(s) in flight dropped)", flush=True)
    return EXIT_CANCELLED


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host} port {port}: {e.strerror}", reason="port_unavailable", port=port,
                        listen=host) from None  # fmt: skip
    sock.listen(128)
    return sock


def _start_http(served: ServedModel, sock: socket.socket, tls: tuple[str, str] | None) -> Any:
    import uvicorn

    if tls:  # uvicorn loads them on its own thread, where a failure would leave a job serving nothing
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(*tls)
        except (OSError, ssl.SSLError) as e:
            raise UserError(f"the TLS certificate {tls[0]} cannot be used: {getattr(e, 'strerror', None) or e}",
                            reason="serve_tls_unavailable", cert=tls[0]) from None  # fmt: skip
    config = uvicorn.Config(
        build_app(served), log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=DRAIN_S,
        ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None,
    )  # fmt: skip
    server = uvicorn.Server(config)
    # Off the main thread, uvicorn installs no signal handlers: SIGTERM stays this module's.
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve-http", daemon=True).start()
    return server


class _Meter:
    """The periodic "serve" record: figures over the window since the last one, written only when there is news."""

    def __init__(self, counters: Counters, device: torch.device) -> None:
        self.c, self.device = counters, device
        self.at = time.perf_counter()
        self.seen = (0, 0, 0, 0.0, 0)

    def tick(self, batcher: Batcher, force: bool = False) -> None:
        now = time.perf_counter()
        if now - self.at < METRICS_EVERY_S and not force:
            return
        c = self.c
        figures = (c.finished, c.dropped, c.new_tokens, c.ttft_sum, c.ttft_count)
        quiet = figures == self.seen and not batcher.busy
        if quiet and not force:
            self.at = now
            return
        finished, _, tokens, ttft_sum, ttft_count = (a - b for a, b in zip(figures, self.seen, strict=True))
        span = now - self.at
        report(
            kind=LOAD_RECORD,
            requests=c.finished,
            requests_per_s=finished / span,
            tokens_per_s=tokens / span,
            time_to_first_token=ttft_sum / ttft_count if ttft_count else None,
            queue_depth=batcher.queue_depth,
            running=len(batcher.rows),
            dropped=c.dropped,
            kv_cache_bytes=batcher.kv_cache_bytes,
            peak_memory=peak_memory(self.device),
        )
        self.at, self.seen = now, figures
