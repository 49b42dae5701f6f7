"""One GPU at a glance: memory, utilisation, temperature and power with their recent history, flags, its job."""

from __future__ import annotations

from typing import Any

import numpy as np
from PySide6.QtCore import QEvent, QSize, Qt
from PySide6.QtGui import QFont, QPixmap, QResizeEvent
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QSizePolicy, QWidget

from rigpilot.app.widgets.meter import Meter
from rigpilot.app.widgets.palette import series_color
from rigpilot.app.widgets.sparkline import Sparkline
from rigpilot.app.widgets.style import set_status, set_surface
from rigpilot.app.widgets.units import NA, celsius, gib, mhz, percent, watts
from rigpilot.app.widgets.value_label import ValueLabel
from rigpilot.engine.hardware.machine import Gpu, short_gpu_name

SPARK_METRICS = ["gpu_util", "temperature_c", "power_w"]
SPARK_SECONDS = 60.0
_FORMATS = {"gpu_util": percent, "temperature_c": celsius, "power_w": watts, "fan_pct": percent, "sm_clock_mhz": mhz}


def flag_text(sample: dict[str, Any]) -> tuple[str, str]:
    """What is wrong with a GPU in a few words, and a longer tooltip; ("ok", ...) when nothing is."""
    flags = []
    health = sample.get("health")
    if health and health != "ok":
        flags.append(health.upper())
    flags += [r.replace("_", " ") for r in (sample.get("throttle_reasons") or []) if r != "idle"]
    if sample.get("ecc_uncorrected"):
        flags.append(f"ECC ×{sample['ecc_uncorrected']}")
    if sample.get("xid"):
        flags.append(f"XID {sample['xid']}")
    if flags:
        return ", ".join(flags), "Throttle reasons and health: " + ", ".join(flags)
    throttle = sample.get("throttle_reasons")
    if throttle is None and health is None:
        na = sample.get("unavailable") or {}
        return NA, f"Throttle reasons and health: {na.get('throttle_reasons') or na.get('health') or 'not reported'}"
    return ("ok (idle)" if throttle and "idle" in throttle else "ok"), "No throttling, no errors"


