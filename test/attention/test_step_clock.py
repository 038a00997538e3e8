"""StepClock: measured end-to-end decode step times per path overrule the cost model to paged
where a shared-prefix path is measured slower (a host-bound model), and never where the
predicted saving dominates the step. Unit level with a fake clock, then through the real
DecodePlanner of a GraniKV backend on CPU."""

import math

import pytest

from granikv.attention.dispatcher import Decision, Path, PathTimes
from granikv.attention.decode.step_clock import MEASURED_FASTER, MEASURED_SLOWER, StepClock

INF = math.inf


class FakeTime:
    """A clock whose next step lasts ``period[path of the previous step]`` seconds."""

    def __init__(self, period):
        self.t, self.period, self.last = 0.0, period, Path.PAGED

    def __call__(self):
        return self.t

    def advance(self):
        self.t += self.period[self.last]


def model_choice(saving_us=200.0):
    return Decision(Path.CASCADE, PathTimes(1000.0 + saving_us, 1000.0, INF, INF), "cascade by the model")


def paged_choice(loss_us=100.0):
    """The model's paged choice for a grouped batch whose cascade it prices ``loss_us`` slower
    (the host term: ``Dispatcher`` marks such a choice ``host_bound``)."""
    return Decision(Path.PAGED, PathTimes(1000.0, 1000.0 + loss_us, INF, INF), "paged by the model", True)


def drive(clock, ft, steps, *, bs=64, saving_us=200.0, interrupt_at=(), choice=None):
    """``steps`` decode steps (the clock's integrity checked after each); returns the final paths."""
    paths = []
    for k in range(steps):
        if k in interrupt_at:
            clock.interrupt()
            ft.t += 0.05  # a prefill in between
        ft.advance()
        clock.tick()
        d = clock.adjust(choice if choice is not None else model_choice(saving_us), bs)
        clock.record(d.path, bs)
        clock.check_integrity()
        ft.last = d.path
        paths.append(d.path)
    return paths


def test_host_bound_batch_goes_paged_once_measured_slower():
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})  # the 4-layer forest's measured periods
    clock = StepClock(clock=ft)
    paths = drive(clock, ft, 60)
    first_paged = paths.index(Path.PAGED)
    assert all(p is Path.CASCADE for p in paths[:first_paged])  # measures the model's path first
    # paged measured faster: both paths measured once more (the confirmation), then paged held
    runs = [p for k, p in enumerate(paths) if k == 0 or p is not paths[k - 1]]
    assert runs == [Path.CASCADE, Path.PAGED, Path.CASCADE, Path.PAGED]
    assert paths[-20:] == [Path.PAGED] * 20
    assert clock.verdicts_paged == 1 and clock.verdicts_model == 0 and clock.confirmations == 1
    d = clock.adjust(model_choice(), 64)
    assert d.path is Path.PAGED and d.reason.startswith(MEASURED_SLOWER) and "measured" in d.reason


def test_measured_faster_path_is_kept_after_its_paged_window():
    ft = FakeTime({Path.CASCADE: 3.0e-3, Path.PAGED: 3.8e-3})
    clock = StepClock(clock=ft)
    paths = drive(clock, ft, 60)
    n_paged = paths.count(Path.PAGED)
    assert 0 < n_paged <= StepClock.WINDOW + 1 and paths[-1] is Path.CASCADE  # one paged window only
    assert clock.verdicts_model == 1 and clock.verdicts_paged == 0
    # the verdict's medians and window spreads are in the snapshot (constant periods: no spread)
    assert clock.snapshot()["clock_recent_verdicts"] == [["64", 3000.0, 3800.0, 0.0, 0.0, False]]


def test_one_noisy_paged_window_is_not_confirmed():
    """Paged measures faster in its first window only (noise): the confirmation measures both
    paths again, finds the model's path faster and holds it."""
    ft = FakeTime({Path.CASCADE: 3.0e-3, Path.PAGED: 3.8e-3})
    clock = StepClock(clock=ft)
    period = ft.period
    ft.period = {Path.CASCADE: 3.0e-3, Path.PAGED: 2.0e-3}  # the first paged window: a fast fluke
    paths = drive(clock, ft, 2 * StepClock.WINDOW + 1)
    ft.period = period
    paths += drive(clock, ft, 60)
    assert clock.confirmations == 1 and clock.verdicts_paged == 0 and clock.verdicts_model == 1
    assert paths[-20:] == [Path.CASCADE] * 20
    assert clock.snapshot()["clock_recent_verdicts"][-1][-1] is False


def test_a_saving_that_dominates_the_step_is_never_probed():
    ft = FakeTime({Path.CASCADE: 13.7e-3, Path.PAGED: 27.0e-3})  # 16K x 64 on 32 layers
    clock = StepClock(clock=ft)
    assert set(drive(clock, ft, 200, saving_us=13_000.0)) == {Path.CASCADE}
    assert clock.overruled_steps == 0


def test_intervals_across_another_forward_are_not_samples():
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})
    clock = StepClock(clock=ft)
    # a prefill every 4 steps: no run of the same path ever reaches SETTLE + the window
    paths = drive(clock, ft, 60, interrupt_at=range(0, 60, 3))
    assert set(paths) == {Path.CASCADE} and clock.verdicts_paged == clock.verdicts_model == 0


