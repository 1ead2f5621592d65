"""Bad input raises moerl_ep.Error carrying the EP library's message, and the buffer stays usable."""
import unittest

from harness import run_ranks

T, H, E, K = 4, 16, 8, 2


def _messages(rank, world):
    import torch
    import torch.distributed as dist
    import moerl_ep

    buffer = moerl_ep.Buffer(dist.group.WORLD, num_nvl_bytes=moerl_ep.Buffer.get_normal_size_hint(
        T, H, world, K, E, 'fp32'), timeout_s=20)
    x = torch.randn(T, H)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    layout = buffer.get_dispatch_layout(idx, E)

    def dispatch(x, idx):
        return buffer.dispatch(x, topk_idx=idx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                               num_tokens_per_expert=layout[2])

    def message(fn):
        try:
            fn()
        except moerl_ep.Error as e:
            return str(e)
        return None

    bad_idx = idx.clone()
    bad_idx[2, 1] = 99
    out = {
        'fp16': message(lambda: dispatch(x.half(), idx)),
        'int32_ids': message(lambda: dispatch(x, idx.int())),
        'expert_range': message(lambda: dispatch(x, bad_idx)),
        'layout_range': message(lambda: buffer.get_dispatch_layout(bad_idx, E)),
        'too_many': message(lambda: dispatch(torch.randn(T + 1, H), torch.zeros(T + 1, K, dtype=torch.long))),
        'low_latency_bytes': message(lambda: buffer.low_latency_dispatch(x.bfloat16(), idx, T, E, use_fp8=False)),
    }
    recv_x, recv_idx, _, counts, handle, _ = dispatch(x, idx)  # still in step after the errors
    out['rows_after'] = recv_x.size(0)
    # A strided x takes buffer.py's general path (the common call goes through the extension in one
    # step); both give the same rows, ids, counts and combine.
    strided = torch.empty(H, T).t()
    strided.copy_(x)
    g_recv_x, g_recv_idx, _, g_counts, g_handle, _ = dispatch(strided, idx)
    # Outputs still held keep their values when the next call writes its own; once dropped, their
    # memory serves the next call.
    first = dispatch(x, idx)[0]
    saved = first.clone()
    second = dispatch(x * 2, idx)[0]
    out['held_intact'] = torch.equal(first, saved) and torch.equal(second, saved * 2)
    del first, second
    out['reused_equal'] = torch.equal(dispatch(x, idx)[0], saved)
    out['paths_equal'] = (torch.equal(recv_x, g_recv_x) and torch.equal(recv_idx, g_recv_idx) and
                          counts == g_counts and
                          torch.equal(buffer.combine(recv_x, handle)[0],
                                      buffer.combine(g_recv_x.t().contiguous().t(), g_handle)[0]))
    return out


class ErrorsTest(unittest.TestCase):
    def test_library_messages(self):
        for rank, m in enumerate(run_ranks(2, _messages, timeout=90)):
            self.assertIn("unknown dtype 'float16', expected one of fp32, bf16, fp8", m['fp16'])
            self.assertIn('dispatch: topk_idx is Int, expected Long', m['int32_ids'])
            self.assertIn('topk_idx[2,1] = 99, but num_experts = 8 (valid: -1..7)', m['expert_range'])
            self.assertIn('topk_idx[2,1] = 99, but num_experts = 8', m['layout_range'])
            self.assertIn('dispatch: x has 5 rows, but at most 4 are allowed (Config.max_tokens_per_rank)',
                          m['too_many'])
            self.assertIn('Buffer.get_normal_size_hint sizes it', m['too_many'])  # the buffer's sizing
            self.assertIn('num_rdma_bytes = 0', m['low_latency_bytes'])
            self.assertIn('src/ep/', m['expert_range'])  # the library's file:line
            self.assertEqual(m['rows_after'], 4, f'rank {rank}')  # experts 0-3 / 4-7: 2 tokens each way
            self.assertTrue(m['paths_equal'], f'rank {rank}')
            self.assertTrue(m['held_intact'], f'rank {rank}')
            self.assertTrue(m['reused_equal'], f'rank {rank}')


if __name__ == '__main__':
    unittest.main()
