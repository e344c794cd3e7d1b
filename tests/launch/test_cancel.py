"""Cancel tokens and the signal relay: a signal cancels every wait, the second one forces."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import pytest
from elastic_launch import cancel
from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, Deadline, Notice, SignalRelay, clock


def test_a_token_wakes_its_waits_and_runs_its_callbacks_once():
    token = CancelToken()
    woken: list[str] = []
    unregister = token.on_cancel(lambda: woken.append("a"))
    token.on_cancel(lambda: woken.append("b"))
    unregister()
    waiter = threading.Thread(target=lambda: woken.append(str(token.wait(30))))
    waiter.start()
    time.sleep(0.05)
    token.cancel(15)
    waiter.join(5)
    assert sorted(woken) == ["True", "b"] and token.signum == 15 and not token.forced
    token.cancel(15)
    assert token.forced, "a second cancellation forces"
    assert woken.count("b") == 1
    late: list[int] = []
    token.on_cancel(lambda: late.append(1))
    assert late == [1], "registered after the fact: called at once"
    with pytest.raises(Cancelled, match="signal 15"):
        token.check()


def test_never_cannot_be_cancelled():
    with pytest.raises(RuntimeError, match="use a token"):
        NEVER.cancel()
    assert not NEVER.cancelled


def test_deadlines():
    assert Deadline(None).left() == float("inf") and not Deadline(None).passed
    assert Deadline(0).passed and Deadline(0).left() == 0.0
    soon, later = Deadline(1), Deadline(100)
    assert Deadline.earliest(None, later, soon) is soon
    assert Deadline.earliest().at is None
    assert later.left(cap=2.0) == 2.0


def test_a_signal_cancels_the_token_and_the_old_handler_comes_back():
    token = CancelToken()
    before = signal.getsignal(signal.SIGUSR1)
    with SignalRelay(token, [signal.SIGUSR1]):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert token.wait(5) and token.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not token.forced and time.monotonic() < deadline:
            time.sleep(0.01)
        assert token.forced
    assert signal.getsignal(signal.SIGUSR1) == before
    assert not any(t.name == "elasticrun-signals" for t in threading.enumerate())


def test_outside_the_main_thread_the_relay_does_nothing():
    token = CancelToken()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            with SignalRelay(token, [signal.SIGUSR1]):
                pass
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join(5)
    assert errors == []


def test_a_notice_says_what_a_wait_waits_for_after_a_while_then_now_and_again(monkeypatch):
    now = [1000.0]  # the monotonic clock, moved by the test alone
    clock_of = types.SimpleNamespace(monotonic=lambda: now[0], time=time.time, sleep=time.sleep)
    monkeypatch.setattr(cancel, "time", clock_of)  # the module's clock only
    said: list[str] = []
    state = {"left": 3}
    notice = Notice(lambda: f"waiting for {state['left']} things", said.append, 0.1, 0.2)
    notice.check()
    assert said == [], "a short wait stays quiet"
    assert notice.due().left() == pytest.approx(0.1)
    now[0] += 0.12
    state["left"] = 2
    notice.check()
    notice.check()
    assert said == ["waiting for 2 things"], "said once, with the state of the moment"
    now[0] += 0.19
    notice.check()
    assert len(said) == 1, "not again before `every`"
    now[0] += 0.02
    notice.check()
    assert len(said) == 2


def test_clock_gives_the_wall_time_of_a_deadline():
    assert clock(Deadline(None)) == "no time limit"
    assert clock(Deadline(0)) == time.strftime("%H:%M:%S")
