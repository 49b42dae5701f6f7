"""The machine check (`rigpilot doctor`): its report format, what it found, and what the engine does about it.

One versioned format (`rigpilot.doctor/1`), made in two halves: the doctor job's ranks
(engine/workers/doctor.py) measure what needs torch (matmul, memory bandwidth, peer copies
checked for correctness, all-reduce over every pair and over all GPUs, each bounded by a
deadline), and the engine adds what it sees from NVML (readings against `nvidia-smi`, ECC,
XIDs, throttling, the P2P state the driver reports, each pair's link) when the job ends:

    {
      "schema": "rigpilot.doctor/1",
      "measured_at": "2026-11-29T05:00:00Z", "duration_s": 41.2,
      "simulated": false, "device_type": "cuda", "backend": "nccl",
      "machine": {"identity": "...", "label": "...", "gpus": {"0": "NVIDIA GeForce RTX 4090", ...},
                  "driver": "550.90.07", "cuda_driver": "12.4", "cuda_torch": "12.8", "torch": "2.13.0"},
      "complete": true,                      # false: `stopped` says which check ended it
      "stopped": null,                       # or a finding (code all_reduce_hung ...)
      "gpus":  [{"gpu": 0, "name": "...", "checks": [CHECK, ...]}],
      "pairs": [{"gpus": [0, 1], "link": "PHB", "p2p_reported": "ok", "checks": [CHECK, ...]}],
      "groups": [{"gpus": [0, 1, 2, 3], "checks": [CHECK]}],          # the all-GPU all-reduce
      "findings": [FINDING, ...],            # worst first
      "actions": {"nccl_env": {"NCCL_P2P_DISABLE": "1"}, "pairs": [[0, 1]], "because": ["p2p_corrupt"]}
    }

    CHECK   = {"check": "p2p_copy", "status": "ok"|"warn"|"fail"|"timeout"|"skipped", "seconds": 0.4,
               "figures": {...}, "why": CODE|null}
    FINDING = {"code": "p2p_corrupt", "severity": "fail"|"warn"|"info", "gpus": [0, 1], "fields": {...}}

Checks and their figures:
  per GPU   matmul            {"tflops": {dtype: x}, "peak_tflops": {dtype: y}}
            memory_bandwidth  {"gbs": x, "peak_gbs": y}
            nvml_vs_smi       {"compared": [field, ...], "disagree": [{"field", "nvml", "smi"}]}
            health            {"ecc_uncorrected": n, "xid": n, "throttle": [reason, ...]}
            software          {"driver", "cuda_driver", "cuda_torch", "torch"}   (GPU 0 only: one machine)
  per pair  p2p_copy          {"bytes": n, "correct": bool, "mismatched": n, "gbs": x, "host_gbs": y}
            all_reduce        {"bytes": n, "busbw_gbs": x, "deadline_s": t}
  group     all_reduce        the same, over all GPUs

Findings are codes with fields; clients word them (`describe` is the one wording, used by the
CLI and the GUI alike). A simulated machine's report comes from the same code on CPU ranks (gloo)
and says `simulated`: its figures are the CPU's, and every view labels them so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from rigpilot.engine.errors import UserError

SCHEMA = "rigpilot.doctor/1"
# What the engine tells a doctor job's ranks through their environment: how long a collective may take, and a
# simulated machine's planted link faults ("0-1:corrupt,2-3:hang").
DEADLINE_ENV = "RIGPILOT_DOCTOR_DEADLINE_S"
FAULTS_ENV = "RIGPILOT_SIMULATED_LINK_FAULTS"
# What a simulated link can be told to do: its peer copies return flipped words ("corrupt"), its all-reduce
# never finishes ("hang"), its peer copy never returns ("stall").
LINK_FAULTS = ("corrupt", "hang", "stall")
STATUSES = ("ok", "warn", "fail", "timeout", "skipped")
SEVERITIES = ("fail", "warn", "info")

# Findings that make the engine turn NCCL's peer-to-peer transport off for jobs on both GPUs of the pair.
P2P_OFF_BECAUSE = ("p2p_corrupt", "all_reduce_hung", "p2p_copy_hung", "p2p_slower_than_host")
NCCL_P2P_OFF = {"NCCL_P2P_DISABLE": "1"}

# Below these shares of the spec sheet's peak a GPU is reported as slow (a warning, never a refusal).
SLOW_MATMUL_SHARE = 0.5
SLOW_MEMORY_SHARE = 0.6


@dataclass
class Check:
    check: str
    status: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    why: str | None = None  # a finding code when the check could not run or did not pass

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Check:
        if not isinstance(d, dict) or not isinstance(d.get("check"), str):
            raise ValueError("a check must be an object with a name")
        status = d.get("status")
        if status not in STATUSES:
            raise ValueError(f"check {d['check']!r} has status {status!r} (expected one of {', '.join(STATUSES)})")
        figures = d.get("figures") or {}
        if not isinstance(figures, dict):
            raise ValueError(f"check {d['check']!r}: figures must be an object")
        return cls(str(d["check"]), status, float(d.get("seconds") or 0.0), figures, d.get("why"))


@dataclass
class Finding:
    code: str
    severity: str
    gpus: list[int] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Finding:
        if not isinstance(d, dict) or not isinstance(d.get("code"), str):
            raise ValueError("a finding must be an object with a code")
        if d.get("severity") not in SEVERITIES:
            raise ValueError(f"finding {d['code']!r} has severity {d.get('severity')!r}")
        return cls(d["code"], d["severity"], [int(g) for g in d.get("gpus") or []], dict(d.get("fields") or {}))


@dataclass
class GpuResult:
    gpu: int
    name: str
    checks: list[Check] = field(default_factory=list)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.check == name), None)


@dataclass
class PairResult:
    gpus: tuple[int, int]
    link: str | None = None  # the `nvidia-smi topo -m` cell: NV4, PIX, PXB, PHB, NODE, SYS
    p2p_reported: str = "unknown"  # what the driver says: ok | unsupported | unknown
    checks: list[Check] = field(default_factory=list)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.check == name), None)


@dataclass
class GroupResult:
    gpus: list[int]
    checks: list[Check] = field(default_factory=list)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.check == name), None)


@dataclass
class DoctorReport:
    measured_at: str
    simulated: bool
    device_type: str = "cuda"
    backend: str = "nccl"
    duration_s: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)
    complete: bool = True
    stopped: Finding | None = None
    gpus: list[GpuResult] = field(default_factory=list)
    pairs: list[PairResult] = field(default_factory=list)
    groups: list[GroupResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    actions: dict[str, Any] = field(default_factory=dict)

    # -- lookups -------------------------------------------------------------------------------------
    def pair(self, a: int, b: int) -> PairResult | None:
        key = (min(a, b), max(a, b))
        return next((p for p in self.pairs if tuple(p.gpus) == key), None)

    def gpu(self, index: int) -> GpuResult | None:
        return next((g for g in self.gpus if g.gpu == index), None)

    @property
    def worst(self) -> str:
        """'fail', 'warn' or 'ok': what a card's colour says."""
        severities = {f.severity for f in self.findings}
        return "fail" if "fail" in severities else "warn" if "warn" in severities else "ok"

    # -- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "measured_at": self.measured_at,
            "duration_s": self.duration_s,
            "simulated": self.simulated,
            "device_type": self.device_type,
            "backend": self.backend,
            "machine": dict(self.machine),
            "complete": self.complete,
            "stopped": self.stopped.to_dict() if self.stopped else None,
            "gpus": [{"gpu": g.gpu, "name": g.name, "checks": [c.to_dict() for c in g.checks]} for g in self.gpus],
            "pairs": [
                {
                    "gpus": list(p.gpus),
                    "link": p.link,
                    "p2p_reported": p.p2p_reported,
                    "checks": [c.to_dict() for c in p.checks],
                }
                for p in self.pairs
            ],
            "groups": [{"gpus": list(g.gpus), "checks": [c.to_dict() for c in g.checks]} for g in self.groups],
            "findings": [f.to_dict() for f in self.findings],
            "actions": dict(self.actions),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "machine check") -> DoctorReport:
        """Parse and check; anything wrong is one UserError line naming `where`."""
        if not isinstance(d, dict):
            raise UserError(f"{where} must hold a JSON object")
        if d.get("schema") != SCHEMA:
            got = f"schema {d['schema']!r}" if "schema" in d else "no schema"
            raise UserError(f"{where} is not a Rigpilot machine check ({got}, expected {SCHEMA!r})")
        try:
            simulated = d["simulated"]
            if not isinstance(simulated, bool):
                raise ValueError("simulated must be true or false")
            stopped = d.get("stopped")
            report = cls(
                measured_at=str(d["measured_at"]),
                simulated=simulated,
                device_type=str(d.get("device_type") or "cuda"),
                backend=str(d.get("backend") or ""),
                duration_s=float(d.get("duration_s") or 0.0),
                machine=dict(d.get("machine") or {}),
                complete=bool(d.get("complete", True)),
                stopped=Finding.from_dict(stopped) if stopped else None,
                gpus=[GpuResult(int(g["gpu"]), str(g.get("name") or ""), [Check.from_dict(c) for c in g.get("checks") or []])
                      for g in d.get("gpus") or []],
                pairs=[_pair_from_dict(p) for p in d.get("pairs") or []],
                groups=[GroupResult([int(x) for x in g["gpus"]], [Check.from_dict(c) for c in g.get("checks") or []])
                        for g in d.get("groups") or []],
                findings=[Finding.from_dict(f) for f in d.get("findings") or []],
                actions=dict(d.get("actions") or {}),
            )  # fmt: skip
        except KeyError as e:
            raise UserError(f"{where} lacks {e.args[0]!r}; check the machine again") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{where} is malformed: {e}") from None
        return report


