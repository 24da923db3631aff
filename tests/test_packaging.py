"""A wheel carries what `bie-trt build` needs beyond the code: the GPU build profiles, the jinja2
templates and the calibration text. An editable install reads them from the checkout, so only a
real wheel shows they are shipped."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_the_wheel_ships_profiles_templates_and_data(tmp_path):
    # found, not imported: importing setuptools here fails once another test's import loaded the stdlib distutils
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("needs setuptools to build the wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("bie_trt-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    # the unpacked wheel first on the path, ahead of the editable install (and not run from the checkout)
    code = ("import bie_trt, bie_trt.profiles as p, bie_trt.chat.templates as t; from bie_trt.builder.key_centering import "
            "CALIBRATION_TEXT; print(bie_trt.__file__); print(','.join(p.list_profiles())); "
            "print(','.join(sorted(f.name for f in t.TEMPLATES_DIR.iterdir()))); "
            "print(len(CALIBRATION_TEXT.read_text()))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    where, profiles, templates, calibration = res.stdout.split("\n")[:4]
    assert Path(where).is_relative_to(tmp_path / "site")
    assert profiles.split(",") == sorted(f.stem for f in (ROOT / "build_profiles").glob("*.toml"))
    assert templates.split(",") == sorted(f.name for f in (ROOT / "templates").iterdir())
    assert int(calibration) == len((ROOT / "bie_trt" / "data" / "calibration.txt").read_text())
