"""The engine's socket requests are declared once, each on its handler: the registry both the protocol's argument
checks and the service's dispatch read (engine.service.requests)."""

import inspect
from typing import Any

import pytest

from rigpilot.engine.api import protocol
from rigpilot.engine.api.protocol import ProtocolError, Text
from rigpilot.engine.service import requests
from rigpilot.engine.service.handling import RequestGroup

# The requests of protocol 1 (docs/cli-json.md and protocol's docstring list them): none may disappear.
PROTOCOL_1 = {
    "hello", "machine", "topology", "telemetry_history", "plan", "submit", "check", "submit_member", "check_member",
    "resume_member", "nodes", "node_add", "node_remove", "jobs", "job", "cancel", "resume", "delete",
    "simulate_fault", "rename", "results", "logs", "metrics", "subscribe", "unsubscribe", "shutdown",
    "reload_machine", "scaling_start", "scaling_study", "scaling_studies", "scaling_cancel", "doctor_start",
    "doctor_report", "simulate_link_fault",
}  # fmt: skip


def test_every_request_of_protocol_1_is_registered() -> None:
    assert set(requests.REQUESTS) == PROTOCOL_1


@pytest.mark.parametrize("name", sorted(PROTOCOL_1))
def test_every_registered_request_has_a_handler_and_a_schema(name: str) -> None:
    kind = requests.REQUESTS[name]
    assert kind.name == name and callable(kind.handler)
    required, optional = requests.REQUEST_SCHEMAS[name]
    assert (required, optional) == kind.schema
    params = inspect.signature(kind.handler).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for arg in (*required, *optional):
        assert arg in params or takes_any, f"{name}'s handler does not take {arg!r}"
    # Each argument's type is one the protocol can check (a type it cannot raises TypeError, not a refusal).
    for arg, tp in {**required, **optional}.items():
        with pytest.raises(ProtocolError):
            protocol.check_value(object(), tp, f"{name}.{arg}")


def test_the_protocol_and_the_documentation_name_the_same_requests() -> None:
    documented = protocol.__doc__ or ""
    assert not {name for name in requests.REQUESTS if name not in documented}


def test_an_unknown_type_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ProtocolError) as e:
        requests.parse_request({"v": 1, "id": 3, "type": "reboot", "args": {}})
    assert e.value.code == protocol.UNKNOWN_TYPE
    assert e.value.message.startswith("unknown request type 'reboot'; known: cancel, check, ")
    assert not e.value.fatal


def test_a_request_is_checked_against_its_declaration() -> None:
    req = requests.parse_request({"v": 1, "id": "a", "type": "rename", "args": {"job": "j1", "name": "new"}})
    assert (req.id, req.type, req.args) == ("a", "rename", {"job": "j1", "name": "new"})
    with pytest.raises(ProtocolError, match="rename: missing required argument 'name'"):
        requests.parse_request({"v": 1, "id": 1, "type": "rename", "args": {"job": "j1"}})
    with pytest.raises(ProtocolError, match="rename: unknown argument 'colour'"):
        requests.parse_request({"v": 1, "id": 1, "type": "rename", "args": {"job": "j", "name": "n", "colour": 1}})


def test_the_schemas_are_a_read_only_view() -> None:
    with pytest.raises(TypeError):
        requests.REQUEST_SCHEMAS["reboot"] = ({}, {})  # type: ignore[index]
    with pytest.raises(TypeError):
        requests.REQUEST_SCHEMAS["rename"][0]["extra"] = Text  # type: ignore[index]


def test_a_request_is_answered_by_its_declared_handler() -> None:
    group = RequestGroup()
    calls: list[Any] = []

    @group.request("echo", required={"text": Text}, optional={"times": int})
    def echo(engine: Any, conn: Any, text: str, times: int = 1) -> Any:
        calls.append((engine, conn))
        return {"text": text * times}

    (kind,) = list(group)
    assert kind.schema == ({"text": Text}, {"times": int})
    assert kind.handler("E", "C", text="ab", times=2) == {"text": "abab"} and calls == [("E", "C")]


@pytest.mark.parametrize(
    ("required", "optional", "problem"),
    [
        ({"text": Text}, {}, "does not take the argument 'text'"),  # declared, not taken
        ({}, {}, "takes 'job', which the request does not declare"),  # taken, not declared
        ({}, {"job": Text}, "optional argument 'job' has no default"),
    ],
)
def test_a_handler_that_does_not_take_its_declared_arguments_is_refused_at_import(
    required: dict[str, Any], optional: dict[str, Any], problem: str
) -> None:
    group = RequestGroup()
    with pytest.raises(TypeError, match=problem):

        @group.request("broken", required=required, optional=optional)
        def broken(engine: Any, conn: Any, job: str) -> Any:
            return None


def test_a_request_declared_twice_is_refused() -> None:
    group = RequestGroup()

    @group.request("twice")
    def first(engine: Any, conn: Any) -> Any:
        return 1

    with pytest.raises(ValueError, match="declared twice"):

        @group.request("twice")
        def second(engine: Any, conn: Any) -> Any:
            return 2


def test_a_declared_setting_out_of_range_in_a_request_is_refused_with_its_reason_and_fields() -> None:
    # scaling_start's micro_batch is the job setting: refused as a job spec's would be (issue 27: it once took
    # 1,048,576 where the engine takes 65,536), and the reply carries the same reason and facts.
    message = {"v": 1, "id": 1, "type": "scaling_start", "args": {"gpus": [1, 2], "model": "m", "micro_batch": 100_000}}
    with pytest.raises(ProtocolError) as refused:
        requests.parse_request(message)
    e = refused.value
    assert e.code == protocol.INVALID and e.reason == "out_of_range"
    assert e.fields == {"setting": "train.micro_batch", "value": 100_000, "lo": 1, "hi": 65_536}
    reply = protocol.error_reply(1, e.code, e.message, reason=e.reason, fields=e.fields)["error"]
    assert (reply["code"], reply["reason"], reply["fields"]["hi"]) == ("invalid", "out_of_range", 65_536)
