"""The phase timer (emapg.training.metrics): nested phases counted once."""

from emapg.training import metrics


def test_phase_timer_counts_nested_phases_once(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 10.0, 10.0, 12.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = metrics.PhaseTimer()
    with timer("update"), timer("ema"):  # update 0 .. 10, of which the EMA is 1 .. 3
        pass
    with timer("scoring"):  # 10 .. 12
        pass
    assert timer.seconds == {"ema": 2.0, "update": 8.0, "scoring": 2.0}
