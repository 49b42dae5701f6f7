"""Settings → Nodes: the list, adding with the one node check (engine.service.nodes), removing.

The fake link answers with the real registry (the isolated config folder), as the engine would.
"""

from __future__ import annotations

import stat

from rigpilot.app.settings.nodes import NodesBox
from rigpilot.engine.service import nodes

from support.gui_fakes import FakeLink

TOKEN = "t" * 43
PINNED = "SHA256:" + "B" * 42 + "A"


def registry_link() -> FakeLink:
    return FakeLink("1x-rtx4090", replies={
        "nodes": lambda **_: {"nodes": [nodes.probe(n, timeout=1) for n in nodes.load().values()]},
        "node_add": lambda name, address, token, fingerprint=None: {
            "node": nodes.probe(nodes.add(name, address, token, fingerprint), timeout=1)
        },
        "node_remove": lambda name: (nodes.remove(name), {"removed": name})[1],
    })  # fmt: skip


def test_nodes_are_added_checked_and_removed_through_the_engine(qtbot):
    link = registry_link()
    box = NodesBox(link)
    qtbot.addWidget(box)
    qtbot.waitUntil(lambda: box.status.text() == "No nodes yet.")

    # The same check as the CLI's and the socket's: shown beside the fields, nothing sent.
    box.name.setText("local")
    box.address.setText("127.0.0.1:1")
    box.token.setText(TOKEN)
    box.add()
    assert "means this engine itself" in box.error.text() and not box.error.isHidden()
    assert [c for c, _ in link.calls].count("node_add") == 0
    box.name.setText("box2")
    box.address.setText("box2.lan")
    box.add()
    assert "HOST:PORT" in box.error.text()

    box.address.setText("127.0.0.1:1")
    box.fingerprint.setText("SHA256:not-one")
    box.add()
    assert "not a certificate fingerprint" in box.error.text()
    box.fingerprint.setText(PINNED.removeprefix("SHA256:"))  # as pasted without its prefix
    with qtbot.waitSignal(box.sig_nodes, timeout=5000):  # nothing listens there: added, and shown as not reachable
        box.add()
    assert box.error.isHidden()
    assert box.table.rowCount() == 1 and box.table.item(0, 0).text() == "box2"
    assert box.table.item(0, 2).text().startswith("not reachable")
    assert box.table.item(0, 3).text() == PINNED  # the certificate it must present, to compare with the machine's
    assert link.requests("node_add")[-1]["fingerprint"] == PINNED
    assert box.token.text() == "" and box.fingerprint.text() == ""  # the secret does not linger in the form
    registry = nodes.registry_path()
    assert stat.S_IMODE(registry.stat().st_mode) == 0o600
    assert nodes.load()["box2"].token == TOKEN

    box.table.selectRow(0)
    with qtbot.waitSignal(box.sig_nodes, timeout=5000):
        box.remove_selected()
    assert box.table.rowCount() == 0 and nodes.load() == {}


def test_the_wizards_node_choice_goes_into_the_submission_and_the_command(qtbot):
    from PySide6.QtCore import Qt

    from rigpilot.app.wizard.engine_requests import submission
    from rigpilot.app.wizard.node_choice import NodeChoice
    from rigpilot.app.wizard.state import default_state

    link = FakeLink("1x-rtx4090", replies={"nodes": {"nodes": [{"name": "box2", "address": "127.0.0.1:7861"}]}})
    choice = NodeChoice()
    qtbot.addWidget(choice)
    assert choice.isHidden()  # no nodes: nothing to choose, nothing shown
    choice.load(link, [])
    qtbot.waitUntil(lambda: choice.list.count() == 1)
    assert not choice.isHidden() and choice.chosen() == []
    with qtbot.waitSignal(choice.sig_changed) as changed:
        choice.list.item(0).setCheckState(Qt.CheckState.Checked)
    assert changed.args == [["box2"]]

    state = default_state(link.machine_obj.to_dict())
    assert "nodes" not in submission(link, state)  # one machine unless the user ticks another
    state.nodes = ["box2"]
    assert submission(link, state)["nodes"] == ["local", "box2"]
    assert "--nodes local,box2" in state.command()
