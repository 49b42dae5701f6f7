"""dev.py test changes the system only when asked: the system packages only the SLURM tests need are
installed with --install-system-deps or CI=true, said first, and no service they bring is left enabled
or running.

The unit tests need no root: argument handling, the decision, the policy-rc.d and the undoing of
enabled services on a real folder tree. The last test does it for real in a Debian 13 root, as CI would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import debian_root
from support.dev_script import load_dev
from support.paths import REPO

PACKAGES = ("python3", "python3-venv")  # the root test_debian_root uses too: built once, cached


def _load_dev():
    return load_dev("rigpilot_dev_sysdeps")


@pytest.fixture
def dev():
    return _load_dev()


@pytest.fixture
def asked_nothing(dev, monkeypatch):
    """dev.py on a machine without SLURM or sshd, where nothing may be installed without being asked."""
    monkeypatch.setattr(dev, "missing_commands", lambda names: list(names))
    monkeypatch.delenv("CI", raising=False)
    installed: list[list[str]] = []

    def install(packages: list[str]) -> None:
        installed.append(packages)

    monkeypatch.setattr(dev, "install_system_packages", install)
    return installed


def test_the_flag_is_dev_pys_own_and_every_other_argument_goes_to_pytest_in_order(dev):
    assert dev.split_test_args([]) == (False, [])
    assert dev.split_test_args(["-x", "--install-system-deps", "-k", "slurm", "tests/x.py"]) == (
        True, ["-x", "-k", "slurm", "tests/x.py"])  # fmt: skip
    assert dev.split_test_args(["--install-system-deps"]) == (True, [])
    # After "--" everything is pytest's, a path that looks like the flag included.
    assert dev.split_test_args(["-q", "--", "--install-system-deps"]) == (False, ["-q", "--", "--install-system-deps"])
    assert dev.wants_help(["--help"]) and dev.wants_help(["-x", "-h"]) and not dev.wants_help(["--", "-h"])
    assert not dev.wants_help(["-k", "help"])


def test_only_the_flag_or_ci_true_asks_for_system_packages(dev):
    assert dev.install_requested(True, {}) == "--install-system-deps"
    assert dev.install_requested(False, {"CI": "true"}) == "CI=true"
    for environ in ({}, {"CI": "false"}, {"CI": ""}, {"RIGPILOT_TEST_INSTALL": "1"}):
        assert dev.install_requested(False, environ) is None


def test_unasked_nothing_is_installed_even_as_root_and_the_tests_say_why_they_skip(dev, asked_nothing, monkeypatch):
    monkeypatch.setattr(dev.os, "geteuid", lambda: 0)
    why = dev.prepare_test_system(False)
    assert asked_nothing == []
    assert why.startswith("SLURM is not installed (slurmctld, slurmd, munged") and "\n" not in why
    assert "python3 dev.py test --install-system-deps installs slurm-wlm munge" in why


def test_ci_installs_what_is_missing_and_says_what_and_why_first(dev, asked_nothing, monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(dev.os, "geteuid", lambda: 0)
    monkeypatch.setattr(dev.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "apt-get" else None)
    dev.prepare_test_system(False)
    assert asked_nothing == [["slurm-wlm", "munge", "openssh-server"]]
    said = capsys.readouterr().out
    assert said.startswith("dev.py test (CI=true): installing slurm-wlm munge openssh-server system-wide with "
                           "apt-get, for the SLURM tests (slurmctld, ")  # fmt: skip
    assert "sshd, ssh, ssh-keygen missing)" in said and said.count("\n") == 1


def test_only_what_is_missing_is_installed(dev, monkeypatch):
    monkeypatch.setattr(dev, "missing_commands", lambda names: ["sshd"] if "sshd" in names else [])
    assert dev.missing_system_packages() == ["openssh-server"]
    monkeypatch.setattr(dev, "missing_commands", lambda names: [])
    assert dev.missing_system_packages() == [] and dev.slurm_skip_reason() is None


def test_asked_without_root_it_stops_in_one_line_before_setting_anything_up(dev, asked_nothing, monkeypatch):
    monkeypatch.setattr(dev.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as stop:
        dev.prepare_test_system(True)
    message = str(stop.value.code)
    assert message.startswith("dev.py: --install-system-deps: installing system packages needs root.")
    assert "sudo apt-get install --no-install-recommends slurm-wlm munge openssh-server" in message
    assert "\n" not in message and asked_nothing == []
    # CI=true without root: the tests skip, saying so, as they did before it was asked.
    monkeypatch.setenv("CI", "true")
    why = dev.prepare_test_system(False)
    assert why.endswith("(CI=true, but installing system packages needs root)") and asked_nothing == []


def test_test_help_shows_dev_pys_option_then_pytests_and_installs_nothing(dev, asked_nothing, monkeypatch, capfd):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(dev, "VENV", Path(sys.prefix))  # this venv's pytest
    monkeypatch.setattr(dev, "ensure_env", lambda: None)
    monkeypatch.setattr(dev, "prepare_test_system", lambda flag: pytest.fail("--help must not install anything"))
    assert dev.cmd_test(["--install-system-deps", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("python3 dev.py test [--install-system-deps] [--fast] [PYTEST ARGUMENTS]")
    assert "slurm-wlm munge openssh-server" in out
    assert out.index("pytest's own options follow.") < out.index("usage: ") and "--strict-markers" in out
    assert asked_nothing == []


def test_dev_py_help_says_what_each_command_installs_where_and_what_needs_root():
    r = subprocess.run([sys.executable, REPO / "dev.py", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "What each command installs, where, and what needs root:" in r.stdout
    dev = _load_dev()
    for packages, _ in dev.TEST_SYSTEM_PACKAGES:
        for package in packages:  # the help is written out by hand: it must not drift from the list
            assert package in r.stdout and package in dev.TEST_HELP


def test_its_policy_rc_forbids_starting_services_and_goes_again_but_an_existing_one_is_left_alone(dev, tmp_path):
    policy = tmp_path / "policy-rc.d"
    with pytest.raises(RuntimeError), dev.services_kept_from_starting(policy) as ours:
        assert ours and os.access(policy, os.X_OK)
        assert subprocess.run([policy, "ssh", "start"]).returncode == 101
        assert dev.policy_forbids_starts(policy)
        raise RuntimeError("apt-get was interrupted")
    assert not policy.exists()

    policy.write_text("#!/bin/sh\nexit 0\n")  # a container's own, which allows starts
    policy.chmod(0o755)
    with dev.services_kept_from_starting(policy) as ours:
        assert not ours and not dev.policy_forbids_starts(policy)
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"
    assert not dev.policy_forbids_starts(tmp_path / "none")

    # One a killed dev.py left behind is dev.py's: used, then removed, so services are not blocked for good.
    with dev.services_kept_from_starting(policy := tmp_path / "left-behind") as ours:
        first = policy.read_text()
    policy.write_text(first)
    with dev.services_kept_from_starting(policy) as ours:
        assert ours
    assert not policy.exists()


def _link(root: Path, path: str, target: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).symlink_to(target)


def test_what_an_installation_enabled_is_disabled_again_and_nothing_else(dev, tmp_path):
    """On a real tree of links as Debian's maintainer scripts leave them (no tools are run outside "/")."""
    root = tmp_path
    lib = "/usr/lib/systemd/system"
    # The administrator's: a timer enabled, a service masked, a SysV script enabled, one disabled.
    _link(root, "etc/systemd/system/timers.target.wants/apt-daily.timer", f"{lib}/apt-daily.timer")
    _link(root, "etc/systemd/system/cups.service", "/dev/null")
    _link(root, "etc/rc2.d/S01cron", "../init.d/cron")
    _link(root, "etc/rc2.d/K01rsync", "../init.d/rsync")
    before = dev.enablement(root)
    assert {p.name for p in before} == {"apt-daily.timer", "S01cron"}  # the mask enables nothing
    # What installing openssh-server, munge and slurmd did in a Debian 13 root.
    _link(root, "etc/systemd/system/multi-user.target.wants/ssh.service", f"{lib}/ssh.service")
    _link(root, "etc/systemd/system/sshd.service", f"{lib}/ssh.service")  # its alias
    _link(root, "etc/systemd/system/ssh.service.wants/sshd-keygen.service", f"{lib}/sshd-keygen.service")
    _link(root, "etc/systemd/system/multi-user.target.wants/munge.service", f"{lib}/munge.service")
    _link(root, "etc/systemd/user/sockets.target.wants/ssh-agent.socket", "/usr/lib/systemd/user/ssh-agent.socket")
    for level in "2345":
        _link(root, f"etc/rc{level}.d/S01ssh", "../init.d/ssh")
        _link(root, f"etc/rc{level}.d/S01slurmd", "../init.d/slurmd")
    _link(root, "etc/rc0.d/K01slurmd", "../init.d/slurmd")

    disabled = dev.disable_again(before, root)

    assert disabled == ["munge.service", "ssh.service", "sshd-keygen.service", "slurmd (SysV)", "ssh (SysV)",
                        "ssh-agent.socket"]  # fmt: skip
    assert dev.enablement(root) == before
    assert not (root / "etc/systemd/system/sshd.service").is_symlink()
    for level in "2345":  # stopped, as update-rc.d disable leaves them: an upgrade does not enable them again
        assert os.readlink(root / f"etc/rc{level}.d/K01ssh") == "../init.d/ssh"
        assert (root / f"etc/rc{level}.d/K01slurmd").is_symlink()
    assert os.readlink(root / "etc/systemd/system/cups.service") == "/dev/null"
    assert (root / "etc/rc2.d/K01rsync").is_symlink()
    assert dev.disable_again(before, root) == []


