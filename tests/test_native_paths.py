"""No silent slow path, and no Linux-only dependency.

Without the native helpers (`CAS_BANK_PURE_PYTHON=1` stands in for an install with
no C compiler) `cas-bank --version`, `cas-bank stats`, the servers' `/metrics` and
one warning of `Bank.open` say so. The library runs without the runtime extra
(FastAPI, uvicorn, mlx-lm, rich refused at import), and with the Linux-only calls
removed as on macOS (`os.sched_*affinity`, `os.posix_fadvise`, glibc's `mallopt` and
`sched_getcpu`).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from cas_bank.runtime.metrics import bank_metrics, render
from conftest import PYTHON, TESTS_DIR, child_env

from cas_bank import Bank, native

ROUNDTRIP = TESTS_DIR / "packaging_roundtrip.py"


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**child_env(), **env}
    return subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from cas_bank.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    return _python(code, *args, **env)


def test_without_the_helpers_every_report_says_so(tmp_path: Path) -> None:
    bank = tmp_path / "bank"
    out = _python(
        f"""
        import contextlib, io, json, runpy, sys
        sys.argv = ["roundtrip", {str(bank)!r}, "python"]
        try:
            runpy.run_path({str(ROUNDTRIP)!r}, run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e
        from cas_bank import Bank
        from cas_bank.runtime.metrics import bank_metrics, render
        from cas_bank.tools.cli import main

        def cli(*args):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                try:
                    assert main(list(args)) == 0
                except SystemExit as e:  # --version exits
                    assert not e.code, e
            return text.getvalue()

        with Bank.open({str(bank)!r}, mode="read_only") as b:
            metrics = render(bank_metrics(b.stats()))
        reports = dict(
            version=cli("--version"),
            stats=cli("stats", {str(bank)!r}),
            json=json.loads(cli("stats", {str(bank)!r}, "--json")),
            metrics=metrics,
        )
        print(json.dumps(reports))
        """,
        CAS_BANK_PURE_PYTHON="1",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    roundtrip, reports = json.loads(lines[-2]), json.loads(lines[-1])
    assert roundtrip["exact"] and roundtrip["loaded"] == [], roundtrip
    assert sorted(roundtrip["missing"]) == ["_chain", "_fill"] and not roundtrip["native_reader"]
    # Two opens in the process, one warning, naming what is slower.
    assert len(roundtrip["warnings"]) == 1 and "MISSING" in roundtrip["warnings"][0], roundtrip
    assert "chain hashing and payload fill" in roundtrip["warnings"][0]
    assert "native helpers MISSING" in reports["version"], reports
    assert "native helpers MISSING" in reports["stats"], reports
    assert sorted(reports["json"]["native_missing"]) == ["_chain", "_fill"]
    assert 'cas_bank_native_helper{helper="chain"} 0' in reports["metrics"]
    assert 'cas_bank_native_helper{helper="fill"} 0' in reports["metrics"]


def test_with_the_helpers_the_reports_say_they_are_loaded(
    bank: Bank, caplog: pytest.LogCaptureFixture
) -> None:
    if native.pure_python():
        pytest.skip("the native helpers are turned off (CAS_BANK_PURE_PYTHON)")
    s = native.status()
    assert s.complete and s.loaded == ("_chain", "_fill"), s
    text = render(bank_metrics(bank.stats()))
    assert 'cas_bank_native_helper{helper="chain"} 1' in text
    assert 'cas_bank_native_helper{helper="fill"} 1' in text
    with caplog.at_level("WARNING", logger="cas_bank"):
        assert not native.warn_if_missing(native.logging.getLogger("cas_bank"))
    assert "MISSING" not in caplog.text
    version = _cli("--version")
    assert "native helpers: _chain (chain hashing), _fill (payload fill)" in version.stdout
    assert "mlx " in version.stdout and "device" in version.stdout


def test_the_library_needs_no_runtime_extra(tmp_path: Path) -> None:
    """A store/restore round trip with FastAPI, uvicorn, mlx-lm and rich refused."""
    out = _python(
        f"""
        import sys, runpy
        for name in ("fastapi", "uvicorn", "mlx_lm", "rich", "starlette"):
            sys.modules[name] = None  # `import name` raises ImportError
        sys.argv = ["roundtrip", {str(tmp_path / "bank")!r}, "any"]
        try:
            runpy.run_path({str(ROUNDTRIP)!r}, run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e
        # The console script: --version works, a command names the extra to install.
        from cas_bank.tools.entry import main
        assert main(["--version"]) == 0
        assert main(["stats", {str(tmp_path / "bank")!r}]) == 2
        """
    )
    lines = out.stdout.splitlines()
    report = json.loads(lines[0]) if lines else None
    assert report is not None and report["exact"], out.stdout + out.stderr
    assert report["runtime_imported"] == [], report
    assert out.returncode == 0, out.stdout + out.stderr
    assert lines[1].startswith("cas-bank 0") and "native helpers" in lines[2], lines
    assert "the commands need the runtime extra (rich is not installed)" in out.stderr
    assert 'pip install "cas_bank[runtime]"' in out.stderr


def test_the_library_runs_without_the_linux_only_calls(tmp_path: Path) -> None:
    """As on macOS: no `os.sched_setaffinity`/`sched_getaffinity`/`posix_fadvise`, a C
    library without `mallopt` and `sched_getcpu`; the helper threads and a round trip
    work, and `keep_freed_memory` is a no-op."""
    out = _python(
        f"""
        import ctypes, os, runpy, sys
        for name in ("sched_setaffinity", "sched_getaffinity", "posix_fadvise"):
            if hasattr(os, name):
                delattr(os, name)
        LINUX_ONLY = {{"mallopt", "sched_getcpu"}}

        class CDLL(ctypes.CDLL):
            def __getattr__(self, name):
                if name in LINUX_ONLY:
                    raise AttributeError(name)
                return super().__getattr__(name)

            def __getitem__(self, name):
                if name in LINUX_ONLY:
                    raise AttributeError(name)
                return super().__getitem__(name)

        ctypes.CDLL = CDLL
        from cas_bank.restore.destinations import keep_freed_memory
        from cas_bank.restore import workers
        assert keep_freed_memory() is False
        assert workers._current_cpu is None  # no pinning without the calls
        work, done, helpers = iter(range(1000)), [], workers.Workers()
        helpers.together(lambda: done.extend(work))
        helpers.close()
        assert sorted(done) == list(range(1000))
        sys.argv = ["roundtrip", {str(tmp_path / "bank")!r}, "any"]
        runpy.run_path({str(ROUNDTRIP)!r}, run_name="__main__")
        """
    )
    report = json.loads(out.stdout.splitlines()[-1]) if out.stdout else None
    assert report is not None and report["exact"], out.stdout + out.stderr
