"""The hot path's own cancellation (``service/proxy/task_cancel.py``): a task cancelled by
its watcher or deadline tells that cancellation from anyone else's."""

from __future__ import annotations

import asyncio
import sys

import pytest

from contextpilot_integrations.service.proxy.task_cancel import TaskCancel, raise_failure


async def _wait_cut_short(extra_cancel: bool) -> str:
    """Sleeps until its own deadline (and, with ``extra_cancel``, an outside cancel at the
    same time) cuts it short; says how it ended."""
    cancel = TaskCancel()
    task = asyncio.current_task()
    assert task is not None

    def both() -> None:
        cancel.cancel()
        if extra_cancel:
            task.cancel()

    timer = asyncio.get_running_loop().call_later(0.01, both)
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        if not cancel.caught():
            raise
        return "own"
    finally:
        timer.cancel()
    return "slept"


def test_its_own_cancel_is_caught_and_the_task_goes_on() -> None:
    async def main() -> tuple[str, str]:
        first = await _wait_cut_short(extra_cancel=False)
        # The task is not left cancelled: it can wait again.
        await asyncio.sleep(0)
        return first, await _wait_cut_short(extra_cancel=False)

    assert asyncio.run(main()) == ("own", "own")


def test_a_cancel_from_elsewhere_is_not_caught() -> None:
    async def main() -> None:
        cancel = TaskCancel()
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.01, task.cancel)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert not cancel.caught()
            raise

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 counts no cancellations")
def test_an_outside_cancel_with_its_own_is_not_swallowed() -> None:
    async def main() -> str:
        return await _wait_cut_short(extra_cancel=True)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_a_failed_watcher_is_raised_and_a_quiet_one_is_not() -> None:
    async def main() -> None:
        async def fails() -> None:
            raise OSError("receive broke")

        async def waits() -> None:
            await asyncio.sleep(10)

        failed = asyncio.get_running_loop().create_task(fails())
        waiting = asyncio.get_running_loop().create_task(waits())
        await asyncio.sleep(0.01)
        raise_failure(waiting)  # still running: nothing
        waiting.cancel()
        with pytest.raises(OSError, match="receive broke"):
            raise_failure(failed)

    asyncio.run(main())
