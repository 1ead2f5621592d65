"""DeepEP's test call sequence (tests/test_intranode.py and tests/test_low_latency.py of DeepEP v1.2.1)
run against moerl_ep on the CPU: the same calls, arguments and return tuples, with the checks those
scripts make, rewritten for 2 Gloo processes and small sizes (no CUDA, no fp8 tensors in torch 1.13)."""
import unittest

from harness import run_ranks

T, H, E, K = 16, 256, 8, 3


def _calc_diff(x, y):
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _e4m3_to_float(bits):
    import torch
    b = bits.view(torch.uint8).to(torch.int32)
    sign = torch.where(b >= 128, -1.0, 1.0)
    exp, mant = (b >> 3) & 15, (b & 7).float()
    normal = (1 + mant / 8) * torch.pow(2.0, (exp - 7).float())
    return sign * torch.where(exp == 0, mant / 8 * 2.0 ** -6, normal)


def _cast_back(data, scales):
    # per_token_cast_back of DeepEP's utils.
    import torch
    values = _e4m3_to_float(data).view(data.size(0), -1, 128) * scales.unsqueeze(-1)
    return values.view(data.shape).to(torch.bfloat16)


def _intranode(rank, world):
    import torch
    import torch.distributed as dist
    import moerl_ep

    torch.manual_seed(rank)
    group = dist.group.WORLD
    buffer = moerl_ep.Buffer(group, int(1 << 24), 0, low_latency_mode=False, num_qps_per_rank=1,
                             explicitly_destroy=True, timeout_s=20)
    x = torch.ones((T, H), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((T, H), dtype=torch.bfloat16)
    # per_token_cast_to_fp8(x) of DeepEP's utils, for x = rank everywhere: e4m3 448 (0x7e) times amax / 448.
    fp8 = getattr(torch, 'float8_e4m3fn', torch.uint8)
    x_e4m3 = (torch.full((T, H), 0x7e if rank else 0, dtype=torch.uint8).view(fp8),
              torch.full((T, H // 128), max(rank, 1e-4) / 448.0))
    scores = torch.randn((T, E)).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=False)[1]
    topk_weights = torch.ones((T, K)) * rank
    topk_weights_pure_rand = torch.randn((T, K))
    rank_idx = topk_idx // (E // world)
    is_token_in_rank = torch.zeros((T, world), dtype=torch.bool)
    is_token_in_rank.scatter_(1, rank_idx, True)
    num_tokens_per_rank = is_token_in_rank.sum(0).int()
    num_tokens_per_expert = torch.bincount(topk_idx.flatten(), minlength=E).int()
    gbl_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_per_expert, group=group)
    gbl_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_per_rank, group=group)

    ref_per_rank, rdma, ref_per_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    assert rdma is None
    assert torch.equal(ref_per_rank, num_tokens_per_rank)
    assert torch.equal(ref_per_expert, num_tokens_per_expert)
    assert torch.equal(ref_in_rank, is_token_in_rank)
    config = moerl_ep.Config(24, 8, 256)

    def check_data(check_x, rank_prefix_matrix):
        assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
        start = 0
        for i in range(world):
            end = int(rank_prefix_matrix[i][rank])
            assert (check_x[start:end, :].int() - i).sum().item() == 0
            start = end

    passed = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    args = {'x': current_x, 'num_tokens_per_rank': num_tokens_per_rank,
                            'is_token_in_rank': is_token_in_rank, 'num_tokens_per_expert': num_tokens_per_expert,
                            'config': config, 'async_finish': async_mode}
                    if with_topk:
                        args.update({'topk_idx': topk_idx, 'topk_weights':
                                     topk_weights_pure_rand if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        args.update({'previous_event': buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(**args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = _cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                    rank_prefix_matrix = handle[0]
                    assert gbl_per_rank[rank].item() == recv_x.size(0)
                    assert gbl_per_expert.view(world, -1)[rank].tolist() == counts
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix)
                    recv_w_clone = None
                    if with_topk:
                        local = E // world
                        assert ((recv_topk_idx == -1) | ((recv_topk_idx >= 0) & (recv_topk_idx < local))).all()
                        for i, count in enumerate(counts):
                            assert recv_topk_idx.eq(i).sum().item() == count
                        recv_w_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            mask = recv_topk_idx.eq(-1)
                            recv_topk_weights[mask] = recv_topk_weights.amax(1, keepdim=True).expand_as(
                                recv_topk_weights)[mask]
                            check_data(recv_topk_weights, rank_prefix_matrix)
                        worst = T * world
                        args.update({'num_worst_tokens': worst})
                        wx, widx, ww, empty, _, event = buffer.dispatch(**args)
                        wx = _cast_back(*wx) if isinstance(wx, tuple) else wx
                        assert len(empty) == 0 and wx.size(0) == worst and widx.size(0) == worst
                        assert torch.equal(recv_x, wx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, widx[:recv_x.size(0)])
                        assert torch.equal(recv_w_clone, ww[:recv_x.size(0)])
                        assert bool((widx[recv_x.size(0):] == -1).all())
                    if not with_topk:
                        cached = {'x': current_x, 'handle': handle, 'config': config, 'async_finish': async_mode}
                        if previous_mode:
                            cached.update({'previous_event': buffer.capture()})
                        recv_x, _, _, _, _, event = buffer.dispatch(**cached)
                        event.current_stream_wait() if async_mode else ()
                        recv_x = _cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                        if current_x is not x_pure_rand:
                            check_data(recv_x, rank_prefix_matrix)
                    combine = {'x': recv_x, 'handle': handle, 'config': config, 'async_finish': async_mode}
                    if with_topk:
                        combine.update({'topk_weights': recv_topk_weights})
                    if previous_mode:
                        combine.update({'previous_event': buffer.capture()})
                    combined_x, combined_w, event = buffer.combine(**combine)
                    event.current_stream_wait() if async_mode else ()
                    check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    assert _calc_diff(check_x, ref_x) < 5e-6
                    if with_topk:
                        check_w = combined_w if current_x is x_pure_rand else (
                            combined_w / is_token_in_rank.sum(dim=1).unsqueeze(1))
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        assert _calc_diff(check_w, ref_w) < 1e-9
                    passed += 1
    # The tuning loop: the last handle re-dispatched with DeepEP's default configs.
    moerl_ep.Buffer.set_num_sms(24)
    for cfg in (moerl_ep.Buffer.get_dispatch_config(world), moerl_ep.Buffer.get_combine_config(world)):
        recv_x, *_ = buffer.dispatch(x=x, handle=handle, config=cfg)
        buffer.combine(x=recv_x, handle=handle, config=cfg)
    buffer.destroy()
    return passed


def _low_latency(rank, world):
    import random
    import torch
    import torch.distributed as dist
    import moerl_ep

    torch.manual_seed(rank)
    random.seed(rank)
    group = dist.group.WORLD
    local = E // world
    rdma = moerl_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buffer = moerl_ep.Buffer(group, num_rdma_bytes=rdma, low_latency_mode=True, num_qps_per_rank=local,
                             explicitly_destroy=True, timeout_s=20)
    offset = 128
    x = torch.ones((T, H), dtype=torch.bfloat16) * (rank - offset)
    x[:, -128:] = torch.arange(T).to(torch.bfloat16).view(-1, 1)
    scores = torch.randn((T, E)).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, sorted=True)[1]
    topk_weights = torch.randn((T, K)).abs()
    for _ in range(3):
        topk_idx[random.randint(0, T - 1), random.randint(0, K - 1)] = -1
    all_topk_idx = [torch.empty_like(topk_idx) for _ in range(world)]
    dist.all_gather(all_topk_idx, topk_idx, group=group)
    all_topk_idx = torch.stack(all_topk_idx)

    passed = 0
    for return_recv_hook in (False, True):
        for use_fp8 in (False, True):
            stats = torch.zeros((local,), dtype=torch.int)
            packed_x, packed_count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, T, E, use_fp8=use_fp8, cumulative_local_expert_recv_stats=stats,
                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            if use_fp8:
                data, scales = packed_x
                gemm_x = (_e4m3_to_float(data).view(local, -1, H // 128, 128) * scales.unsqueeze(-1)).view(
                    data.shape).to(torch.bfloat16)
            else:
                gemm_x = packed_x.clone()
            for i in range(local):
                expert_id = rank * local + i
                recv_x, count = gemm_x[i], int(packed_count[i])
                src_info, layout_range = handle[0][i], handle[1][i]
                assert int(stats[i]) == count
                assert count == int((layout_range & 0xffffffff).sum())
                assert count == int((all_topk_idx == expert_id).sum())
                if count == 0:
                    continue
                recv_x = recv_x[:count]
                amin = recv_x[:, :-128].amin(dim=-1)
                assert torch.equal(amin, recv_x[:, :-128].amax(dim=-1))
                assert (recv_x[:, -128:] - src_info[:count].view(-1, 1) % T).sum().item() == 0
                for j in range(world):
                    begin, n = int(layout_range[j] >> 32), int(layout_range[j] & 0xffffffff)
                    assert (amin == j - offset).sum().item() == (all_topk_idx[j] == expert_id).sum().item()
                    assert (recv_x[begin:begin + n, :-128] - j + offset).sum().item() == 0
            for zero_copy in (False, True):
                if zero_copy:
                    buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = gemm_x
                out = torch.empty((T, H), dtype=torch.bfloat16)
                combined_x, event, hook = buffer.low_latency_combine(
                    gemm_x, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                    zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                hook() if return_recv_hook else event.current_stream_wait()
                assert combined_x is out
                diff = _calc_diff(x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1), combined_x)
                assert not torch.isnan(combined_x).any()
                assert diff < (9e-4 if use_fp8 else 1e-5), f'{diff=} {use_fp8=} {zero_copy=}'
                passed += 1
    buffer.destroy()
    return passed


class DeepEPCallsTest(unittest.TestCase):
    def test_intranode_sequence(self):
        self.assertEqual(run_ranks(2, _intranode, timeout=120), [24, 24])

    def test_low_latency_sequence(self):
        self.assertEqual(run_ranks(2, _low_latency, timeout=120), [8, 8])


if __name__ == '__main__':
    unittest.main()
