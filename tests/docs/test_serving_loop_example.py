"""``examples/serving_loop.py`` runs small on the CPU with both managers,
passes its dense check across prefix hits, evictions and preemptions, and
fails when the paged cache is used wrongly (so the check can fail)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("serving_loop_example", ROOT / "examples" / "serving_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def runs(example, tmp_path_factory):
    out = {}
    for backend in ("device", "reference"):
        path = tmp_path_factory.mktemp(backend) / "summary.json"
        rc = example.main(["--small", "--backend", backend, "--quiet", "--json", str(path)])
        out[backend] = (rc, json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("backend", ["device", "reference"])
def test_small_run_passes_its_dense_check_across_hits_evictions_and_preemptions(runs, example, backend):
    rc, s = runs[backend]
    assert rc == 0
    assert s["backend"] == backend
    assert s["hit_admissions"] > 0 and s["prefix_hit_tokens"] > 0  # prefix hits
    assert s["evictions"] > 0
    assert s["preemptions"] >= 1
    assert s["readmission_hit_tokens"] > 0  # a re-admission hit its own cached blocks
    assert s["padding_tokens"] > 0  # PAD slots were produced and dropped
    assert s["checked_tokens"] == s["computed_tokens"] > 0  # every computed token's output was compared
    assert s["max_abs_error"] <= example.ATOL


def test_both_managers_drive_the_same_run(runs):
    skip = {"backend", "seconds", "max_abs_error"}
    dev = {k: v for k, v in runs["device"][1].items() if k not in skip}
    ref = {k: v for k, v in runs["reference"][1].items() if k not in skip}
    assert dev == ref


def test_the_check_fails_when_slots_are_wrong(example, monkeypatch, capsys):
    real = example.slot_mapping

    def shifted(*args, **kwargs):
        slots, pos = real(*args, **kwargs)
        return torch.where(slots >= 0, slots + 1, slots), pos

    monkeypatch.setattr(example, "slot_mapping", shifted)
    assert example.main(["--small", "--backend", "reference", "--quiet"]) == 1
    assert "differs from the dense computation" in capsys.readouterr().err


def test_the_check_fails_on_a_hit_the_cache_does_not_have(example, monkeypatch, capsys):
    """A manager that claims a one-block hit for a request with none: the
    loop skips computing those tokens and attention reads a block nobody
    wrote for this prefix."""
    make = example._make_manager

    def lying_manager(*args, **kwargs):
        mgr = make(*args, **kwargs)
        step = mgr.step
        bs = mgr.block_size

        def lying_step(finished=(), running=(), new=()):
            res = step(finished, running, new)
            hits = list(res.num_computed_tokens)
            for i, h in enumerate(hits):
                if h == 0 and len(new[i].token_ids) > bs:
                    hits[i] = bs
                    return dataclasses.replace(res, num_computed_tokens=hits)
            return res

        mgr.step = lying_step
        return mgr

    monkeypatch.setattr(example, "_make_manager", lying_manager)
    assert example.main(["--small", "--backend", "reference", "--quiet"]) == 1
    assert "differs from the dense computation" in capsys.readouterr().err


def test_layer_inputs_depend_on_the_whole_prefix(example):
    """Equal tokens at equal positions after a different earlier token get
    other context ids, so a wrong prefix hit cannot pass the check."""
    a = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    b = a.clone()
    b[1] = 99
    ca, cb = example.Layer.context_ids(a), example.Layer.context_ids(b)
    assert ca[0] == cb[0]
    assert (ca[1:] != cb[1:]).all()
    assert torch.equal(ca, example.Layer.context_ids(a))


def test_bad_arguments_exit_2(example):
    assert example.main(["--small", "--large"]) == 2
    assert example.main(["--small", "--pad-to", "0"]) == 2


def test_readme_using_the_manager_names_the_example_and_the_command_that_runs_it():
    """A reader of "Using the manager" finds the end-to-end example and the
    command that runs it, the one the tests above run (``--small``)."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Using the manager\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [shlex.split(line.split("#", 1)[0]) for b in blocks for line in b.splitlines() if line.strip()]
    assert ["python", "examples/serving_loop.py", "--small"] in commands
    assert ["python", "examples/serving_loop.py", "--small", "--backend", "reference"] in commands
