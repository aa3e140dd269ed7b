"""gpukv's start-up check under vLLM (``gpukv.vllm_plugin``): the tested
releases, the command line that names gpukv's scheduler, and the refusal
before the model loads. Needs no vLLM: the installed version is read from
package metadata, which the tests stand in for."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from gpukv import vllm_plugin
from gpukv.errors import GpukvError
from gpukv.vllm_plugin import TESTED_VLLM, UntestedVllmError, check_vllm_version, names_gpukv_scheduler

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["vllm", "serve", "m", "--scheduler-cls", "gpukv.vllm.AsyncScheduler"],
    ["vllm", "serve", "m", "--scheduler-cls=gpukv.vllm.Scheduler"],
    ["vllm", "serve", "m", "--scheduler_cls", "gpukv.vllm.DeviceAsyncScheduler"],
])
def test_a_command_line_naming_a_gpukv_scheduler_is_recognised(argv):
    assert names_gpukv_scheduler(argv)


@pytest.mark.parametrize("argv", [
    ["vllm", "serve", "m"],
    ["vllm", "serve", "m", "--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"],
    ["vllm", "serve", "gpukv.vllm.AsyncScheduler"],  # (a model called so, not the scheduler)
    ["vllm", "serve", "m", "--scheduler-cls"],
])
def test_other_command_lines_are_not(argv):
    assert not names_gpukv_scheduler(argv)


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0", "0.8.5.post1", "0.34.0+cu130"])
def test_tested_releases_pass(version):
    check_vllm_version(version, environ={})


def test_an_untested_release_is_refused_with_what_to_install():
    with pytest.raises(UntestedVllmError) as err:
        check_vllm_version("0.35.1", environ={})
    assert str(err.value) == (
        "vllm: gpukv's vLLM scheduler is tested with vLLM 0.8.5, 0.8.5.post1, 0.33.0, 0.34.0; found vLLM 0.35.1; "
        "on a GPU server, from a gpukv clone: `pip install vllm==0.34.0` then `pip install -e .` (or "
        "`pip install -e '.[vllm]'`, which pins vLLM 0.34.0); or set GPUKV_ALLOW_UNTESTED_VLLM=1 to try this "
        "release anyway (gpukv still refuses, at start-up, any manager call, parameter or request field it does "
        "not know)")
    assert isinstance(err.value, GpukvError) and isinstance(err.value, ImportError)


def test_an_untested_release_passes_when_opted_in():
    check_vllm_version("0.35.1", environ={"GPUKV_ALLOW_UNTESTED_VLLM": "1"})


def _start(monkeypatch, argv: list[str], version: str, environ: dict[str, str] | None = None) -> None:
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"vllm": version}[name])
    for name in ("GPUKV_VLLM_CHECK", "GPUKV_ALLOW_UNTESTED_VLLM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    vllm_plugin.plugin()


def test_the_plugin_refuses_an_untested_vllm_when_gpukvs_scheduler_is_configured(monkeypatch):
    with pytest.raises(UntestedVllmError, match="found vLLM 0.35.1"):
        _start(monkeypatch, ["vllm", "serve", "m", "--scheduler-cls", "gpukv.vllm.AsyncScheduler"], "0.35.1")


def test_the_plugin_checks_when_asked_through_the_environment(monkeypatch):
    with pytest.raises(UntestedVllmError, match="found vLLM 0.35.1"):
        _start(monkeypatch, ["python", "serve.py"], "0.35.1", {"GPUKV_VLLM_CHECK": "1"})


def test_the_plugin_leaves_other_schedulers_alone(monkeypatch):
    _start(monkeypatch, ["vllm", "serve", "m"], "0.35.1")  # no gpukv scheduler: nothing checked, nothing raised


def test_the_plugin_is_vllms_general_plugin_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"gpukv": "gpukv.vllm_plugin:plugin"}
    assert set(TESTED_VLLM.values()) == {"gpukv.vllm.Scheduler", "gpukv.vllm.AsyncScheduler"}
    extras = project["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={vllm_plugin.CURRENT_VLLM}"]
    pinned = {extra[0].removeprefix("vllm==") for name, extra in extras.items() if name.startswith("vllm")}
    assert pinned <= set(TESTED_VLLM)  # every extra installs a tested release


def test_importing_the_plugin_loads_neither_torch_nor_vllm():
    import subprocess

    code = "import sys, gpukv.vllm_plugin; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("version", ["", "0.34", "0.34.0rc1", "v0.34.0", "0.34.0 ", "junk+cu130"])
def test_a_version_string_that_is_not_exactly_a_tested_release_is_refused(version):
    with pytest.raises(UntestedVllmError, match="found vLLM"):
        check_vllm_version(version, environ={})


@pytest.mark.parametrize("value", ["", "0", "true", "yes", " 1"])
def test_only_the_documented_opt_in_value_opts_in(value):
    with pytest.raises(UntestedVllmError):
        check_vllm_version("0.35.1", environ={"GPUKV_ALLOW_UNTESTED_VLLM": value})


@pytest.mark.parametrize("argv", [
    ["vllm", "serve", "m", "--scheduler-cls="],
    ["vllm", "serve", "m", "--scheduler-cls", ""],
    ["vllm", "serve", "m", "--scheduler-clsx", "gpukv.vllm.AsyncScheduler"],
    ["vllm", "serve", "m", "--scheduler-cls", "gpukvx.Scheduler"],
])
def test_malformed_command_lines_name_no_gpukv_scheduler(argv):
    assert not names_gpukv_scheduler(argv)
