"""The one retry loop: attempts, a deadline, back-off with a cap and jitter (issue 25.6).

Every loop of the package that tries again (the node's address from a stalled controller,
`ray start` on a busy node, the head's dashboard, `ray up` waiting for the head's answer)
calls `retry`; clock, sleep and randomness are injectable so unit tests never sleep.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: The wait before retry number n (1 for the first) after `waited` seconds in all.
Delay = Callable[[int, float], float]


def exponential(first_s: float, *, factor: float = 2.0, cap_s: float = float("inf"),
                jitter: float = 0.0, rand: Callable[[], float] = random.random) -> Delay:
    """first_s, first_s * factor, ... at most cap_s; each then spread by +-`jitter` (a
    fraction), so many processes that failed together do not all try again together."""
    def delay(n: int, waited: float) -> float:
        d = min(first_s * factor ** min(n - 1, 64), cap_s)
        return d * (1.0 + jitter * (2.0 * rand() - 1.0)) if jitter else d

    return delay


def retry(fn: Callable[[int], T], *, delay: Delay, attempts: int | None = None,
          deadline_s: float | None = None,
          retry_on: tuple[type[BaseException], ...] = (),
          retry_if: Callable[[T], bool] = lambda _: False,
          stop: Callable[[], bool] = lambda: False,
          on_retry: Callable[[int, BaseException | None, float], None] = lambda *_: None,
          clock: Callable[[], float] | None = None,
          sleep: Callable[[float], None] | None = None) -> T:
    """Call `fn(attempt)` (1, 2, ...) until it returns a result `retry_if` does not reject,
    raises an exception not in `retry_on`, or the tries are spent: `attempts` calls, the
    deadline passed or `stop()` says so. Then the last result is returned or the last
    exception raised. Before each retry, `on_retry(attempt, exception or None, wait)`, then
    `sleep(wait)` (time.sleep, looked up then). The deadline is on `clock`; with no clock it
    counts only the waits asked for (a back-off that a signal may cut short still ends)."""
    nap = sleep if sleep is not None else time.sleep
    start = clock() if clock is not None else 0.0
    slept = 0.0
    n = 1
    while True:
        err: BaseException | None = None
        try:
            result = fn(n)
        except retry_on as e:
            err = e
        else:
            if not retry_if(result):
                return result
        waited = clock() - start if clock is not None else slept
        spent = ((attempts is not None and n >= attempts)
                 or (deadline_s is not None and waited >= deadline_s) or stop())
        if spent:
            if err is not None:
                raise err
            return result
        wait = delay(n, waited)
        on_retry(n, err, wait)
        nap(wait)
        slept += wait
        n += 1
