"""The package as people install it: `python -m build` makes an sdist carrying every
source the native helpers need and, from that sdist, a wheel with them built; the
wheel installs into a fresh virtualenv and works from outside the checkout: first
alone (the library needs no FastAPI, uvicorn or mlx-lm), then with its `runtime`
extra (the CLI). An sdist built where there is no C compiler still installs and runs
on the Python path, and says so.

Slow (a build and an install: ~1-3 min, the pip cache reused; built without build
isolation, with the dev environment's setuptools): not in the default
pytest run; `make test-package` runs it, and CI (.ci/run) runs that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import PYTHON, REPO_ROOT, TESTS_DIR

from cas_bank._version import __version__

pytestmark = pytest.mark.slow

NATIVE_DIR = REPO_ROOT / "cas_bank" / "_native"


def _run(cmd: list[str | Path], **kw: object) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAS_BANK_", "PYTHON"))}
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel) as `python -m build` makes them: the wheel is built from the sdist,
    so a source the sdist lacks fails the build (CAS_BANK_REQUIRE_NATIVE: no optional)."""
    out = tmp_path_factory.mktemp("dist")
    _run(
        [PYTHON, "-m", "build", "--no-isolation", "--outdir", out, REPO_ROOT],
        env=_env(CAS_BANK_REQUIRE_NATIVE="1"),
        cwd=out,
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv (no pip of its own: this one's pip installs into it)."""
    where = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", where])
    return where


def _pip(venv: Path, *args: str | Path, **env: str) -> None:
    _run(
        [PYTHON, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", *args],
        env=_env(**env),
    )


def _roundtrip(venv: Path, tmp: Path, want: str) -> dict[str, object]:
    """The round trip script run by the virtualenv's Python from an empty directory."""
    tmp.mkdir()
    out = subprocess.run(
        [venv / "bin" / "python", TESTS_DIR / "packaging_roundtrip.py", tmp / "bank", want],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    assert str(report["file"]).startswith(str(venv)), report  # not the checkout's
    assert report["exact"] and report["version"] == __version__
    return report


def test_sdist_carries_every_native_source(dist: tuple[Path, Path]) -> None:
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = {
        p.relative_to(REPO_ROOT).as_posix()
        for p in NATIVE_DIR.rglob("*")
        if p.is_file() and p.suffix not in (".o", ".so")
    }
    assert sources - names == set(), f"the sdist lacks {sorted(sources - names)}"
    assert {"LICENSE", "pyproject.toml", "setup.py", "MANIFEST.in"} <= names


def test_wheel_holds_the_built_helpers_and_metadata(dist: tuple[Path, Path]) -> None:
    _, wheel = dist
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"cas_bank-{__version__}.dist-info/METADATA").decode()
    for helper in ("_chain", "_fill"):
        assert any(n.startswith(f"cas_bank/{helper}.") and n.endswith(".so") for n in names)
    assert not [n for n in names if n.startswith("cas_bank/_native/")]  # sources: sdist only
    assert f"cas_bank-{__version__}.dist-info/licenses/LICENSE" in names
    assert f"Version: {__version__}\n" in meta
    assert "License-Expression: MIT\n" in meta
    assert "Project-URL" not in meta  # none is invented
    assert "Classifier: Programming Language :: Python :: 3" in meta


def test_wheel_installs_and_works_outside_the_checkout(
    dist: tuple[Path, Path], venv: Path, tmp_path: Path
) -> None:
    _, wheel = dist
    _pip(venv, "--no-compile", wheel)  # the library alone first
    alone = _roundtrip(venv, tmp_path / "alone", "native")
    assert alone["loaded"] == ["_chain", "_fill"] and alone["native_reader"], alone
    assert alone["runtime_imported"] == [] and alone["warnings"] == [], alone
    for module in ("fastapi", "uvicorn", "mlx_lm"):  # truly absent, not merely unimported
        probe = [venv / "bin" / "python", "-c", f"import {module}"]
        assert subprocess.run(probe, capture_output=True, cwd=tmp_path).returncode != 0

    cli = venv / "bin" / "cas-bank"
    assert "native helpers: _chain" in _run([cli, "--version"], cwd=tmp_path, env=_env()).stdout
    alone_stats = subprocess.run([cli, "stats", tmp_path / "alone" / "bank"], capture_output=True)
    assert alone_stats.returncode == 2 and b"cas_bank[runtime]" in alone_stats.stderr

    _pip(venv, "--no-compile", f"{wheel}[runtime]")
    version = _run([cli, "--version"], cwd=tmp_path, env=_env()).stdout
    assert f"cas-bank {__version__}" in version and "native helpers: _chain" in version, version
    assert "mlx " in version, version
    stats = _run([cli, "stats", tmp_path / "alone" / "bank", "--json"], cwd=tmp_path, env=_env())
    report = json.loads(stats.stdout)
    assert report["blocks"] == 4 and report["native_missing"] == {}, report
    _run([cli, "verify", tmp_path / "alone" / "bank"], cwd=tmp_path, env=_env())


def test_sdist_without_a_compiler_installs_and_says_so(
    dist: tuple[Path, Path], venv: Path, tmp_path: Path
) -> None:
    """`CC=false`: every compile fails; the install goes on, without the helpers, and
    the package says so (--version, the one warning of Bank.open)."""
    sdist, _ = dist
    built = tmp_path / "built"
    # This environment's setuptools (no build isolation), as the build above.
    wheel_cmd = [PYTHON, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run([*wheel_cmd, "-w", built, sdist], env=_env(CC="false"))
    (wheel,) = built.glob("*.whl")
    _pip(venv, "--no-compile", "--no-deps", "--force-reinstall", wheel)
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not list((site / "cas_bank").glob("_*.so")), "a helper was built with no compiler"
    report = _roundtrip(venv, tmp_path / "pure", "python")
    assert sorted(report["missing"]) == ["_chain", "_fill"], report  # type: ignore[call-overload]
    assert len(report["warnings"]) == 1 and "MISSING" in report["warnings"][0], report  # type: ignore[arg-type,index]
    version = _run([venv / "bin" / "cas-bank", "--version"], cwd=tmp_path, env=_env()).stdout
    assert "native helpers MISSING" in version, version
