"""The engine service's wire protocol: newline-delimited JSON over a stream socket.

Every message is one UTF-8 JSON object on one line, at most `MAX_MESSAGE_BYTES`
long, with `"v"` naming the protocol version. Never pickle: a client is not
trusted to send code.

    request  {"v": 1, "id": 7, "type": "job", "args": {"job": "a1b2c3"}}
    reply    {"v": 1, "id": 7, "ok": true, "result": {...}}
    error    {"v": 1, "id": 7, "ok": false, "error": {"code": "not_found", "message": "...", "reason": "not_found",
              "fields": {}}}
    event    {"v": 1, "event": "telemetry" | "job" | "metrics" | "machine" | "notice", ...}   (after a `subscribe`)

`id` is the client's, echoed back (null when the request could not be read).

An error's `code` is its class (the constants below: `user_error`, `bad_path`, `disk_full`, ...), what a
client decides its handling from, as clients of protocol 1 always have. `reason` names the refusal itself, a
snake_case code (engine.errors.UserError.reason; the `code` where the refusal has no code of its own), and
`fields` holds its facts as JSON values, so a client words the error, or offers a fix, from those and never
from `message`: e.g. a sequence longer than the model's context is
`{"code": "user_error", "reason": "seq_too_long", "message": "...", "fields": {"setting": "train.seq_len",
"value": 2048, "limit": 256}}`. A field named `setting` is the setting's key (the job spec's path, or the
plan request's `workload` key), never a CLI flag. Clients must accept reasons they do not know (show
`message`). `bad_path` and `disk_full` errors also carry their fields beside `code`, where clients read
them before `fields` existed.
A reply (or error) may also carry `"notices": [{code, message, time, ...}]`: what the engine did by
itself that its user should hear of, each told once to each client name given in `hello` (not on the
`hello` reply itself); a connection subscribed to `jobs` gets it at once, as a `notice` event
(`{"event": "notice", "notice": {...}}`). Codes: `job_database_rebuilt` (engine.db could not serve
or was missing; fields path, cause, reason, moved_to, in_memory, jobs, damaged), `jobs_put_back` (a sound engine.db was
behind the job folders: jobs put back or brought up to date from their record.json),
`telemetry_reset` (telemetry.db could not serve; history starts again); see engine.jobs.resilient_store.

A path the request names that cannot be what it must be (missing, a FIFO or device, a name past
NAME_MAX, a path past PATH_MAX: engine.given_path) is refused as `bad_path`, with the `path` as
sent and the `problem` beside `code` and `message`.

Each request type's `args` are checked against its declaration (engine.service.requests, where each
request's arguments are declared on its handler) before the service acts on them; unknown arguments are
refused so a typo is not ignored.
Numbers, strings and lists carry ranges (`Limit`), so a value SQLite, `seek`
or the file system cannot take is refused here in one line. A message that
cannot be read (not UTF-8, not JSON, nested deeper than `MAX_DEPTH`, a lone
UTF-16 surrogate) gets a `bad_message` reply and the connection goes on,
except an oversized one, after which the service hangs up. Remote (TCP)
clients speak TLS; the engine opens with a login challenge and the client's
first request must be `hello` with its proof (engine.api.tls), within the
login timeout. A client that speaks plain text there is answered `tls_required`.
Every request has a deadline: one that passes it (a `plan` search) is stopped
and answered `timeout`; a client may ask for a shorter one with `deadline_s`.
A request that needs room the engine's state folder lacks (submit, resume, a
write that found the disk full) is answered `disk_full`, its error carrying
`folder`, `needed_bytes` (null where unknown) and `free_bytes` beside the line.

Requests and their results (a "job" is the record the `jobs` CLI shows, plus
`progress`, `job_dir`, `waiting_for` when queued, `comparison` in details; the `job` request's answer also
has `settings`, the job's spec without its environment, and `output`, what its output folder holds):
    hello {versions?, client?, nonce?, proof?} → {service, version, protocol, versions, pid, machine, simulated, notes,
          tcp, fingerprint (of the TLS certificate on tcp), proof (the engine's, over TCP)}
    machine {}                              → {machine (Machine JSON), notes (plain sentences), details (their causes)}
    topology {}                             → {matrix: {gpus, cells}, summary, description}
    telemetry_history {since?, limit?}      → {samples: [TelemetrySample], more, next_since}
    plan {model, workload?, gpus?, options?, trust_remote_code?, deadline_s?, machine?} → {result: the planner's
          SearchResult}; machine: a simulated profile's id or a machine (Machine JSON) to plan for instead of this one;
          verify: false → the formula's answer at once, its `trace` {pending: how many top plans to trace};
          trace {plan} → {result: {plan (with the traced figures), outcome {verified, fits, formula_bytes,
          traced_bytes, capacity_bytes, cached, seconds, reason}, line}}: one plan's memory traced, no search
    submit {spec: JobSpec fields, plan?, cwd?, slurm?} → {job}; slurm {partition?, account?, time?, login?}:
          submitted to SLURM with sbatch, the job's `slurm` field then follows SLURM's queue state
          (a spec of kind "serve" is an OpenAI-compatible server on one rank until cancelled: its `serve` settings
          (engine.jobspec.spec.ServeSettings); its metrics' status record "serving" carries the `url`, and
          beyond loopback `api_key_file`)
    check {spec, plan?, cwd?} → {ok: true, lines: [what would run, in words], would_run: {ranks, gpus,
          parallelism, method, precision, micro_batch, grad_accum, seq_len, notes, host_ram, ...}}; creates
          nothing, and refuses exactly as submit would (error `user_error`, one line)
    jobs {states?, limit?}                  → {jobs: [job]}, newest first
    job | cancel | resume {job}             → {job}       (job: id, unique id prefix or name)
    delete {job}                            → {id, deleted}
    simulate_fault {gpu, fault?}            → {gpu, fault, health}: a simulated GPU reports "lost", "ecc" or "xid N"
          as NVML would, and automatic recovery leaves it out (null clears); refused (user_error) on real GPUs
    doctor_start {gpus?, deadline_s?}       → {job}: a machine check (a job of kind "doctor") on the GPUs (default all);
          refused while one runs (doctor_running) and on an imported machine (doctor_imported_machine)
    doctor_report {}                        → {report: rigpilot.doctor/1 | null, why: null | "never" |
          "driver_changed" | "unreadable", running: job id | null}: the check stored for this machine and driver
    simulate_link_fault {gpus: [a, b], fault?} → {gpus, fault}: a simulated link's copies "corrupt" or its
          all-reduce "hang" in the next machine check (null clears); refused (not_simulated) on real GPUs
    rename {job, name}                      → {job}       (name: one printable line, 1–100 characters)
    results {job, start?, limit?, max_bytes?} → {results: [{index, prompt, completion, new_tokens, cut}], start,
          more, path, size, state}: an inference job's completions (output/results.jsonl, read as JSON only);
          a missing file, another kind of job or a line that is not a completion: `user_error`, one line
    logs {job, rank?, since_offset?, max_bytes?} → {text, offset, next_offset, size, more, rank, ranks, path, state}
    metrics {job, since_cursor?, max_bytes?} → {records, cursor, more, state}   (cursor: {"<rank>": byte offset})
    subscribe {topics, metrics_cursors?}    → {topics}; topics: "telemetry", "jobs", "metrics:<job>"
    unsubscribe {topics?}                   → {topics}
    shutdown {}                             → {stopping}   (jobs keep running)
    reload_machine {simulated_profile?}     → {changed, machine, notes, details}: serve the machine Settings name now
          (storing simulated_profile there first); refused (user_error) while jobs are queued or running
    submit | check {…, nodes: ["local", NODE…], shared_dir?} → a job over several engines (engine.service.multinode);
          the job's `nodes` says which node runs which ranks
    submit_member | check_member {job, spec, nodes} → {job} | {ok, ranks}: this engine's part of such a job (head only)
    resume_member {job, run, endpoint, env?} → {job}
    nodes {probe?} → {nodes: [{name, address, reachable, error?, label, gpus, simulated, version}], path}
    node_add {name, address, token, fingerprint?} → {node};  node_remove {name} → {removed}
          (nodes and node_add list each node's pinned certificate `fingerprint`)
    scaling_start {gpus: [counts], job? | model, dataset?, method?, precision?, seq_len?, global_batch?, micro_batch?, steps?,
          warmup?, trust_remote_code?, cwd?} → {study}: answers at once (state planning), then plans each count in
          the background and submits one training job per count (engine.jobs.scaling); a study that cannot run
          fails in one line (its `error`) and submits nothing; a second one of a job is refused (study_running)
    scaling_study {study}                   → {study}: with each point's state, measurement, `table` and `notes`
    scaling_studies {job?}                  → {studies}: newest first; job: only those repeating that job
    scaling_cancel {study}                  → {study}: its jobs that have not ended are cancelled; measured points stay
Before anything else on TCP (after the TLS handshake):
    {"v": 1, "challenge": {"nonce": 64 hex digits, "auth": "hmac-sha256"}}
Events after `subscribe`:
    {"event": "telemetry", "sample": TelemetrySample}
    {"event": "job", "job": job}             (to "jobs" and to that job's "metrics:" subscribers)
    {"event": "metrics", "job": id, "records": [...], "cursor": {...}}   (history first, from the given cursor)
    {"event": "machine", "machine": Machine JSON, "notes": [...], "details": [...]}   (to every subscriber, after reload_machine)
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import IO, Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from rigpilot.engine.errors import UserError, jsonable
from rigpilot.engine.schema import Setting

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_MESSAGE_BYTES = 1 << 20
# Paged replies (metrics, logs, telemetry history) stop adding items at this size,
# leaving room for the envelope so a reply never exceeds MAX_MESSAGE_BYTES.
REPLY_BUDGET_BYTES = 768 * 1024
# Deeper nesting than any request needs; json and the checks below recurse, so it is refused before parsing.
MAX_DEPTH = 32

# Error codes. A client shows `message`; `code` is for deciding what to do.
BAD_MESSAGE = "bad_message"  # not UTF-8, not JSON, not an object
TOO_LARGE = "too_large"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_TYPE = "unknown_type"
INVALID = "invalid"  # args do not match the schema
USER_ERROR = "user_error"  # the request is well formed but asks for something impossible
# A path in the request is not what it must be; the error has `path` (as sent) and `problem`
# (engine.given_path's codes: missing, special_file, name_too_long, ...).
BAD_PATH = "bad_path"
NOT_FOUND = "not_found"
UNAUTHORIZED = "unauthorized"
TLS_REQUIRED = "tls_required"  # plain text on the TCP port (an older client): update it
UNAVAILABLE = "unavailable"  # e.g. the planner is not installed
TIMEOUT = "timeout"  # the request ran past its deadline and was stopped
BUSY = "busy"  # too many connections (or planner runs) at once; try again later
INTERNAL = "internal"  # a bug in Rigpilot: the message says where the traceback was logged
DISK_FULL = "disk_full"  # no room to write; the error carries folder, needed_bytes and free_bytes

# Notice codes: what the engine did by itself, told once to each client (see the module docstring).
JOB_DATABASE_REBUILT = "job_database_rebuilt"
JOBS_PUT_BACK = "jobs_put_back"
TELEMETRY_RESET = "telemetry_reset"


class ProtocolError(Exception):
    """A message the service (or client) cannot accept; `fatal` ones end the connection."""

    def __init__(self, code: str, message: str, *, fatal: bool = False, reason: str | None = None,
                 fields: dict[str, Any] | None = None):  # fmt: skip
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal
        self.reason = reason  # a refusal of a declared setting's value: out_of_range, not_a_choice (None: the class)
        self.fields = dict(fields or {})


# -- framing -----------------------------------------------------------------


def encode(message: dict[str, Any]) -> bytes:
    text = json.dumps(message, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    try:
        data = text.encode() + b"\n"
    except UnicodeEncodeError:
        # A lone surrogate (e.g. from a file name): \uXXXX escapes keep the line valid UTF-8.
        data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(TOO_LARGE, f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def nesting_depth(line: bytes) -> int:
    """How deeply the JSON text nests arrays and objects (brackets inside strings do not count)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return 0  # cannot be too deep: skip the scan for ordinary messages
    depth = deepest = 0
    for b in _STRING.sub(b"", line).translate(None, _NOT_BRACKETS):
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def decode(line: bytes) -> dict[str, Any]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(BAD_MESSAGE, f"message is not UTF-8 ({e.reason} at byte {e.start})") from None
    if nesting_depth(line) > MAX_DEPTH:
        raise ProtocolError(BAD_MESSAGE, f"message nests deeper than {MAX_DEPTH} levels")
    try:
        msg = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(BAD_MESSAGE, f"message is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_MESSAGE, f"message must be a JSON object, not {type(msg).__name__}")
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(msg, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            # Valid JSON but no valid text: it could reach no file name, database or reply intact.
            raise ProtocolError(BAD_MESSAGE, "message has a lone UTF-16 surrogate (\\ud800–\\udfff) in a string") from None
    return msg


def read_message(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next message from a buffered binary stream; None at a clean end of stream."""
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) > MAX_MESSAGE_BYTES:
            # The rest of the line is still unread, so the stream cannot be resynchronised.
            raise ProtocolError(TOO_LARGE, f"message exceeds {MAX_MESSAGE_BYTES} bytes", fatal=True)
        raise ProtocolError(BAD_MESSAGE, "connection closed in the middle of a message", fatal=True)
    return decode(line.rstrip(b"\r\n"))


# -- requests ----------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    id: int | str | None
    type: str
    args: dict[str, Any]


Number = float  # ints are accepted wherever a float is expected


@dataclass(frozen=True)
class Limit:
    """The allowed range of a number, or the longest string, list or object, for `Annotated[...]`."""

    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None

    def problem(self, value: Any) -> str | None:
        if self.max_len is not None and isinstance(value, str | list | dict) and len(value) > self.max_len:
            unit = "characters" if isinstance(value, str) else "items"
            return f"of at most {self.max_len} {unit}, got {len(value)}"
        if isinstance(value, int | float) and not isinstance(value, bool):
            if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
                return f"{_range_words(self.lo, self.hi)}, got {_short_number(value)}"
        return None


def _range_words(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"from {_short_number(lo)} to {_short_number(hi)}"
    return f"at least {_short_number(lo)}" if lo is not None else f"at most {_short_number(hi)}"


def _short_number(x: float) -> str:
    text = repr(x)
    return text if len(text) <= 20 else f"a {len(text.lstrip('-'))}-digit number"


# Argument types the requests' declarations share (engine/service/handlers/).
MAX_PATH = 4096  # PATH_MAX on Linux: no longer path can name a file
MAX_BYTES = 1 << 31
MAX_OFFSET = 1 << 62  # within SQLite's INTEGER and lseek's off_t
Path_ = Annotated[str, Limit(max_len=MAX_PATH)]
Text = Annotated[str, Limit(max_len=1024)]  # job references, topics, client names
Bytes = Annotated[int, Limit(1, MAX_BYTES)]
Offset = Annotated[int, Limit(0, MAX_OFFSET)]
Cursor = Annotated[dict[str, Offset], Limit(max_len=4096)]  # {"<rank>": byte offset}
Topics = Annotated[list[Text], Limit(max_len=1024)]
NodeNames = Annotated[list[Annotated[str, Limit(max_len=64)]], Limit(max_len=64)] | None

TOPICS = ("telemetry", "jobs")  # plus "metrics:<job id>"


# A request type's (required args, optional args), by name; types use the same notation as dataclass fields.
Schemas = Mapping[str, tuple[Mapping[str, Any], Mapping[str, Any]]]


def parse_request(msg: dict[str, Any], schemas: Schemas) -> Request:
    """Check the envelope and the args of one request against `schemas` (the service's are
    engine.service.requests.REQUEST_SCHEMAS); raise ProtocolError when either is wrong."""
    rid = msg.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int | str | None):
        raise ProtocolError(INVALID, "id must be an integer, a string or null")
    v = msg.get("v")
    if v not in SUPPORTED_VERSIONS or isinstance(v, bool):
        raise ProtocolError(
            UNSUPPORTED_VERSION, f"protocol version {v!r} is not supported; this service speaks {list(SUPPORTED_VERSIONS)}"
        )
    rtype = msg.get("type")
    if not isinstance(rtype, str):
        raise ProtocolError(INVALID, "type must be a string naming the request")
    if rtype not in schemas:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown request type {rtype!r}; known: {', '.join(sorted(schemas))}")
    args = msg.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError(INVALID, "args must be a JSON object")
    required, optional = schemas[rtype]
    for name, tp in required.items():
        if name not in args:
            raise ProtocolError(INVALID, f"{rtype}: missing required argument {name!r}")
        check_value(args[name], tp, f"{rtype}.{name}")
    for name, value in args.items():
        if name in required:
            continue
        if name not in optional:
            raise ProtocolError(INVALID, f"{rtype}: unknown argument {name!r}")
        check_value(value, optional[name], f"{rtype}.{name}")
    return Request(rid, rtype, args)


def request(rid: int | str | None, rtype: str, **args: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "type": rtype, "args": args}


def reply(rid: int | str | None, result: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": result}


# The error classes whose fields clients of protocol 1 read beside `code` (before `reason` and `fields`).
_FIELDS_BESIDE_CODE = frozenset({BAD_PATH, DISK_FULL})
# A refusal whose reason is one of these classes is answered as that class, not as `user_error`.
_REASONS_WITH_A_CLASS = frozenset({BAD_PATH, DISK_FULL, NOT_FOUND})


def error_reply(
    rid: int | str | None, code: str, message: str, *, reason: str | None = None, fields: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An error reply of class `code`; `reason` (default: the class) names the refusal and `fields` its facts,
    what a client words the error from (see the module docstring)."""
    facts = jsonable(fields or {})
    error = {**(facts if code in _FIELDS_BESIDE_CODE else {}), "code": code, "message": message,
             "reason": reason or code, "fields": facts}  # fmt: skip
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": error}


def refusal_reply(rid: int | str | None, e: UserError) -> dict[str, Any]:
    """The error reply for a refusal: its reason and fields travel as they are; its class is `user_error`
    unless the reason is a class of its own (`bad_path`, `disk_full`, `not_found`)."""
    code = e.reason if e.reason in _REASONS_WITH_A_CLASS else USER_ERROR
    return error_reply(rid, code, str(e), reason=e.reason, fields=e.fields)


def event(name: str, **fields_: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "event": name, **fields_}


# -- validation --------------------------------------------------------------


def check_value(value: Any, tp: Any, path: str) -> None:
    """Raise ProtocolError(INVALID) unless `value` (decoded JSON) fits the type `tp`."""
    if not _fits(value, tp, path):
        raise ProtocolError(INVALID, f"{path}: expected {_describe(tp)}, got {_json_type(value)}")


def check_dataclass(cls: type, data: Any, path: str, *, ignore: frozenset[str] = frozenset()) -> None:
    """Check a JSON object against a dataclass's fields: types, and no unknown keys (typos)."""
    if not isinstance(data, dict):
        raise ProtocolError(INVALID, f"{path}: expected an object, got {_json_type(data)}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key, value in data.items():
        if key in ignore:
            continue
        if key not in known:
            raise ProtocolError(INVALID, f"{path}: unknown field {key!r}")
        check_value(value, hints[key], f"{path}.{key}")


def _fits(value: Any, tp: Any, path: str) -> bool:
    if tp is Any:
        return True
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        if not _fits(value, args[0], path):
            return False
        for limit in args[1:]:
            # A Limit, or a job setting's declaration (engine.schema.Setting): both say what is wrong with a value;
            # a setting's refusal also travels as its reason and fields, as the same value in a job spec does.
            problem = limit.problem(value) if isinstance(limit, Limit | Setting) else None
            if problem:
                refused = limit.refusal(value) if isinstance(limit, Setting) else None
                raise ProtocolError(INVALID, f"{path}: expected {_describe(tp)} {problem}",
                                    reason=refused.reason if refused else None, fields=refused.fields if refused else None)  # fmt: skip
        return True
    if origin in (Union, types.UnionType):
        return any(_fits(value, a, path) for a in args)
    if tp is type(None):
        return value is None
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_fits(x, args[0], path) for x in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _fits(v, args[1], path) for k, v in value.items()
        )
    if is_dataclass(tp):
        check_dataclass(tp, value, path)  # raises with the precise nested path
        return True
    raise TypeError(f"no validator for {tp!r}")


def _describe(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _describe(args[0])
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"an object of {_describe(args[1])}"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", Any: "any value"}
    if tp in names:
        return names[tp]
    return f"an object ({getattr(tp, '__name__', tp)})"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def parse_address(spec: str) -> tuple[str, int]:
    """'PORT', ':PORT', 'HOST:PORT' or '[V6]:PORT' → (host, port); the host defaults to 127.0.0.1."""
    host, sep, port_text = spec.rpartition(":")
    if not sep:
        host, port_text = "", spec
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise UserError(f"--tcp expects ADDR:PORT or PORT, not {spec!r}") from None
    if not 0 <= port <= 65535:
        raise UserError(f"port {port} is out of range")
    return host, port
