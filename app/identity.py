"""Who the app says it is, to the desktop: one reverse-DNS id for the desktop file,
the icon, the AppStream metadata and `setDesktopFileName`, so launchers and
Wayland compositors match windows to the menu entry."""

APP_ID = "io.rigpilot.Rigpilot"
APP_NAME = "Rigpilot"
ORGANIZATION = "Rigpilot"