def test_a_verdict_expires_and_the_size_is_measured_again(monkeypatch):
    monkeypatch.setattr(StepClock, "HOLD", 10)
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})
    clock = StepClock(clock=ft)
    drive(clock, ft, 80)
    assert clock.verdicts_paged >= 2
    recent = clock.snapshot()["clock_recent_verdicts"]
    assert len(recent) == min(clock.verdicts_paged, StepClock.RECENT) and all(v[-1] for v in recent)


def test_a_planted_blind_clock_fails_the_host_bound_case(monkeypatch):
    """The planted fault: a clock whose samples are never taken keeps the model's slower path."""
    monkeypatch.setattr(StepClock, "_sample", lambda self, st, bs, path: None)
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})
    clock = StepClock(clock=ft)
    assert set(drive(clock, ft, 60)) == {Path.CASCADE}
    with pytest.raises(AssertionError):  # so the host-bound test above fails against it
        assert Path.PAGED in drive(StepClock(clock=ft), ft, 60)


def planner_steps(be, fb, rows, ft, steps):
    """``steps`` eager decode steps of the batch ``fb`` through the backend's real planner, one
    token longer each, the fake clock advancing by the previous step's path; their paths."""
    paths = []
    for step in range(steps):
        if step:
            fb.seq_lens_cpu = fb.seq_lens_cpu + 1
            fb.seq_lens = fb.seq_lens_cpu.clone()
        ft.advance()
        be.stage_batch(rows)
        be.init_forward_metadata(fb)
        be.decode.clock.check_integrity()
        ft.last = be.decode.path
        paths.append(be.decode.path)
    return paths


def test_through_the_decode_planner_a_measured_slower_cascade_goes_paged(monkeypatch):
    """The real backend and planner on CPU: the model says cascade (a small saving), the clock
    measures cascade steps longer than paged ones, and the planner runs paged from then on with
    the clock's reason in the step stats and the counters in server info."""
    from test_backend import _backend, _batch, _runner

    runner = _runner()
    be = _backend(runner, "auto")
    fb, rows = _batch(runner, hot={0, 2, 3})
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})
    be.decode.clock = StepClock(clock=ft)
    monkeypatch.setattr(be.decode.chooser, "choose", lambda *a, **k: model_choice())
    paths = planner_steps(be, fb, rows, ft, 40)
    assert paths[0] is Path.CASCADE and paths[-1] is Path.PAGED
    assert be.stats.last_reason.startswith(MEASURED_SLOWER)
    snap = be.stats_snapshot()
    assert snap["clock_verdicts_paged"] == 1 and snap["clock_overruled_steps"] > 0


def test_through_the_decode_planner_a_forced_path_is_never_overruled(monkeypatch):
    from test_backend import _backend, _batch, _runner

    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={0, 2, 3})
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})
    be.decode.clock = StepClock(clock=ft)
    assert set(planner_steps(be, fb, rows, ft, 30)) == {Path.CASCADE}


def test_check_integrity_sees_a_corrupted_measurement():
    ft = FakeTime({Path.CASCADE: 4.4e-3, Path.PAGED: 3.8e-3})
    clock = StepClock(clock=ft)
    drive(clock, ft, 60)
    clock.check_integrity()
    st = next(iter(clock._sizes.values()))
    st.hold_left = StepClock.HOLD + 1  # planted: a verdict that would hold too long
    with pytest.raises(AssertionError, match="held with"):
        clock.check_integrity()
    st.hold_left, clock.verdicts_model = 5, clock.verdicts_model + 1  # planted: a verdict counted twice
    with pytest.raises(AssertionError, match="verdicts per shape"):
        clock.check_integrity()


def test_a_paged_choice_is_probed_and_a_faster_cascade_held():
    """The model chose paged by a small margin (the 4-layer forest on an H100: paged priced 3.5%
    cheaper, cascade measured 17% faster): the clock measures the cascade runner-up, confirms
    the verdict against the model with a second pair of windows, and holds cascade."""
    ft = FakeTime({Path.CASCADE: 2.4e-3, Path.PAGED: 2.9e-3})
    clock = StepClock(clock=ft, probe_paged=True)
    paths = drive(clock, ft, 60, choice=paged_choice())
    runs = [p for k, p in enumerate(paths) if k == 0 or p is not paths[k - 1]]
    # the first step has no measured interval yet: the model's
    assert runs == [Path.PAGED, Path.CASCADE, Path.PAGED, Path.CASCADE, Path.PAGED, Path.CASCADE]
    assert paths[-20:] == [Path.CASCADE] * 20
    assert clock.verdicts_faster == 1 and clock.verdicts_paged == clock.verdicts_model == 0
    assert clock.confirmations == 1
    d = clock.adjust(paged_choice(), 64)
    assert d.path is Path.CASCADE and d.reason.startswith(MEASURED_FASTER) and "measured" in d.reason
    assert clock.snapshot()["clock_verdicts_faster"] == 1


