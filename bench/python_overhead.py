#!/usr/bin/env python3
"""Per-call overhead of moerl_ep (the Python binding) over calling the EP library's C++ API directly.

Both sides run the same engine (one moerl::ep::Buffer) in the same processes: the C++ side is a loop
of Buffer::dispatch + Buffer::combine with outputs allocated once (moerl_ep._C.Engine.time_native);
the Python side is moerl_ep.Buffer.dispatch / .combine as DeepEP callers use them (handle objects,
fresh output tensors, events). Between them, moerl_ep._C.Engine called from Python (the extension
alone: argument conversion and fresh output tensors, none of buffer.py). On CUDA every call on every
side is followed by a device synchronisation (torch.cuda.synchronize() in Python, the same
cudaDeviceSynchronize in the C++ loop). Each side's timing harness is measured alone and taken off
its figures: the Python loop around an empty call (perf_counter, the lambda, torch.cuda.synchronize
on an idle device) and the C++ loop's synchronisation alone, so the difference is the binding's.
The sides take turns call by call, and the overhead is the median of each round's difference, so a
drift of the machine between loops does not show as overhead. Prints medians in microseconds per call, the harnesses' costs below the table.

    PYTHONPATH=build/python python3 bench/python_overhead.py [--ranks 1 2] [--tokens 8] [--hidden 256]
"""
import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time


def _rank(rank, world, args, results):
    import torch
    import torch.distributed as dist
    import moerl_ep
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{args.init_dir}/{world}', rank=rank, world_size=world)
    device = 'cuda' if args.device == 'cuda' else 'cpu'
    if device == 'cuda':
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dtype = {'bf16': torch.bfloat16, 'fp32': torch.float32}[args.dtype]
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    size = moerl_ep.Buffer.get_normal_size_hint(T, H, world, K, E, args.dtype)
    buffer = moerl_ep.Buffer(dist.group.WORLD, num_nvl_bytes=size, transport=args.transport, timeout_s=60)
    torch.manual_seed(rank)
    x = torch.randn(T, H, device=device).to(dtype)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, device=device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    kwargs = dict(topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **kwargs)  # makes the engine
    engine = next(iter(buffer._engines.values()))

    def sync():
        if device == 'cuda':
            torch.cuda.synchronize()

    def once(fn):
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1e6

    stream = moerl_ep.buffer._stream(x)
    native_handle = handle.native()
    calls = {
        'floor': lambda: None,
        'ext dispatch': lambda: engine.dispatch(x, idx, w, None, True, stream),
        'dispatch': lambda: buffer.dispatch(x, **kwargs),
        'ext combine': lambda: engine.combine(recv_x, native_handle, stream),
        'combine': lambda: buffer.combine(recv_x, handle),
        'dispatch (cached handle)': lambda: buffer.dispatch(x, handle=handle),
        'get_dispatch_layout': lambda: buffer.get_dispatch_layout(idx, E),
    }
    # Every sample of every side is taken in the same round, one after the other, so a drift of the
    # machine (clocks, other tenants) moves all of them alike; the overhead is the median of each
    # round's difference. The first pass warms up; the second counts.
    for _ in range(2):
        got = {k: [] for k in list(calls) + ['native dispatch', 'native combine', 'native floor']}
        for _ in range(args.iters):
            nd, nc, nf = engine.time_native(x, idx, w, 1)
            got['native dispatch'].append(nd)
            got['native combine'].append(nc)
            got['native floor'].append(nf)
            for name, fn in calls.items():
                got[name].append(once(fn))
    med = statistics.median
    floor, native_floor = med(got['floor']), med(got['native floor'])

    def side(name, floors):  # one side's own harness taken off, round by round
        return [a - b for a, b in zip(got[name], floors)]
    rows = {}
    for call in ('dispatch', 'combine'):
        native = side('native ' + call, got['native floor'])
        ext = side('ext ' + call, got['floor'])
        module = side(call, got['floor'])
        rows[call] = (med(native), med(ext), med(module), med([m - n for m, n in zip(module, native)]))
    for call in ('dispatch (cached handle)', 'get_dispatch_layout'):
        rows[call] = (None, None, med(side(call, got['floor'])), None)
    results.put((rank, rows, engine.transport_name, (floor, native_floor)))
    dist.barrier()
    buffer._release()
    results.close()
    results.join_thread()
    os._exit(0)


def _cell(v):
    return f'{v:.1f}' if v is not None else '-'


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--ranks', type=int, nargs='+', default=[1, 2])
    p.add_argument('--tokens', type=int, default=8)
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--experts', type=int, default=8)
    p.add_argument('--topk', type=int, default=2)
    p.add_argument('--dtype', choices=['bf16', 'fp32'], default='bf16')
    p.add_argument('--iters', type=int, default=2000)
    p.add_argument('--device', choices=['cpu', 'cuda'], default='cpu')
    p.add_argument('--transport', default=None, help='host, fabric/tcp, cuda, nccl (default: host on cpu)')
    args = p.parse_args()
    if args.transport is None:
        args.transport = 'cuda' if args.device == 'cuda' else 'host'
    args.init_dir = tempfile.mkdtemp(prefix='moerl-ep-bench-')
    print(f'moerl_ep overhead: {args.tokens} tokens x hidden {args.hidden} ({args.dtype}), {args.experts} '
          f'experts, top-{args.topk}, {args.device}, median of {args.iters} calls per rank, microseconds')
    print()
    print('| ranks | transport | call | C++ API | moerl_ep._C | moerl_ep.Buffer | overhead (median of rounds) |')
    print('|---|---|---|---|---|---|---|')
    ctx = mp.get_context('spawn')
    floors = []
    for world in args.ranks:
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, args, results)) for r in range(world)]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=600) for _ in range(world)]
        for proc in procs:
            proc.join()
        _, rows, transport, floor = min(got, key=lambda g: g[0])  # rank 0's figures
        for call, (native, extension, module, over) in rows.items():
            print(f'| {world} | {transport} | {call} | {_cell(native)} | {_cell(extension)} | {module:.1f} | '
                  f'{_cell(over)} |')
        floors.append(f'{world} ranks: Python {floor[0]:.1f}, C++ {floor[1]:.1f}')
    print()
    print('taken off (each timing loop around no call): ' + '; '.join(floors) + ' microseconds')


if __name__ == '__main__':
    main()
