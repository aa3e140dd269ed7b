"""The figures the docs quote are the commands' (``tests/helpers/doc_figures.py``):
every one is in the docs as the recorded run renders it, every command is one
its doc writes, and the cheap commands, rerun, still report the same."""

from __future__ import annotations

import copy

import pytest

import doc_figures as figures


@pytest.fixture(scope="module")
def record() -> dict:
    return figures.load_record()


def test_the_record_holds_every_source_as_its_doc_writes_it(record):
    assert record.keys() == figures.SOURCES.keys()
    for i, source in figures.SOURCES.items():
        assert (record[i]["command"], record[i]["values"]) == (source.command, source.values), i


def test_every_source_is_a_command_its_doc_writes():
    assert [s.id for s in figures.unnamed_commands()] == []


def test_every_figure_the_docs_quote_is_as_recorded(record):
    missing = figures.missing_quotes(record)
    assert not missing, "run python tests/helpers/doc_figures.py check; the docs should say:\n\n" + "\n\n".join(
        f"{q.file} (from {q.source}):\n{q.text}" for q in missing)


def test_a_figure_that_changed_is_caught(record):
    changed = copy.deepcopy(record)
    changed["sweep-builtin"]["points"][0]["preemptions"] += 1
    changed["decode-16384"]["summary"]["evictions"] += 1
    changed["replay-builtin"]["summary"]["prefix_cache_hit_rate_ceiling"] += 0.001
    changed["replay-builtin"]["stdout"] = changed["replay-builtin"]["stdout"].replace("4,414 steps", "4,415 steps")
    missing = {(q.file, q.text.split("\n")[0][:30]) for q in figures.missing_quotes(changed)}
    assert {f for f, _ in missing} == {"README.md", "docs/chunked_prefill.md"}
    assert len(missing) == 4, missing


@pytest.mark.parametrize("source", [s for s in figures.SOURCES.values() if s.cheap], ids=lambda s: s.id)
def test_a_cheap_command_still_reports_what_was_recorded(source, record):
    # The README's main job (seconds): every figure of its summary and every
    # line it prints but the timings are what the docs quote.
    again = figures.run_source(source)
    assert figures.without_timings(again) == figures.without_timings(record[source.id])