def _pair_from_dict(p: Any) -> PairResult:
    gpus = [int(x) for x in p["gpus"]]
    if len(gpus) != 2 or gpus[0] == gpus[1]:
        raise ValueError(f"a pair names two GPUs, not {gpus}")
    a, b = sorted(gpus)
    reported = str(p.get("p2p_reported") or "unknown")
    return PairResult((a, b), p.get("link"), reported, [Check.from_dict(c) for c in p.get("checks") or []])


# -- what it found ------------------------------------------------------------------------------------
def findings_of(report: DoctorReport) -> list[Finding]:
    """Every finding the checks' figures support, worst first (the engine stores them in the report)."""
    out: list[Finding] = []
    for g in report.gpus:
        for c in g.checks:
            out += _gpu_findings(g.gpu, c, simulated=report.simulated)
    # One line for every pair the driver gives no peer access: on a consumer box that is most of them.
    no_p2p = [list(p.gpus) for p in report.pairs if p.p2p_reported == "unsupported"]
    if no_p2p:
        everyone = len(no_p2p) == len(report.pairs)
        out.append(Finding("p2p_not_supported", "info", sorted({g for pair in no_p2p for g in pair}),
                           {"pairs": no_p2p, "all": everyone}))  # fmt: skip
    for p in report.pairs:
        a, b = p.gpus
        link = p.link or "?"
        copy = p.check("p2p_copy")
        if copy and copy.status == "fail" and copy.figures.get("correct") is False:
            out.append(Finding("p2p_corrupt", "fail", [a, b], {"link": link, "mismatched": copy.figures.get("mismatched"),
                                                                 "bytes": copy.figures.get("bytes")}))  # fmt: skip
        elif copy and copy.status == "ok" and not report.simulated and _slower(copy.figures):
            out.append(Finding("p2p_slower_than_host", "warn", [a, b], {
                "link": link, "gbs": copy.figures["gbs"], "host_gbs": copy.figures["host_gbs"]}))  # fmt: skip
        if copy and copy.status == "timeout":
            out.append(
                Finding("p2p_copy_hung", "fail", [a, b], {"link": link, "deadline_s": copy.figures.get("deadline_s")})
            )
        ar = p.check("all_reduce")
        if ar and ar.status == "timeout":
            out.append(
                Finding("all_reduce_hung", "fail", [a, b], {"link": link, "deadline_s": ar.figures.get("deadline_s")})
            )
    for grp in report.groups:
        ar = grp.check("all_reduce")
        if ar and ar.status == "timeout":
            out.append(
                Finding(
                    "all_reduce_hung",
                    "fail",
                    list(grp.gpus),
                    {"link": "all", "deadline_s": ar.figures.get("deadline_s")},
                )
            )
    if not report.complete and report.stopped and report.stopped.code not in ("all_reduce_hung", "p2p_copy_hung"):
        out.append(report.stopped)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(out, key=lambda f: (order[f.severity], f.gpus))


