"""`path_field`: the one way a form gets a path to type or choose, a line edit with a Browse… button.

    self.wheel, self.browse, row = path_field("torchWheel", "browseWheel", "a torch .whl file", self._browse)
    form.addRow("Local wheel", row)

The chooser itself stays with the caller (a file or a folder, which filter, where it starts).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import QHBoxLayout, QLineEdit, QPushButton

from rigpilot.app.widgets.icons import set_icon


def path_field(
    name: str, browse_name: str, placeholder: str, on_browse: Callable[[], object], *, accessible: str = "",
    clear_button: bool = False,
) -> tuple[QLineEdit, QPushButton, QHBoxLayout]:  # fmt: skip
    """The edit (object name `name`), its Browse… button (`browse_name`, calls `on_browse`) and the row holding both."""
    edit = QLineEdit()
    edit.setObjectName(name)
    edit.setPlaceholderText(placeholder)
    if accessible:
        edit.setAccessibleName(accessible)
    edit.setClearButtonEnabled(clear_button)
    browse = QPushButton("Browse…")
    set_icon(browse, "open-folder")
    browse.setObjectName(browse_name)
    browse.clicked.connect(on_browse)
    row = QHBoxLayout()
    row.addWidget(edit, 1)
    row.addWidget(browse)
    return edit, browse, row
