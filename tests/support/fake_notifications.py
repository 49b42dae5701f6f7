"""A stand-in freedesktop Notifications service for a test's private session bus: each Notify call it gets is
printed as one JSON line, after a line "ready" once it holds the name. Run as a script (`python -m` or by path)
with DBUS_SESSION_BUS_ADDRESS set to the private bus; QtDBus, in a process of its own because a client in the
same thread would wait on a service that cannot answer until the client returns."""

import json

from PySide6 import QtDBus
from PySide6.QtCore import ClassInfo, QCoreApplication, QObject, Slot


@ClassInfo({"D-Bus Interface": "org.freedesktop.Notifications"})
class Notifications(QObject):
    @Slot(str, "uint", str, str, str, "QStringList", "QVariantMap", int, result="uint")
    def Notify(self, app_name, replaces_id, icon, summary, body, actions, hints, expire_ms):  # the D-Bus method
        hints = {k: int(v) if isinstance(v, int) else str(v) for k, v in hints.items()}
        print(json.dumps({"app_name": app_name, "replaces_id": replaces_id, "icon": icon, "summary": summary,
                          "body": body, "actions": list(actions), "hints": hints, "expire_ms": expire_ms}), flush=True)  # fmt: skip
        return 1


if __name__ == "__main__":
    app = QCoreApplication([])
    bus = QtDBus.QDBusConnection.sessionBus()
    service = Notifications()
    if not bus.registerObject(
        "/org/freedesktop/Notifications", service, QtDBus.QDBusConnection.RegisterOption.ExportAllSlots
    ):
        raise SystemExit("cannot register the object")
    if not bus.registerService("org.freedesktop.Notifications"):
        raise SystemExit("cannot take the name org.freedesktop.Notifications")
    print("ready", flush=True)
    app.exec()
