"""What the bubblewrap namespace adds to the ``code`` verifier's guard, and how a level is chosen.

The escape below gets past the audit hook for real: ``_posixsubprocess.fork_exec`` (the C
function under ``subprocess``) raises no audit event, so the program starts a fresh interpreter
that has no hook at all. That interpreter tries the network (a socket listening on this
machine's loopback), the run directory, a write to this machine's disk, and outliving the
verdict. Under bwrap each attempt fails; under the guard alone, run as root (where
``RLIMIT_NPROC`` does not bind), each one succeeds: the gap docs/reliability.md states.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.stages.verifiers import sandbox
from gfcr.stages.verifiers.code import verify_code

TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
OPTIONS = {"entry_point": "add", "prompt": "def add(a, b):\n", "timeout_s": 3.0}
HUMANEVAL_PIPELINE = Path(__file__).parents[3] / "pipelines" / "examples" / "code_humaneval_smollm2.yaml"
needs_bwrap = pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason=str(sandbox.bwrap_problem()))

PAYLOAD = '''
import os, socket, sys, time
seen = []
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    seen.append("network: connected")
except OSError as exc:
    seen.append(f"network: {{exc}}")
try:
    open({secret!r}).read()
    seen.append("run directory: read")
except OSError as exc:
    seen.append(f"run directory: {{exc.strerror}}")
try:
    open({marker!r}, "w").write("escaped")
    seen.append("disk: written")
except OSError as exc:
    seen.append(f"disk: {{exc.strerror}}")
os.write(int(sys.argv[1]), "; ".join(seen).encode())
os.close(int(sys.argv[1]))
time.sleep(60)  # still here after the verdict?
'''

ESCAPE = '''    import _posixsubprocess, os, sys
    report, child_end = os.pipe()
    error_read, error_write = os.pipe()
    _posixsubprocess.fork_exec([sys.executable, "-I", "-S", "-c", {payload!r}, str(child_end), {tag!r}],
                               [os.fsencode(sys.executable)], True, tuple(sorted((child_end, error_write))), None, None,
                               -1, -1, -1, -1, -1, -1, error_read, error_write, True, False, -1, None, None, None, -1,
                               None, False)
    os.close(child_end)
    raise AssertionError("escaped the audit hook: " + os.read(report, 4096).decode())
'''


class Escape:
    """A program that escapes the audit hook, the things it reaches for, and what it left behind."""

    def __init__(self, tmp_path: Path):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0)
        self.secret = tmp_path / "run" / "metrics.jsonl"
        self.secret.parent.mkdir()
        self.secret.write_text("{}\n")
        self.marker = tmp_path / "escaped"
        self.tag = f"gfcr-escape-{uuid.uuid4().hex}"
        payload = PAYLOAD.format(port=self.listener.getsockname()[1], secret=str(self.secret), marker=str(self.marker))
        self.program = ESCAPE.format(payload=payload, tag=self.tag)

    def connected(self) -> bool:
        try:
            self.listener.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    def survivors(self, grace_s: float = 0.0) -> list[int]:
        """Processes still carrying the tag after ``grace_s``, killed by pid (the guard's gap leaves one)."""
        deadline = time.monotonic() + grace_s
        while self.tagged() and time.monotonic() < deadline:
            time.sleep(0.05)
        found = self.tagged()
        for pid in found:
            os.kill(pid, 9)
        return found

    def tagged(self) -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if self.tag.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                continue
        return found

    def close(self) -> None:
        self.survivors()
        self.listener.close()


@pytest.fixture
def escape(tmp_path):
    escape = Escape(tmp_path)
    yield escape
    escape.close()


@needs_bwrap
def test_a_program_past_the_audit_hook_is_still_contained_under_bwrap(escape):
    verdict = verify_code(escape.program, TESTS, {**OPTIONS, "sandbox": "bwrap"})
    assert not verdict.correct
    assert verdict.reason == ("a test failed: AssertionError: escaped the audit hook: network: [Errno 111] Connection "
                              "refused; run directory: No such file or directory; disk: No such file or directory")
    assert not escape.connected() and not escape.marker.exists()  # refused by the namespace's own loopback
    # bwrap returns the runner's status as the PID namespace is torn down; the kernel ends the rest within moments
    assert escape.survivors(grace_s=5.0) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="as a user other than root, RLIMIT_NPROC 0 stops the escape's fork")
