"""scripts/setup.sh stops with a non-zero exit and says what to do when an install fails, instead of
printing `bie-trt ready` over pip's error. Run in a fresh virtual environment (pip lent to it from this
one, as creating it with pip takes long) against a package index that does not answer: the first
install fails within seconds, and nothing is downloaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pip

ROOT = Path(__file__).resolve().parents[1]


def dead_port() -> int:
    import socket

    with socket.socket() as s:   # bound and closed: nothing listens there during the test
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_setup_fails_loudly_when_an_install_fails(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    lent = tmp_path / "lent"
    lent.mkdir()
    (lent / "pip").symlink_to(Path(pip.__file__).parent)
    (purelib / "lend.pth").write_text(f"{lent}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(BIE_TRT_VENV=str(venv), PIP_INDEX_URL=f"http://127.0.0.1:{dead_port()}/simple",
               PIP_RETRIES="0", PIP_TIMEOUT="2", PIP_CONFIG_FILE=os.devnull, PIP_NO_INPUT="1")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "bie-trt ready" not in r.stdout
    assert "`pip install torch==" in r.stderr and "failed" in r.stderr and "PIP_INDEX_URL" in r.stderr
    assert "re-run `bash scripts/setup.sh`" in r.stderr
    assert "install -e" not in r.stdout + r.stderr   # it stopped at the first failure
