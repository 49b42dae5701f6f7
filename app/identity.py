"""Who the app says it is, to the desktop: one reverse-DNS id for the desktop file,
the icon, the AppStream metadata and `setDesktopFileName`, so launchers and
Wayland compositors match windows to the menu entry."""

APP_ID = "io.rigpilot.Rigpilot"
APP_NAME = "Rigpilot"
# On X11, Qt sets WM_CLASS to (the basename of argv[0], the application name): ("rigpilot", "Rigpilot"),
# whatever script or `python -m` started the app. The desktop file's StartupWMClass names the class.
COMMAND = "rigpilot"
ORGANIZATION = "Rigpilot"
