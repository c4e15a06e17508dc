"""Worker process pools that fail loudly and stop at once (the data producer's tokenizers, the cache writer's encoders).

`concurrent.futures.ProcessPoolExecutor`, not `multiprocessing.Pool`: a worker killed from outside (the OOM killer)
breaks the pool, so every pending result raises `BrokenProcessPool` instead of waiting forever, as a Pool's lost task
would. Spawned, never forked: the parent may hold threads. Torch-free.
"""

from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Callable

__all__ = ["BrokenProcessPool", "spawn_pool", "stop_pool"]  # the error the pools' users catch, with both


def spawn_pool(workers: int, initializer: Callable, initargs: tuple = ()) -> ProcessPoolExecutor:
    """A pool of `workers` spawned processes, each started by `initializer(*initargs)`."""
    return ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=initializer, initargs=initargs)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop the workers now: pending work is dropped, running work is terminated (killed after 10 s)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # the pool's own (3.14: terminate_workers)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