# ---------------------------------------------------------------------------------------------
# For real, in a Debian 13 root


def _may_build() -> str | None:
    if os.environ.get("CI") != "true" and os.environ.get("RIGPILOT_TEST_INSTALL") != "1":
        return "builds a Debian root as root: runs where CI=true or RIGPILOT_TEST_INSTALL=1"
    return debian_root.unavailable("trixie", PACKAGES)


# dev.py's own function, as `dev.py test` calls it, without the venv set-up around it.
PREPARE = """
import json, sys
sys.path.insert(0, "/srv/rigpilot")
import dev
print(json.dumps({"skip": dev.prepare_test_system(False)}))
"""
SERVICES = ("ssh.service", "ssh.socket", "sshd-keygen.service", "munge.service", "slurmctld.service",
            "slurmd.service")  # fmt: skip


def _apt_cache(base: Path) -> Path:
    """Package lists and .debs of an earlier run, kept beside the cached root and made from it: the
    install then needs no network and downloads nothing (deleting the root's cache entry renews both)."""
    built = json.loads((base.parent / "manifest.json").read_text())["built"]
    return debian_root.default_cache_dir().parent / "apt" / f"{base.parent.name}-{built.replace(':', '')}"


def _keep_apt_cache(root: Path, cache: Path) -> None:
    partial = cache.with_name(cache.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(root / "var/lib/apt/lists", partial / "lists", ignore=shutil.ignore_patterns("lock", "partial"))
    (partial / "archives").mkdir()
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        shutil.copy2(deb, partial / "archives")
    try:
        partial.rename(cache)
    except OSError:  # another run kept its own first
        shutil.rmtree(partial, ignore_errors=True)


def _packages(root: Path) -> str:
    r = debian_root.run(root, ["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Abbrev}\n"])
    assert r.returncode == 0, r.stderr
    return r.stdout


def _links(root: Path) -> set[str]:
    """Every systemd link and SysV start link, listed inside the root (independent of dev.py's own list)."""
    r = debian_root.run(root, ["sh", "-c", "find /etc/systemd -type l; ls -d /etc/rc?.d/S* 2>/dev/null || true"])
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def _running_in(root: Path) -> list[str]:
    prefix = str(root.resolve())
    running = []
    for proc in Path("/proc").iterdir():
        try:
            where = (proc / "root").readlink().as_posix() if proc.name.isdigit() else ""
            if where == prefix or where.startswith(prefix + "/"):
                running.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except OSError:
            continue  # gone meanwhile, or a kernel thread
    return running


@pytest.mark.slow
@pytest.mark.skipif(_may_build() is not None, reason=str(_may_build()))
def test_in_debian13_only_ci_installs_the_test_packages_and_leaves_no_service_enabled_or_running(tmp_path):
    base = debian_root.root("trixie", PACKAGES)
    cache = _apt_cache(base)
    with debian_root.writable_copy(base, tmp_path / "copy") as root:
        debian_root.copy_in(root, REPO / "dev.py", "/srv/rigpilot/dev.py")
        if cache.is_dir():
            debian_root.copy_in(root, cache / "lists", "/var/lib/apt/lists")
            debian_root.copy_in(root, cache / "archives", "/var/cache/apt/archives")
        packages, links = _packages(root), _links(root)

        # Run as a developer would, as root: nothing is installed, and the note says how to get it.
        unasked = debian_root.run(root, ["python3", "-c", PREPARE])
        assert unasked.returncode == 0, unasked.stderr
        skip = json.loads(unasked.stdout.splitlines()[-1])["skip"]
        assert skip.startswith("SLURM is not installed (") and "dev.py test --install-system-deps" in skip
        assert unasked.stdout.count("\n") == 1 and _packages(root) == packages

        # As CI runs it: installed, said first, and nothing left enabled or running.
        ci = debian_root.run(root, ["python3", "-c", PREPARE], env={"CI": "true"}, timeout=900)
        assert ci.returncode == 0, ci.stdout[-3000:] + ci.stderr[-3000:]
        said = ci.stdout.splitlines()
        assert said[0].startswith("dev.py test (CI=true): installing slurm-wlm munge openssh-server system-wide")
        assert json.loads(said[-1]) == {"skip": None}, ci.stdout
        installed = _packages(root)
        for package in ("slurm-wlm", "slurmctld", "slurmd", "munge", "openssh-server"):
            assert f"\n{package} " in installed and f"\n{package} " not in packages
        assert _running_in(root) == []
        assert _links(root) == links, "links the installation left enabled"
        if (root / "usr/bin/systemctl").exists():  # systemd came as a dependency; it judges too
            enabled = debian_root.run(root, ["systemctl", "is-enabled", *SERVICES])
            assert enabled.stdout.split() == ["disabled"] * len(SERVICES), enabled.stdout + enabled.stderr
            agent = debian_root.run(root, ["systemctl", "--global", "is-enabled", "ssh-agent.socket"])
            assert agent.stdout.strip() == "disabled", agent.stdout + agent.stderr
        assert not (root / "usr/sbin/policy-rc.d").exists()  # dev.py's own is gone again
        assert "ssh.service" in ci.stdout and "munge.service" in ci.stdout  # it says what it disabled
        if not cache.is_dir():
            _keep_apt_cache(root, cache)
    assert not (base / "usr/sbin/slurmd").exists()  # the cached root is as it was


@pytest.mark.parametrize("args, cores, expected", [
    ([], 2, ["-n", "2", "--dist", "loadfile", "--max-worker-restart", "0"]),
    (["tests/unit/test_cli.py", "-k", "plan"], 16, ["-n", "4", "--dist", "loadfile", "--max-worker-restart", "0"]),  # never more than four
    ([], 1, []),
    (["-n", "1"], 2, []), (["-n3"], 2, []), (["--numprocesses=3"], 2, []), (["-p", "no:xdist"], 2, []),
    (["-pno:xdist"], 2, []), (["--pdb"], 2, []), (["--lf"], 2, []), (["--stepwise"], 2, []),
])  # fmt: skip
def test_the_suite_runs_on_one_test_process_per_core_unless_the_arguments_choose(dev, monkeypatch, args, cores,
                                                                                 expected):  # fmt: skip
    monkeypatch.setattr(dev.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert dev.pytest_workers(args) == expected