def _slower(figures: dict[str, Any]) -> bool:
    gbs, host = figure(figures.get("gbs")), figure(figures.get("host_gbs"))
    return gbs is not None and host is not None and gbs < host


def _gpu_findings(gpu: int, c: Check, *, simulated: bool) -> list[Finding]:
    f = c.figures
    if c.check == "matmul" and not simulated:
        out = []
        for dtype, value in (f.get("tflops") or {}).items():
            got, peak = figure(value), figure((f.get("peak_tflops") or {}).get(dtype))
            if got and peak and got < SLOW_MATMUL_SHARE * peak:
                out.append(Finding("matmul_slow", "warn", [gpu], {"dtype": dtype, "tflops": got, "peak_tflops": peak}))
        return out
    if c.check == "memory_bandwidth" and not simulated:
        got, peak = figure(f.get("gbs")), figure(f.get("peak_gbs"))
        if got and peak and got < SLOW_MEMORY_SHARE * peak:
            return [Finding("memory_slow", "warn", [gpu], {"gbs": got, "peak_gbs": peak})]
        return []
    if c.check == "nvml_vs_smi":
        return [Finding("nvml_smi_disagree", "warn", [gpu], dict(row)) for row in f.get("disagree") or []]
    if c.check == "health":
        out = []
        ecc, xid = f.get("ecc_uncorrected"), f.get("xid")
        if isinstance(ecc, int) and ecc > 0:
            out.append(Finding("ecc_errors", "fail", [gpu], {"count": ecc}))
        if isinstance(xid, int) and xid > 0:
            out.append(Finding("xid", "fail" if c.status == "fail" else "warn", [gpu], {"xid": xid}))
        if f.get("throttle"):
            out.append(Finding("throttled", "warn", [gpu], {"reasons": list(f["throttle"])}))
        return out
    if c.check == "software" and c.status == "fail":
        return [Finding(c.why or "cuda_too_new", "fail", [], dict(f))]
    return []