def test_a_held_verdict_states_the_medians_of_its_own_windows():
    """A held verdict's reason (made once per verdict, every held step reuses it) names the
    medians the verdict measured: after the hold runs out and the windows measure other
    periods, the next verdict's reason names the new ones, not the text of the first."""
    ft = FakeTime({Path.CASCADE: 2.4e-3, Path.PAGED: 2.9e-3})
    clock = StepClock(clock=ft, probe_paged=True)
    drive(clock, ft, 60, choice=paged_choice())
    first = clock.adjust(paged_choice(), 64).reason
    assert first == f"{MEASURED_FASTER}: cascade 2400us < paged 2900us per step, measured"
    assert clock.adjust(paged_choice(), 64).reason is first  # made once, reused while held
    ft.period = {Path.CASCADE: 2.0e-3, Path.PAGED: 3.1e-3}
    next(iter(clock._sizes.values())).hold_left = 1  # the hold runs out at the next step
    drive(clock, ft, 60, choice=paged_choice())
    assert clock.verdicts_faster == 2
    second = clock.adjust(paged_choice(), 64).reason
    assert second == f"{MEASURED_FASTER}: cascade 2000us < paged 3100us per step, measured"


def test_a_paged_choice_measured_right_costs_one_window():
    """Paged really is faster: one window of cascade steps, one of paged, the model kept."""
    ft = FakeTime({Path.CASCADE: 3.2e-3, Path.PAGED: 2.9e-3})
    clock = StepClock(clock=ft, probe_paged=True)
    paths = drive(clock, ft, 80, choice=paged_choice())
    assert 0 < paths.count(Path.CASCADE) <= StepClock.WINDOW + 1 and paths[-40:] == [Path.PAGED] * 40
    assert clock.verdicts_model == 1 and clock.verdicts_faster == clock.verdicts_paged == 0


def test_a_clear_paged_choice_is_never_probed():
    """A margin above ``PROBE_LOSS`` of the step (500 us of ~2.9 ms), a paged choice with no
    other eligible path, or a clock told not to probe (the default): paged every step."""
    ft = FakeTime({Path.CASCADE: 2.4e-3, Path.PAGED: 2.9e-3})
    probing = dict(clock=ft, probe_paged=True)
    assert set(drive(StepClock(**probing), ft, 80, choice=paged_choice(loss_us=500.0))) == {Path.PAGED}
    alone = Decision(Path.PAGED, PathTimes(1000.0, INF, INF, INF), "paged: nothing else eligible")
    assert set(drive(StepClock(**probing), ft, 80, choice=alone)) == {Path.PAGED}
    off = StepClock(clock=ft)  # the default: model_paths
    assert set(drive(off, ft, 80, choice=paged_choice())) == {Path.PAGED} and off.overruled_steps == 0


def test_a_planted_one_sided_clock_fails_the_paged_probe_case():
    """The planted fault: a clock that only ever overrules toward paged (as before the probe)
    keeps the model's slower paged choice, so the probe test above fails against it."""
    ft = FakeTime({Path.CASCADE: 2.4e-3, Path.PAGED: 2.9e-3})
    paths = drive(StepClock(clock=ft, probe_paged=False), ft, 60, choice=paged_choice())
    with pytest.raises(AssertionError):
        assert paths[-20:] == [Path.CASCADE] * 20


def test_through_the_decode_planner_a_measured_faster_cascade_replaces_paged(monkeypatch):
    """The real backend and planner on CPU: the model says paged by a small margin, the clock
    measures cascade steps shorter, and the planner runs cascade (its outputs exact) with the
    clock's reason in the step stats."""
    import torch

    from test_backend import ATOL, LAYER, RTOL, _backend, _batch, _expected, _qkv, _runner

    runner = _runner()
    be = _backend(runner, "auto")
    fb, rows = _batch(runner, hot={0, 2, 3})
    ft = FakeTime({Path.CASCADE: 2.4e-3, Path.PAGED: 2.9e-3})
    be.decode.clock = StepClock(clock=ft, probe_paged=True)
    monkeypatch.setattr(be.decode.chooser, "choose", lambda *a, **k: paged_choice())
    paths = planner_steps(be, fb, rows, ft, 40)
    assert paths[0] is Path.PAGED and paths[-1] is Path.CASCADE
    assert be.stats.last_reason.startswith(MEASURED_FASTER)
    assert be.stats_snapshot()["clock_verdicts_faster"] == 1
    q, k, v = _qkv(fb.batch_size, 2)
    torch.testing.assert_close(be.forward_decode(q, k, v, LAYER, fb), _expected(runner, fb, q), atol=ATOL, rtol=RTOL)


def test_the_paged_probe_is_the_default_and_the_flag_turns_it_off():
    import dataclasses

    from test_backend import _backend, _runner

    be = _backend(_runner(), "auto")
    assert be.decode.clock.probe_paged is True
    be.ctx.cfg = dataclasses.replace(be.ctx.cfg, clock_probe="model_paths")
    from granikv.attention.decode.planner import DecodePlanner

    assert DecodePlanner(be.ctx).clock.probe_paged is False
