"""moerl_ep on CUDA tensors (cuda transport, ranks sharing GPUs): normal and low-latency calls against
the same calls on the CPU (host transport). Run on a GPU machine:

    PYTHONPATH=build/python python3 tests/python/gpu_smoke.py [ranks]
"""
import sys

from harness import run_ranks

T, H, E, K = 8, 256, 8, 2


def _compare(rank, world):
    import torch
    import torch.distributed as dist
    import moerl_ep
    torch.cuda.set_device(rank % torch.cuda.device_count())
    size = moerl_ep.Buffer.get_normal_size_hint(T, H, world, K, E)
    rdma = moerl_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E, K)
    gpu = moerl_ep.Buffer(dist.group.WORLD, size, rdma, transport='cuda', timeout_s=30)
    cpu = moerl_ep.Buffer(dist.group.WORLD, size, rdma, transport='host', timeout_s=30)
    # The stream handed to the library is the current one, on a side stream too.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        probe = torch.zeros(1, device='cuda')
        assert moerl_ep.buffer._stream(probe) == side.cuda_stream, 'dispatch would run on another stream'
    torch.manual_seed(rank)
    x = torch.randn(T, H).bfloat16()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    masked = idx.clone()
    masked[::3, 0] = -1  # entries routed nowhere
    masked[1, 1] = masked[1, 0] = 3  # an expert twice in one token
    bad = idx.clone()
    bad[2, 1] = 99
    out = {}
    for name, buf, dev in (('cpu', cpu, 'cpu'), ('gpu', gpu, 'cuda')):
        xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxd, E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            xd, topk_idx=idxd, topk_weights=wd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        again = buf.dispatch(xd, handle=handle)[0]
        ll_x, ll_count, ll_handle, _, _ = buf.low_latency_dispatch(xd, idxd, T, E, use_fp8=False)
        ll_out, _, _ = buf.low_latency_combine(ll_x, idxd, wd, ll_handle)
        layout_masked = buf.get_dispatch_layout(masked.to(dev), E)
        try:
            buf.get_dispatch_layout(bad.to(dev), E)
            refused = 'accepted'
        except moerl_ep.Error as e:
            refused = 'topk_idx[2,1] = 99, but num_experts = 8' in str(e)
        out[name] = [t.cpu() for t in (per_rank, per_expert, in_rank, recv_x, recv_idx, recv_w, combined,
                                        combined_w, again, ll_count, ll_out)]
        out[name] += [layout_masked[i].cpu() for i in (0, 2, 3)] + [counts, refused]
    same = [bool(torch.equal(a, b)) if torch.is_tensor(a) else a == b for a, b in zip(out['cpu'], out['gpu'])]
    gpu.explicitly_destroy = cpu.explicitly_destroy = True
    gpu.destroy()
    cpu.destroy()
    return same


if __name__ == '__main__':
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    results = run_ranks(world, _compare, timeout=300)
    print(results)
    assert all(all(r) for r in results), 'GPU results differ from the CPU reference'
    print('gpu_smoke: CUDA results equal the host transport on', world, 'ranks')
