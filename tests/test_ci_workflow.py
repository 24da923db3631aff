"""`bie-trt ci-workflow`: a valid GitHub Actions workflow with one matrix job per profile."""
from __future__ import annotations

import yaml
from click.testing import CliRunner

from bie_trt.cli import main

PROFILES = ["cpu", "rtx4060ti-8gb", "h200-141gb"]


def render(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, ["ci-workflow", *args])
    return r.exit_code, r.stdout, r.stderr


def test_workflow_is_valid_yaml_with_a_job_per_profile():
    code, out, err = render("--profiles", ",".join(PROFILES), "--checkpoint", "smollm2-135m")
    assert code == 0, err
    wf = yaml.safe_load(out)
    job = wf["jobs"]["build"]
    include = job["strategy"]["matrix"]["include"]
    assert [row["profile"] for row in include] == PROFILES
    runners = {row["profile"]: row["runner"] for row in include}
    assert runners["cpu"] == "ubuntu-latest" and "rtx4060ti-8gb" in runners["rtx4060ti-8gb"]

    uses = [s.get("uses", "") for s in job["steps"]]
    assert any(u.startswith("actions/cache@") for u in uses)
    assert any(u.startswith("actions/upload-artifact@") for u in uses)
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert "pip install -e ." in runs
    assert ("bie-trt build --checkpoint smollm2-135m --profile ${{ matrix.profile }} "
            "--out engines/${{ matrix.profile }}") in runs
    assert "bie-trt verify engines/${{ matrix.profile }}" in runs
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"]["path"] == "engines/${{ matrix.profile }}"


def test_out_writes_the_file(tmp_path):
    target = tmp_path / ".github" / "workflows" / "build-engines.yml"
    code, out, err = render("--profiles", "rtx3060-8gb", "--out", str(target))
    assert code == 0, err
    assert out == ""
    wf = yaml.safe_load(target.read_text())
    assert wf["jobs"]["build"]["strategy"]["matrix"]["include"][0]["profile"] == "rtx3060-8gb"


def test_unknown_profile_lists_the_known_ones():
    code, out, err = render("--profiles", "cpu,rtx9999")
    assert code == 2
    assert "rtx9999" in err and "rtx4060ti-8gb" in err
