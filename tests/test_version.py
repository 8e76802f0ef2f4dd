"""One version everywhere: ``modstate.__version__`` is the one place, and the CHANGELOG's newest
release, ``python -m modstate --version``, the wheel's metadata and the docs site agree with it."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import modstate

ROOT = Path(__file__).resolve().parent.parent
VERSION = modstate.__version__


def test_the_version_is_0_2_0():
    assert VERSION == "0.2.0"


def test_the_changelog_keeps_unreleased_above_the_newest_release_with_a_date():
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), flags=re.MULTILINE)
    assert headings[0] == "Unreleased"
    newest = re.fullmatch(r"(\d+\.\d+\.\d+) - (\d{4}-\d{2}-\d{2})", headings[1])
    assert newest is not None, f"the newest release heading reads {headings[1]!r}"
    assert newest.group(1) == VERSION


def test_the_command_line_prints_it():
    result = subprocess.run(
        [sys.executable, "-m", "modstate", "--version"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"modstate {VERSION}"


def test_the_wheel_built_from_this_checkout_carries_it(tmp_path):
    # A copy of what the wheel is built from, so the build writes nothing into the checkout.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == f"modstate-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"modstate-{VERSION}.dist-info/METADATA").decode()
    assert f"\nVersion: {VERSION}\n" in metadata


def test_the_docs_site_shows_it_on_every_page():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs/_tools/hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)  # what mkdocs runs (mkdocs.yml's hooks)
    config = hooks.on_config({"nav": []})
    assert config["copyright"] == f"modstate {VERSION}"