class ElidedLabel(QLabel):
    """One line that ends in "…" when it does not fit; the tooltip always has the whole text.

    A wrapped label in a card of fixed height is cut off at the bottom instead (the job line was).
    """

    def __init__(self, text: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.full_text = ""
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(40)
        self.set_full_text(text)

    def minimumSizeHint(self) -> QSize:
        return QSize(40, super().minimumSizeHint().height())  # never what makes a card wider

    def set_full_text(self, text: str, tooltip: str | None = None) -> None:
        self.full_text = text
        self.setToolTip(tooltip if tooltip is not None else text)
        self._elide()

    def sizeHint(self) -> QSize:
        # The whole text's width, measured afresh: QLabel's own hint is of the (maybe elided) text shown.
        hint = super().sizeHint()
        extra = hint.width() - self.fontMetrics().horizontalAdvance(self.text())
        return QSize(self.fontMetrics().horizontalAdvance(self.full_text) + max(extra, 0), hint.height())

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._elide()

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._elide()

    def _elide(self) -> None:
        width = self.contentsRect().width() - 2 * self.margin()
        shown = self.fontMetrics().elidedText(self.full_text, Qt.TextElideMode.ElideRight, width) if width > 0 else self.full_text
        if shown != self.text():
            self.setText(shown)


class GpuCard(QFrame):
    def __init__(self, gpu: Gpu, parent: QWidget | None = None):
        super().__init__(parent)
        self.index = gpu.index
        self.gpu = gpu
        self.setObjectName(f"gpuCard{gpu.index}")
        set_surface(self, "card")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self._shown: tuple[Any, ...] | None = None

        self.title = ElidedLabel()
        font = QFont(self.title.font())
        font.setBold(True)
        self.title.setFont(font)
        self.title.set_full_text(f"GPU {gpu.index} · {short_gpu_name(gpu.name)}",
                                 f"{gpu.name}\nBus {gpu.pci_bus_id or NA}\nUUID {gpu.uuid or NA}")  # fmt: skip
        # The GPU's colour in the charts, as a swatch: a style sheet on the title kept its text in the colours of
        # the theme it was made under (dark on dark after a switch) and never drew its stripe.
        self.swatch = QLabel()
        self.swatch.setObjectName("gpuSwatch")
        swatch = QPixmap(6, 14)
        swatch.fill(series_color(gpu.index))
        self.swatch.setPixmap(swatch)
        self.flags = QLabel(NA)
        self.flags.setObjectName("flags")

        self.memory = Meter(f"GPU {gpu.index} memory")
        self.memory.setObjectName("memory")

        self.util = ValueLabel("Utilisation")
        self.temp = ValueLabel("Temperature")
        self.power = ValueLabel("Power draw")
        self.fan = ValueLabel("Fan speed")
        self.clock = ValueLabel("SM clock")
        self.values = {
            "gpu_util": self.util,
            "temperature_c": self.temp,
            "power_w": self.power,
            "fan_pct": self.fan,
            "sm_clock_mhz": self.clock,
        }
        limit = gpu.power_limit_w
        self.sparks = {
            "gpu_util": Sparkline(series_color(gpu.index), (0.0, 100.0)),
            "temperature_c": Sparkline(series_color(gpu.index), None, min_span=10.0),
            "power_w": Sparkline(series_color(gpu.index), (0.0, limit) if limit else None),
        }
        self.job = ElidedLabel("No job")
        self.job.setObjectName("job")

        grid = QGridLayout(self)
        grid.setContentsMargins(8, 6, 8, 6)
        grid.setVerticalSpacing(2)
        head = QHBoxLayout()  # the title takes the row, ahead of the flags, whatever the columns below need
        head.setContentsMargins(0, 0, 0, 0)
        head.addWidget(self.swatch)
        head.addWidget(self.title, 1)
        head.addWidget(self.flags)
        grid.addLayout(head, 0, 0, 1, 3)
        grid.addWidget(QLabel("Memory"), 1, 0)
        grid.addWidget(self.memory, 1, 1, 1, 2)
        for row, (name, key) in enumerate(
            (("Util", "gpu_util"), ("Temp", "temperature_c"), ("Power", "power_w")), start=2
        ):
            grid.addWidget(QLabel(name), row, 0)
            grid.addWidget(self.values[key], row, 1)
            grid.addWidget(self.sparks[key], row, 2)
        # Labelled one by one: "Fan · SM" over two numbers read as one cryptic pair.
        grid.addWidget(QLabel("Fan"), 5, 0)
        # The fan's value, then the SM clock with its own label, across the value and sparkline columns:
        # the title already makes those wide enough, so the card gets no wider.
        fan_clock = QHBoxLayout()
        fan_clock.setContentsMargins(0, 0, 0, 0)
        fan_clock.setSpacing(6)
        fan_clock.addWidget(self.fan)
        fan_clock.addSpacing(10)
        fan_clock.addWidget(QLabel("SM clock"))
        fan_clock.addWidget(self.clock)
        fan_clock.addStretch(1)
        grid.addLayout(fan_clock, 5, 1, 1, 2)
        grid.addWidget(self.job, 6, 0, 1, 3)
        grid.setColumnStretch(2, 1)
        # Compact (set_compact): the readings on one line instead of three rows with sparklines, so two rows of
        # four cards fit above the chart at 1280×800, as nvitop shows an 8-GPU box at a glance.
        self.readings = ElidedLabel("")
        self.readings.setObjectName("readings")
        grid.addWidget(self.readings, 2, 0, 1, 3)  # where the rows it stands for are, hidden
        self.readings.hide()
        self._detail = [grid.itemAtPosition(r, c) for r in range(2, 6) for c in range(3)]
        self.compact = False
        self.set_compact(False)

    def set_compact(self, compact: bool) -> None:
        """Readings on one line (compact) or one row each with their sparklines."""
        self.compact = compact
        for w in self._detail_widgets():
            w.setVisible(not compact)
        self.readings.setVisible(compact)
        self._show_readings()

    def _detail_widgets(self) -> list[QWidget]:
        """The widgets of the rows compact mode hides (labels, values, sparklines, the fan and clock row)."""
        out: list[QWidget] = []
        for item in self._detail:
            inner = item.layout() if item is not None else None
            children = [inner.itemAt(i) for i in range(inner.count())] if inner is not None else [item]
            out += [w for child in children if child is not None and (w := child.widget()) is not None]
        return out

    def _show_readings(self) -> None:
        if not self.compact:
            return
        v = {key: label.text() for key, label in self.values.items()}
        self.readings.set_full_text(
            f"{v['gpu_util']} · {v['temperature_c']} · {v['power_w']} · fan {v['fan_pct']} · {v['sm_clock_mhz']}",
            f"Utilisation {v['gpu_util']}, temperature {v['temperature_c']}, power draw {v['power_w']}, "
            f"fan {v['fan_pct']}, SM clock {v['sm_clock_mhz']}",
        )

    def show_sample(self, sample: dict[str, Any] | None, jobs: list[dict[str, Any]]) -> None:
        """The newest readings; labels change only when what they say changes."""
        sample = sample or {"unavailable": {}}
        na = sample.get("unavailable") or {}
        key = (
            tuple(sample.get(k) for k in ("memory_used", "memory_total", *self.values)),
            tuple(sorted(na.items())),
            tuple(sample.get("throttle_reasons") or ()),
            sample.get("health"),
            sample.get("ecc_uncorrected"),
            sample.get("xid"),
            tuple((j["id"], j.get("name"), j.get("state")) for j in jobs),
        )
        if key == self._shown:
            return
        self._shown = key
        has_reading = "index" in sample
        for field, label in self.values.items():
            v = sample.get(field)
            reason = na.get(field) or (None if has_reading else "no reading yet")
            label.show_value(None if v is None else _FORMATS[field](v), reason)
        self._show_memory(sample, na)
        self._show_readings()
        text, tip = flag_text(sample) if has_reading else (NA, "no reading yet")
        self.flags.setText(text)
        self.flags.setToolTip(tip)
        set_status(self.flags, None if text.startswith("ok") or text == NA else "bad")
        if jobs:
            self.job.set_full_text(
                "Job: " + ", ".join(f"{j.get('name') or j['id']} ({j.get('state')})" for j in jobs),
                "\n".join(f"{j['id']}: {j.get('name', '')} ({j.get('state')})" for j in jobs),
            )
        else:
            self.job.set_full_text("No job", "")

    def _show_memory(self, sample: dict[str, Any], na: dict[str, str]) -> None:
        used, total = sample.get("memory_used"), sample.get("memory_total") or self.gpu.memory_total
        if used is None or not total:
            self.memory.set_value(None, NA)
            self.memory.setToolTip(f"Memory: {na.get('memory_used') or na.get('memory_total') or 'no reading yet'}")
        else:
            self.memory.set_value(used / total, f"{used / 2**30:.1f} / {gib(total)}")
            self.memory.setToolTip(f"{used / 2**20:.0f} MiB of {total / 2**20:.0f} MiB in use")

    def show_history(self, t: np.ndarray, rows: np.ndarray) -> None:
        """Sparklines: `rows` follow SPARK_METRICS."""
        if not len(t):
            return
        span = (float(t[-1]) - SPARK_SECONDS, float(t[-1]))
        for key, row in zip(SPARK_METRICS, rows, strict=True):
            self.sparks[key].set_data(t, row, span)

    def value_reason(self, field: str) -> str | None:
        """The n/a reason a value shows (for tests and accessibility), None when it shows a value."""
        return self.values[field].reason
