"""The replays of a sweep in worker processes: each worker gets the trace once over its own pipe,
then one replay at a time; the parent hands a worker its next replay as each result comes back.

Failure is loud and leaves nothing running:

- a replay's exception is raised in the parent, and the other workers are ended;
- a worker that dies (killed, out of memory) fails the sweep with its exit code;
- Ctrl-C or SIGTERM of the parent ends every worker. Workers start with SIGINT ignored: a
  terminal's Ctrl-C reaches the whole process group, and it is the parent's to handle. The parent
  ignores SIGINT while it starts them, so they inherit that (a spawned interpreter keeps ignored
  signals ignored), and a Ctrl-C in that moment is lost: press it again. (Blocking it instead
  does not hold it for the parent: another thread, such as a BLAS thread of numpy, takes a
  process-wide signal it does not block, and discards it while it is ignored.)

Workers are spawned (fresh interpreters), so they inherit no lock or thread of the parent. As with
any spawned process, a script that calls this at import time needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.replay import ReplayResult
    from kvstore.trace import TraceRequest

Run = tuple[int, str, bool]  # capacity in tokens, policy name, whether to compute the optimum too


class ReplayWorkerDied(KVStoreError, RuntimeError):
    """A worker process ended in the middle of a replay (killed, out of memory)."""


def replay_in_processes(requests: Sequence[TraceRequest], runs: Sequence[Run], jobs: int, options: dict,
                        progress: Callable[[int], None] | None = None) -> list[ReplayResult]:
    """``replay(requests, capacity, policy, with_optimal=..., **options)`` for every run, by
    ``jobs`` worker processes; results in the order of ``runs``. ``progress`` moves by
    ``len(requests)`` as each replay ends."""
    results: list[ReplayResult | None] = [None] * len(runs)
    unstarted = list(enumerate(runs))[::-1]  # popped from the end: first runs first
    workers: dict[Connection, multiprocessing.process.BaseProcess] = {}
    try:
        with _signal_ignored(signal.SIGINT):  # inherited ignored by the workers from their start
            _start(min(jobs, len(runs)), workers)
        with _signal_raises_exit(signal.SIGTERM):
            doing: dict[Connection, tuple[int, Run]] = {}
            for conn, process in workers.items():
                _send(conn, process, (list(requests), options))
                _hand_out(conn, process, unstarted, doing)
            while doing:
                sentinels = {workers[conn].sentinel: conn for conn in doing}
                for ready in wait([*doing, *sentinels]):
                    conn = sentinels.get(ready, ready)
                    if conn not in doing:
                        continue  # its result and its exit were both ready; the result was taken
                    number, run = doing.pop(conn)
                    results[number] = _result_of(conn, workers[conn], run)
                    if progress:
                        progress(len(requests))
                    _hand_out(conn, workers[conn], unstarted, doing)
    finally:
        _end(workers)
    return results


def _start(count: int, workers: dict[Connection, multiprocessing.process.BaseProcess]) -> None:
    """``count`` workers into ``workers`` one by one, so those started are ended if a later one fails."""
    context = multiprocessing.get_context("spawn")
    for _ in range(count):
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_work, args=(child_end,), daemon=True, name="kvstore-replay")
        process.start()
        child_end.close()
        workers[parent_end] = process


def _hand_out(conn: Connection, process: multiprocessing.process.BaseProcess, unstarted: list[tuple[int, Run]],
              doing: dict[Connection, tuple[int, Run]]) -> None:
    """The next run to a worker that is free, or its stop signal (None) when none is left."""
    if not unstarted:
        _send(conn, process, None)
        return
    number, run = unstarted.pop()
    _send(conn, process, run)
    doing[conn] = (number, run)


def _send(conn: Connection, process: multiprocessing.process.BaseProcess, message: object) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError):
        process.join(1.0)
        raise ReplayWorkerDied(f"a replay worker died (exit code {process.exitcode}) between replays; "
                               "out of memory? Give fewer --jobs") from None


def _result_of(conn: Connection, process: multiprocessing.process.BaseProcess, run: Run) -> ReplayResult:
    """The worker's answer to ``run``: its result, or its replay's exception raised here."""
    try:
        result, error = conn.recv()
    except EOFError:
        process.join(1.0)
        capacity, policy, _ = run
        raise ReplayWorkerDied(f"a replay worker died (exit code {process.exitcode}) replaying {policy} at "
                               f"{capacity} tokens; out of memory? Give fewer --jobs") from None
    if error is not None:
        raise error
    return result


def _end(workers: dict[Connection, multiprocessing.process.BaseProcess]) -> None:
    for process in workers.values():
        if process.is_alive():
            process.terminate()
    for conn, process in workers.items():
        process.join()
        conn.close()


@contextlib.contextmanager
def _signal_ignored(signum: int) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; then the workers take the default
        return
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, previous)


@contextlib.contextmanager
def _signal_raises_exit(signum: int) -> Iterator[None]:
    """``signum`` ends this process through ``SystemExit`` (so ``finally`` blocks run), not abruptly."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(received: int, frame: object) -> None:
        raise SystemExit(128 + received)

    previous = signal.signal(signum, leave)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _work(conn: Connection) -> None:
    """A worker: the trace and the replay options, then runs until None; each answered with
    (result, None) or (None, exception)."""
    from kvstore.replay import replay

    try:
        requests, options = conn.recv()
        while (run := conn.recv()) is not None:
            capacity, policy, with_optimal = run
            try:
                conn.send((replay(requests, capacity, policy, with_optimal=with_optimal, **options), None))
            except (EOFError, BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # raised again in the parent, as itself if it pickles
                try:
                    conn.send((None, exc))
                except Exception:
                    conn.send((None, RuntimeError(f"{type(exc).__name__}: {exc}")))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone: there is no one to answer
