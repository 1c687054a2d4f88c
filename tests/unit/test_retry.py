"""retry.retry and retry.exponential (issue 25.6), on an injected clock: nothing sleeps."""

from __future__ import annotations

import pytest

from ray_slurm_provider.retry import exponential, retry
from tests.fakes import FakeClock


class Flaky:
    """Fails `failures` times with `err`, then answers `value`."""

    def __init__(self, failures: int, err: BaseException | None = None,
                 value: object = "ok") -> None:
        self.failures, self.err, self.value, self.calls = failures, err, value, []

    def __call__(self, n: int) -> object:
        self.calls.append(n)
        if len(self.calls) <= self.failures:
            if self.err is not None:
                raise self.err
            return None
        return self.value


def test_exponential_doubles_up_to_its_cap_and_spreads_by_its_jitter() -> None:
    d = exponential(2.0, cap_s=30.0)
    assert [d(n, 0.0) for n in range(1, 7)] == [2, 4, 8, 16, 30, 30]
    assert exponential(1.0, factor=1.0)(50, 0.0) == 1.0
    low, high = exponential(10.0, jitter=0.2, rand=lambda: 0.0), exponential(
        10.0, jitter=0.2, rand=lambda: 1.0)
    assert low(1, 0.0) == pytest.approx(8.0) and high(1, 0.0) == pytest.approx(12.0)
    assert exponential(1.0, cap_s=5.0)(10_000, 0.0) == 5.0  # no overflow


def test_retry_on_listed_exceptions_until_it_answers() -> None:
    naps: list[float] = []
    fn = Flaky(3, TimeoutError("slow"))
    got = retry(fn, retry_on=(TimeoutError,), delay=exponential(2.0), sleep=naps.append)
    assert got == "ok" and fn.calls == [1, 2, 3, 4] and naps == [2, 4, 8]


def test_other_exceptions_are_not_retried() -> None:
    naps: list[float] = []
    fn = Flaky(1, KeyError("x"))
    with pytest.raises(KeyError):
        retry(fn, retry_on=(TimeoutError,), delay=exponential(1.0), sleep=naps.append)
    assert fn.calls == [1] and naps == []


def test_attempts_bound_the_calls_and_the_last_error_is_raised() -> None:
    naps: list[float] = []
    fn = Flaky(9, TimeoutError("slow"))
    with pytest.raises(TimeoutError):
        retry(fn, attempts=3, retry_on=(TimeoutError,), delay=exponential(1.0),
              sleep=naps.append)
    assert fn.calls == [1, 2, 3] and naps == [1, 2]


def test_a_rejected_result_is_retried_and_the_last_one_returned() -> None:
    fn = Flaky(9)
    assert retry(fn, attempts=2, retry_if=lambda r: r is None, delay=exponential(1.0),
                 sleep=lambda s: None) is None
    assert fn.calls == [1, 2]


def test_the_deadline_is_on_the_injected_clock() -> None:
    clock = FakeClock(0.0)
    retries: list[tuple[int, float]] = []
    fn = Flaky(99, OSError("down"))
    with pytest.raises(OSError):
        retry(fn, retry_on=(OSError,), delay=lambda n, waited: 10.0, deadline_s=35.0,
              clock=clock.now, sleep=clock.advance,
              on_retry=lambda n, e, wait: retries.append((n, wait)))
    assert fn.calls == [1, 2, 3, 4, 5] and clock.now() == 40.0  # gave up once 40 >= 35
    assert retries == [(1, 10.0), (2, 10.0), (3, 10.0), (4, 10.0)]


def test_without_a_clock_the_deadline_counts_the_waits_asked_for() -> None:
    """A back-off a signal cuts short (Agent.pause) still ends."""
    fn = Flaky(99, OSError("down"))
    with pytest.raises(OSError):
        retry(fn, retry_on=(OSError,), delay=exponential(2.0, cap_s=30.0), deadline_s=60.0,
              sleep=lambda s: None)
    assert fn.calls == [1, 2, 3, 4, 5, 6]  # waits 2+4+8+16+30 = 60


def test_the_delay_hears_the_time_waited() -> None:
    clock = FakeClock(0.0)
    asked: list[float] = []

    def delay(n: int, waited: float) -> float:
        asked.append(waited)
        return 0.5

    retry(Flaky(3), retry_if=lambda r: r is None, delay=delay, clock=clock.now,
          sleep=clock.advance)
    assert asked == [0.0, 0.5, 1.0]


def test_stop_ends_the_retries_at_once() -> None:
    fn = Flaky(99, OSError("down"))
    with pytest.raises(OSError):
        retry(fn, retry_on=(OSError,), delay=exponential(1.0), stop=lambda: len(fn.calls) >= 2,
              sleep=lambda s: None)
    assert fn.calls == [1, 2]


def test_the_heads_port_wait_retries_until_the_port_is_free_or_time_is_up() -> None:
    """agent/head.py's wait_port_free on a real socket this test holds, then closes."""
    import socket

    from ray_slurm_provider.agent.head import wait_port_free

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use"):
            wait_port_free("127.0.0.1", port, 0.2)
    wait_port_free("127.0.0.1", port, 0.2)
