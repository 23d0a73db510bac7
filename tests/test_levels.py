"""Trace level resolution (both names honoured, the general name wins), the
loud override line, env read once per process, flags beat the environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from memra_dist.phase.levels import (ENV_PROF, ENV_TRACE, ENV_TRACE_ALIAS, TraceSettings, parse_level,
                                     trace_level_from)

# (general, alias) -> level, the resolution table of docs/seed-names.md
SEED_CASES = [
    (None, None, 0),
    ("x", None, 0),
    ("1", None, 1),
    ("2", None, 2),
    (None, "1", 1),
    (None, "2", 2),
    ("2", "2", 2),
    ("1", "2", 1),
    ("2", "1", 2),
    ("x", "1", 1),
]


@pytest.mark.parametrize("general, alias, level", SEED_CASES)
def test_seed_level_resolution(general, alias, level):
    warned = []
    assert trace_level_from(general, alias, warn=warned.append) == level
    loud = general in ("1", "2") and alias in ("1", "2") and general != alias
    junk = [v for v in (general, alias) if v not in (None, "", "0", "1", "2")]
    assert len(warned) == (1 if loud else 0) + len(junk)
    for v in junk:  # a junk value is ignored (= off) and said once
        assert any(w.startswith("[spec-trace] ignoring") and repr(v) in w for w in warned), warned
    if loud:
        line = warned[-1]
        assert line.startswith("[spec-trace] ")
        assert f"{ENV_TRACE}={general}" in line and f"{ENV_TRACE_ALIAS}={alias}" in line


def test_parse_level_zero_and_junk_are_off():
    assert parse_level("0") is None
    for junk in ("", "3", " 1", "1 ", "on", "true", "-1", "01"):
        assert parse_level(junk) is None, junk
    assert parse_level(None) is None
    assert parse_level("1") == 1 and parse_level("2") == 2
    assert trace_level_from("0", "2") == 2  # "0" is not a valid level: it never masks the alias


def test_default_warn_goes_to_stderr_once(capsys):
    assert trace_level_from("1", "2") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("[spec-trace]") == 1 and len(err.splitlines()) == 1


def test_settings_clock_on():
    assert not TraceSettings().clock_on
    assert TraceSettings(level=1).clock_on and TraceSettings(level=2).clock_on
    assert TraceSettings(prof=True).clock_on


SNIPPET = r"""
import os, sys
from memra_dist import env
from memra_dist.phase import levels
a = env.environment()
os.environ["MEMRA_SPEC_TRACE"] = "2"; os.environ["MEMRA_GLM5_SPEC_TRACE"] = "1"; os.environ["MEMRA_SPEC_PROF"] = "0"
b = env.environment()
print(a.trace_level, int(a.prof), b.trace_level, int(b.prof))
for flag_level, flag_prof in ((None, None), (0, None), (2, False), (1, True)):
    s = env.trace_settings(flag_level, flag_prof)
    print(s.level, int(s.prof))
"""


def _run(env_over: dict):
    env = {k: v for k, v in os.environ.items() if k not in (ENV_TRACE, ENV_TRACE_ALIAS, ENV_PROF)}
    env.update(env_over)
    res = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.split("\n"), res.stderr


@pytest.mark.parametrize("env, level, prof, loud, ignored", [
    ({}, 0, 0, False, []),
    ({ENV_TRACE: "1"}, 1, 0, False, []),
    ({ENV_TRACE_ALIAS: "2"}, 2, 0, False, []),
    ({ENV_TRACE: "1", ENV_TRACE_ALIAS: "2", ENV_PROF: "1"}, 1, 1, True, []),
    ({ENV_TRACE: "junk", ENV_TRACE_ALIAS: "1"}, 1, 0, False, [ENV_TRACE]),
    ({ENV_PROF: "yes"}, 0, 0, False, [ENV_PROF]),
    ({ENV_TRACE: "7", ENV_PROF: "0"}, 0, 0, False, [ENV_TRACE]),
])
def test_env_read_once_and_flags_beat_it(env, level, prof, loud, ignored):
    out, err = _run(env)
    # the first read decides; changing the environment afterwards is not seen (and the
    # second call does not print the loud line again)
    assert out[0] == f"{level} {prof} {level} {prof}"
    # trace_settings(): unset flags fall back to the env, set flags win
    assert out[1] == f"{level} {prof}"
    assert out[2] == f"0 {prof}"
    assert out[3] == "2 0"
    assert out[4] == "1 1"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    said = [ln for ln in lines if " ignoring " in ln]  # junk flags: said once each, though read twice
    assert len(said) == len(ignored) and all(any(f"{n}=" in ln for ln in said) for n in ignored), lines
    lines = [ln for ln in lines if ln not in said]
    if loud:
        assert len(lines) == 1 and lines[0].startswith("[spec-trace] ")
        assert f"{ENV_TRACE}=1" in lines[0] and f"{ENV_TRACE_ALIAS}=2" in lines[0]
    else:
        assert lines == []