def figure(v: Any) -> float | None:
    """A measured or published figure that means something (a positive finite number, not a bool), else None."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return float(v) if ok else None


# -- what the engine does about it --------------------------------------------------------------------
def actions_of(findings: list[Finding]) -> dict[str, Any]:
    """The report's `actions`: NCCL's P2P transport off for the pairs whose peer path is broken or slow."""
    pairs = sorted({(min(f.gpus), max(f.gpus)) for f in findings if f.code in P2P_OFF_BECAUSE and len(f.gpus) == 2})
    because = sorted({f.code for f in findings if f.code in P2P_OFF_BECAUSE and len(f.gpus) == 2})
    if not pairs:
        return {}
    return {"nccl_env": dict(NCCL_P2P_OFF), "pairs": [list(p) for p in pairs], "because": because}


def nccl_env_for(report: DoctorReport | None, gpus: list[int]) -> tuple[dict[str, str], list[Finding]]:
    """The environment a job on `gpus` gets from the machine check, and the findings that call for it."""
    if report is None:
        return {}, []
    chosen = set(gpus)
    why = [f for f in report.findings
           if f.code in P2P_OFF_BECAUSE and len(f.gpus) == 2 and set(f.gpus) <= chosen]  # fmt: skip
    return (dict(NCCL_P2P_OFF) if why else {}), why


def p2p_off_pairs(report: DoctorReport | None) -> set[tuple[int, int]]:
    """Pairs whose traffic the engine sends through host memory (NCCL_P2P_DISABLE): the planner's link model too."""
    if report is None:
        return set()
    return {(min(f.gpus), max(f.gpus)) for f in report.findings if f.code in P2P_OFF_BECAUSE and len(f.gpus) == 2}


