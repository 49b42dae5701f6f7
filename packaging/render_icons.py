"""Render the app icon's PNG sizes from its SVG (run after changing the SVG; the PNGs are committed).

    .venv/bin/python packaging/render_icons.py
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parents[1] / "resources" / "icons"
APP_ID = "io.rigpilot.Rigpilot"
SIZES = (16, 24, 32, 48, 64, 128, 256, 512)


def main() -> int:
    QGuiApplication(sys.argv[:1])
    renderer = QSvgRenderer(str(ICONS / f"{APP_ID}.svg"))
    if not renderer.isValid():
        print("the SVG icon does not parse", file=sys.stderr)
        return 1
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        out = ICONS / f"{size}x{size}" / f"{APP_ID}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        image.save(str(out))
        print(out.relative_to(ICONS.parent.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
