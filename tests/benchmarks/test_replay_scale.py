"""benchmarks/replay_scale.py refuses bad arguments before replaying anything."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "replay_scale.py"


def load_script():
    spec = importlib.util.spec_from_file_location("replay_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (("--policies", "lru,nope"), "--policies: unknown 'nope'; valid: adaptive, hit_density"),
    (("--repeats", "0"), "--repeats must be at least 1, got 0"),
])
def test_bad_arguments_are_refused_before_any_replay(capsys, monkeypatch, args, message):
    """Before, an unknown policy after a known one was refused only once that one's replays had run
    (35 s), and --repeats 0 ended in a StatisticsError traceback."""
    script = load_script()
    monkeypatch.setattr(script, "replay", lambda *a, **kw: pytest.fail("a replay ran"))
    with pytest.raises(SystemExit) as exit_:
        script.main(list(args))
    assert exit_.value.code == 2 and message in capsys.readouterr().err