def store_key(identity: str, driver: str | None) -> str:
    """The file name a report is stored under: one per machine and driver (either changing calls for a new check)."""
    digest = hashlib.sha256(f"{identity}\0{driver or 'no-driver'}".encode()).hexdigest()[:16]
    return f"doctor-{digest}.json"


# -- words --------------------------------------------------------------------------------------------
def _gpus(gpus: list[int]) -> str:
    if len(gpus) == 2:
        return f"GPUs {gpus[0]} and {gpus[1]}"
    if len(gpus) == 1:
        return f"GPU {gpus[0]}"
    return "GPUs " + ", ".join(map(str, gpus))


def number(v: Any) -> str:
    """A figure as the CLI, the GUI and the findings' words all print it; "?" where nothing was measured."""
    x = figure(v)
    if x is None:
        return "?"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def describe(f: Finding) -> str:
    """One line a user reads, for every code the check makes (the CLI and the GUI show the same words)."""
    x = f.fields
    link = f" over {x['link']}" if x.get("link") and x.get("link") != "all" else ""
    match f.code:
        case "p2p_corrupt":
            return (f"Peer-to-peer copies between {_gpus(f.gpus)}{link} returned wrong data: jobs on both run with "
                    "NCCL_P2P_DISABLE=1 (traffic through host memory)")  # fmt: skip
        case "p2p_slower_than_host":
            return (
                f"Peer-to-peer copies between {_gpus(f.gpus)}{link} ({number(x.get('gbs'))} GB/s) are slower than "
                f"through host memory ({number(x.get('host_gbs'))} GB/s): jobs on both run with NCCL_P2P_DISABLE=1"
            )
        case "all_reduce_hung":
            return f"An all-reduce over {_gpus(f.gpus)}{link} did not finish within {number(x.get('deadline_s'))} s" + (
                ": jobs on both run with NCCL_P2P_DISABLE=1" if len(f.gpus) == 2 else ""
            )
        case "p2p_copy_hung":
            return (
                f"A peer-to-peer copy between {_gpus(f.gpus)}{link} did not finish within "
                f"{number(x.get('deadline_s'))} s: jobs on both run with NCCL_P2P_DISABLE=1"
            )
        case "p2p_not_supported":
            pairs = x.get("pairs") or [f.gpus]
            between = "any of the GPUs" if x.get("all") else ", ".join(f"{a}-{b}" for a, b in pairs)
            what = "GPUs" if x.get("all") else f"GPU pair{'s' * (len(pairs) != 1)}"
            return (
                f"The driver reports no peer-to-peer access between {between}: {what} exchange data through host memory"
            )
        case "matmul_slow":
            return (
                f"{_gpus(f.gpus)} reaches {number(x.get('tflops'))} TFLOP/s in {x.get('dtype')}, under half its spec "
                f"sheet's {number(x.get('peak_tflops'))}: check its clocks, power limit and cooling"
            )
        case "memory_slow":
            return f"{_gpus(f.gpus)} copies memory at {number(x.get('gbs'))} GB/s of a spec sheet's {number(x.get('peak_gbs'))}"
        case "nvml_smi_disagree":
            return (
                f"{_gpus(f.gpus)}: NVML reads {x.get('field')} as {x.get('nvml')} but nvidia-smi shows {x.get('smi')}"
            )
        case "ecc_errors":
            return f"{_gpus(f.gpus)} reports {x.get('count')} uncorrectable ECC errors: jobs leave it out"
        case "xid":
            return f"{_gpus(f.gpus)} reported XID {x.get('xid')}"
        case "throttled":
            return f"{_gpus(f.gpus)} is throttled ({', '.join(map(str, x.get('reasons') or []))})"
        case "cuda_too_new":
            return (
                f"PyTorch was built for CUDA {x.get('cuda_torch')} but the driver ({x.get('driver')}) supports "
                f"CUDA {x.get('cuda_driver')} at most: update the driver"
            )
        case "check_failed":
            return f"The check stopped at {x.get('check', 'a check')}: {x.get('error', 'see its log')}"
        case _:
            return f"{f.code} on {_gpus(f.gpus)}" if f.gpus else f.code
