"""A peer that dies mid-run: the survivor's next call raises moerl_ep.TimeoutError naming phase and peer
(at once on the host transport, which sees that the peer's process has exited)."""
import unittest

from harness import run_ranks

T, H, E, K = 4, 16, 4, 1


def _survive_dead_peer(rank, world):
    import os
    import signal
    import time
    import torch
    import torch.distributed as dist
    import moerl_ep

    buffer = moerl_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 16, timeout_s=5)
    x = torch.randn(T, H)
    idx = torch.arange(T).remainder(E).view(T, K)
    layout = buffer.get_dispatch_layout(idx, E)
    args = dict(topk_idx=idx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2])
    buffer.dispatch(x, **args)  # both alive: fine
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        buffer.dispatch(x, **args)
    except moerl_ep.TimeoutError as e:
        return str(e), isinstance(e, TimeoutError), time.monotonic() - start
    return None, False, 0.0


class DeadPeerTest(unittest.TestCase):
    def test_timeout_names_phase_and_peer(self):
        message, builtin, waited = run_ranks(2, _survive_dead_peer, timeout=60, allow_missing=(1,))[0]
        self.assertIsNotNone(message, 'dispatch returned although its peer was dead')
        self.assertIn('in dispatch/notify waiting for rank 1', message)
        self.assertIn('has exited', message)
        self.assertTrue(builtin, 'moerl_ep.TimeoutError is not a TimeoutError')
        self.assertLess(waited, 30)


if __name__ == '__main__':
    unittest.main()