def test_under_the_guard_alone_a_root_program_past_the_audit_hook_reaches_everything(escape):
    verdict = verify_code(escape.program, TESTS, {**OPTIONS, "sandbox": "guard"})
    assert verdict.reason == ("a test failed: AssertionError: escaped the audit hook: network: connected; "
                              "run directory: read; disk: written")
    assert escape.connected() and escape.marker.read_text() == "escaped"
    assert len(escape.survivors()) == 1  # it outlived the verdict (killed here)


@needs_bwrap
def test_the_sandbox_sees_only_the_python_installation_and_its_own_directories():
    home = str(Path.home())
    listing = ("    import os\n    raise AssertionError(sorted(os.listdir('/')), os.getcwd(), os.listdir('.'),"
               f" os.listdir({home!r}) if os.path.isdir({home!r}) else None)\n")
    verdict = verify_code(listing, TESTS, {**OPTIONS, "sandbox": "bwrap"})
    system = {d.strip("/") for d in sandbox.SYSTEM_DIRS if os.path.lexists(d)}  # read-only, or links into /usr
    python = {root.strip("/").split("/")[0] for root in sandbox.python_roots()}  # /root, for a pyenv Python
    roots = sorted(system | python | {"dev", "tmp", "sandbox", "gfcr"})
    # the home directory is absent, or (a pyenv Python under it) holds only the path down to the installation
    inside_home = sorted({r[len(home) + 1:].split("/")[0] for r in sandbox.python_roots() if r.startswith(home + "/")})
    shown_home = inside_home or None
    assert verdict.reason == f"a test failed: AssertionError: ({roots!r}, '/sandbox', ['program.py'], {shown_home!r})"


@needs_bwrap
def test_the_private_directories_are_capped_so_a_program_cannot_fill_the_disk():
    fill = ("    with open('fill', 'wb') as f:\n        for _ in range(100):\n            f.write(bytes(1 << 20))\n")
    verdict = verify_code(fill, TESTS, {**OPTIONS, "sandbox": "bwrap", "file_size_kb": 1 << 20, "timeout_s": 20.0})
    assert verdict.reason == "OSError: [Errno 28] No space left on device"


def test_auto_picks_bwrap_where_it_works_and_the_guard_elsewhere(monkeypatch):
    assert sandbox.resolve("guard") == "guard"
    assert sandbox.resolve("auto") == ("bwrap" if sandbox.bwrap_problem() is None else "guard")
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap on the PATH: the fallback, as on a machine without it
    sandbox.bwrap_problem.cache_clear()
    try:
        assert sandbox.bwrap_problem() == "bubblewrap (`bwrap`) is not installed"
        assert sandbox.resolve("auto") == "guard"
        with pytest.raises(sandbox.SandboxUnavailable, match=r"`sandbox: bwrap`, but bubblewrap \(`bwrap`\) is not "
                           r"installed; fix: install bubblewrap \(`apt-get install bubblewrap`"):
            sandbox.resolve("bwrap")
        what, fix = sandbox.isolation_warning("auto")
        assert "run under the guard alone" in what and "not installed" in what and "apt-get install bubblewrap" in fix
        verdict = verify_code("    return a + b\n", TESTS, OPTIONS)  # auto, fallen back: still scored, by the guard
        assert verdict.correct
    finally:
        sandbox.bwrap_problem.cache_clear()


@pytest.mark.parametrize("level, exit_code, said", [
    ("auto", 0, ["warning:", "data.with.sandbox: the `code` verifier's programs run under the guard alone",
                 "bubblewrap (`bwrap`) is not installed", "fix: install bubblewrap"]),
    ("guard", 0, ["warning:", "`sandbox: guard` was asked for", "fix: write `sandbox: auto`"]),
    ("bwrap", 2, ["data.with.sandbox: `sandbox: bwrap`, but bubblewrap (`bwrap`) is not installed",
                  "fix: install bubblewrap", "or write `sandbox: auto` to fall back to the guard"]),
])
def test_validate_says_the_isolation_level_where_bwrap_is_missing(level, exit_code, said, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox.bwrap_problem.cache_clear()
    try:
        result = CliRunner().invoke(app, ["validate", str(HUMANEVAL_PIPELINE), "--set", f"data.with.sandbox={level}"])
    finally:
        sandbox.bwrap_problem.cache_clear()
    output = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == exit_code, output
    assert all(s in output for s in said), output


@needs_bwrap
def test_validate_is_quiet_where_bwrap_works():
    result = CliRunner().invoke(app, ["validate", str(HUMANEVAL_PIPELINE)])
    assert result.exit_code == 0 and "warning" not in result.output, result.output
