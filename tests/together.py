"""Real threads started at once, for every test of concurrent use (``tests/`` is on the path)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_together(work: Callable[[int], int], threads: int = 4) -> list[int]:
    """Run ``work(i)`` in ``threads`` threads started at once; return what each returned (its
    count of wrong results), re-raising the first exception a thread met."""
    barrier = threading.Barrier(threads)
    results: list[int] = [0] * threads
    errors: list[BaseException] = []

    def target(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    pool = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return results
