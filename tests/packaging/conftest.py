"""Getting Rigpilot onto a machine: the .deb, dev.py's set-up, lint and system packages, engine-environment
installs, a fresh Debian, the system libraries Qt needs.

Debian roots are built by tests/support/debian_root.py; dev.py is loaded by tests/support/dev_script.py.
"""
