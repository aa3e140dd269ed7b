"""``gpukv sweep`` (``gpukv.sweep``): hit rate against capacity, each point a
plain replay, the ceiling a pool that never evicts; and the figures
(``gpukv.plot``, the ``plot`` extra) of a sweep and of a replay."""

from __future__ import annotations

import json
import sys

import pytest

from gpukv import sweep
from gpukv.cli import main
from gpukv.replay import Replay, ReplayOptions
from gpukv.traces import builtin_trace_path, load_trace

PNG = b"\x89PNG\r\n\x1a\n"


def test_each_point_is_the_replay_at_that_size_and_the_ceiling_never_evicts():
    path = str(builtin_trace_path())
    opts = ReplayOptions(block_size=16, hash_key=bytes(16))
    result = sweep.run_sweep(path, [900, 3000], opts, max_requests=12, jobs=1)
    trace = load_trace(path, max_requests=12)
    for point, blocks in zip(result["points"], [900, 3000], strict=True):
        s = Replay(trace, ReplayOptions(block_size=16, hash_key=bytes(16), num_blocks=blocks)).run()["summary"]
        assert point["num_blocks"] == blocks and point["capacity"] == blocks * 16
        assert (point["prefix_cache_hit_rate"], point["evictions"], point["preemptions"]) == (
            s["prefix_cache_hit_rate"], s["evictions"], s["preemptions"])
    ceiling = result["ceiling"]
    assert ceiling["num_blocks"] == sweep.ceiling_blocks(trace, 16)
    assert (ceiling["evictions"], ceiling["preemptions"], ceiling["rejected"]) == (0, 0, 0)
    assert result["points"][0]["evictions"] > 0  # the small pool does evict: the sizes differ in what matters


def test_parallel_processes_give_the_same_points():
    path, opts = str(builtin_trace_path()), ReplayOptions(block_size=32, hash_key=bytes(16), prompt_only=True)
    one = sweep.run_sweep(path, [200, 400], opts, max_requests=6, jobs=1)
    two = sweep.run_sweep(path, [200, 400], opts, max_requests=6, jobs=2)
    strip = lambda r: [{k: v for k, v in p.items() if k != "wall_s"} for p in [*r["points"], r["ceiling"]]]  # noqa: E731
    assert strip(one) == strip(two)


def test_default_sizes_halve_from_the_ceiling_and_serve_every_request():
    trace = load_trace(builtin_trace_path(), max_requests=20)
    top = sweep.ceiling_blocks(trace, 16)
    sizes = sweep.default_sizes(trace, 16)
    assert sizes == sorted(sizes) and sizes[-1] == top >> 1
    biggest = max(-(-(r.input_length + r.output_length) // 16) for r in trace.requests)
    assert sizes[0] > biggest


def test_a_gib_of_kv_cache_in_blocks():
    # 32 layers x K and V x 8 heads x 128 x 2 bytes x 16 tokens = 2 MiB a block.
    assert sweep.ModelShape(32, 8, 128, "bfloat16").blocks_for(1.0, 16) == 512
    assert sweep.ModelShape(32, 8, 128, "float32").blocks_for(1.0, 16) == 256


def test_the_command_writes_the_table_the_json_and_the_figure(tmp_path, capsys):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    status = main(["sweep", "--max-requests", "6", "--block-size", "32", "--tokens", "9600,19200", "--jobs", "1",
                   "--prompt-only", "--json", str(out_json), "--plot", str(out_png)])
    assert status == 0
    out = capsys.readouterr().out
    assert "(ceiling)" in out and "hit rate" in out
    result = json.loads(out_json.read_text())
    assert [p["num_blocks"] for p in result["points"]] == [300, 600]
    assert result["capacity_unit"] == "tokens" and result["trace"] == "built-in workload"
    assert out_png.read_bytes()[:8] == PNG


@pytest.mark.usefixtures("capsys")  # keeps the command's report off the test's output
def test_gib_sizes_through_the_command(tmp_path):
    out_json = tmp_path / "sweep.json"
    assert main(["sweep", "--max-requests", "4", "--gib", "0.5,1", "--layers", "32", "--kv-heads", "8",
                 "--head-size", "128", "--dtype", "bfloat16", "--jobs", "1", "--prompt-only",
                 "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert [(p["capacity"], p["num_blocks"]) for p in result["points"]] == [(0.5, 256), (1.0, 512)]
    ceiling = result["ceiling"]
    assert ceiling["capacity"] == ceiling["num_blocks"] / 512  # GiB too (512 blocks a GiB)


def test_a_plot_with_an_unknown_extension_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--max-requests", "4", "--plot", str(tmp_path / "x.jpeg")])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and ".png, .svg, .pdf" in err[0], err


def test_without_matplotlib_a_plot_is_one_error_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for argv in (["sweep", "--max-requests", "4"], ["replay", "--max-requests", "2", "--no-progress"]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--plot", str(tmp_path / "x.png")])
        assert info.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "the 'plot' extra" in err[0] and "gpukv[plot]" in err[0], err


def test_replay_plot_draws_three_panels(tmp_path):
    import xml.etree.ElementTree as ET

    out = tmp_path / "replay.svg"
    assert main(["replay", "--max-requests", "3", "--block-size", "64", "--prompt-only", "--no-progress",
                 "--plot", str(out)]) == 0
    text = "".join(ET.parse(out).getroot().itertext())
    for label in ("token hit rate so far", "blocks in use", "manager time per step (ms)", "step"):
        assert label in text, label
