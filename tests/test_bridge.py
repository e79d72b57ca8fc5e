"""The hand-off of engine events into the server's event loop (server/bridge.py)."""

import asyncio
import threading

from localheap.server.bridge import JobEvents, mailbox


def _loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _stop(loop, thread):
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _on_loop(loop, make):
    """Build something on the loop's thread (asyncio.Queue binds to the loop that first uses it)."""
    return asyncio.run_coroutine_threadsafe(_call(make), loop).result(5)


async def _call(make):
    return make()


def test_a_step_of_events_wakes_the_loop_once_and_keeps_each_jobs_order():
    loop, thread = _loop_thread()
    try:
        jobs = _on_loop(loop, lambda: [JobEvents(asyncio.get_running_loop()) for _ in range(8)])
        wakes = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kwargs):
            wakes.append(cb)
            return real(cb, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        held, go = threading.Event(), threading.Event()
        real(lambda: (held.set(), go.wait(5)))   # the loop is busy while the "engine step" emits
        assert held.wait(5)
        for token in range(3):                   # three steps' tokens of eight rows
            for i, job in enumerate(jobs):
                job.emit((i, token))
        assert len(wakes) == 1                   # one wake-up for all 24 events (24 before the mailbox)
        go.set()
        loop.call_soon_threadsafe = real         # (run_coroutine_threadsafe below calls it too)

        async def read_all():
            return [[await job.get() for _ in range(3)] for job in jobs]

        got = asyncio.run_coroutine_threadsafe(read_all(), loop).result(5)
        assert got == [[(i, t) for t in range(3)] for i in range(8)]
        job = jobs[0]                            # once drained, the next event wakes the loop again
        loop.call_soon_threadsafe = counting
        job.emit("later")
        assert len(wakes) == 2
        loop.call_soon_threadsafe = real
        assert asyncio.run_coroutine_threadsafe(job.get(), loop).result(5) == "later"
    finally:
        _stop(loop, thread)


def test_events_from_several_threads_all_arrive_in_each_threads_order():
    loop, thread = _loop_thread()
    try:
        job = _on_loop(loop, lambda: JobEvents(asyncio.get_running_loop()))
        n, senders = 2000, 4

        def send(k):
            for i in range(n):
                job.emit((k, i))

        threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
        for t in threads:
            t.start()

        async def read():
            return [await job.get() for _ in range(n * senders)]

        got = asyncio.run_coroutine_threadsafe(read(), loop).result(30)
        for t in threads:
            t.join()
        for k in range(senders):
            assert [i for kk, i in got if kk == k] == list(range(n))
        assert mailbox(loop) is job._mailbox     # one mailbox per loop
    finally:
        _stop(loop, thread)


def test_a_client_that_reads_nothing_has_its_job_stopped_past_the_backlog():
    """Events a client has not taken are held for it; past max_backlog it is not reading (a stream whose
    socket stays full held a whole 64,000-token reply, 214 MB) and its job is cancelled as a client
    gone; one that reads as they come is never stopped."""
    from localheap.engine import Job

    loop, thread = _loop_thread()
    try:
        slow, reader = _on_loop(loop, lambda: [JobEvents(asyncio.get_running_loop(), max_backlog=5) for _ in range(2)])
        slow.job, reader.job = Job(request=None), Job(request=None)
        for i in range(8):   # not followed yet (a request's other choices still wait their turn): held, never stopped
            slow.emit(i)
        assert not slow.job.cancelled
        for i in range(8):
            asyncio.run_coroutine_threadsafe(slow.get(), loop).result(5)
        slow.following = reader.following = True   # (follow() sets it)
        for i in range(5):
            slow.emit(i)
        assert not slow.job.cancelled
        slow.emit(5)
        assert slow.job.cancelled and slow.job.cancel_reason == "client"
        for i in range(20):
            reader.emit(i)
            assert asyncio.run_coroutine_threadsafe(reader.get(), loop).result(5) == i
        assert not reader.job.cancelled
    finally:
        _stop(loop, thread)
