"""Runs a function on N ranks: spawned processes in one torch.distributed Gloo group (file rendezvous)."""
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback


def _entry(rank, world, init_dir, fn, args, results):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_dir}/rendezvous', rank=rank, world_size=world)
    try:
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, f'{type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc()}'))
    results.close()
    results.join_thread()  # the result is sent before the process ends
    os._exit(0)  # no finalizers: a peer may be gone, and its buffers must not wait for it


def run_ranks(world, fn, *args, timeout=90, allow_missing=()):
    """fn(rank, world, *args) on every rank; returns the list of results. A rank that raises fails the
    call with its traceback; ranks in allow_missing may end without a result (killed on purpose)."""
    ctx = mp.get_context('spawn')
    init_dir = tempfile.mkdtemp(prefix='moerl-ep-py-')
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, init_dir, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            (out if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(init_dir, ignore_errors=True)
    if errors:
        raise AssertionError('\n'.join(f'rank {r}: {m}' for r, m in sorted(errors.items())))
    missing = [r for r in range(world) if r not in out and r not in allow_missing]
    if missing:
        raise AssertionError(f'ranks {missing} gave no result within {timeout} s')
    return [out.get(r) for r in range(world)]
