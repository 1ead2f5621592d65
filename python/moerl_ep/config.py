"""DeepEP's performance Config (csrc/config.hpp, v1.2.1), accepted for compatibility.

moerl sizes its buffers from the shapes and num_nvl_bytes / num_rdma_bytes, and its kernels take their
SM count from Buffer(num_sms=...), so a Config passed to dispatch/combine is checked and otherwise has
no effect.
"""


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        if num_sms < 0:
            raise ValueError(f'Config: num_sms = {num_sms}, expected >= 0')
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError('Config: expected 0 < num_max_nvl_chunked_send_tokens '
                             f'({num_max_nvl_chunked_send_tokens}) < num_max_nvl_chunked_recv_tokens '
                             f'({num_max_nvl_chunked_recv_tokens})')
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ValueError('Config: the RDMA chunk sizes must be > 0')
        send = num_max_rdma_chunked_send_tokens
        recv = -(-num_max_rdma_chunked_recv_tokens // send) * send  # aligned up, as DeepEP does
        if not send <= recv // 2:
            raise ValueError(f'Config: num_max_rdma_chunked_send_tokens ({send}) must be at most half of '
                             f'num_max_rdma_chunked_recv_tokens ({recv})')
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = send
        self.num_max_rdma_chunked_recv_tokens = recv

    # DeepEP's hints size its own chunked buffers; moerl's normal mode needs
    # Buffer.get_normal_size_hint(...) bytes. These return DeepEP's figures so that callers sizing a
    # buffer with them get at least what they asked DeepEP for.
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels, ranks = self.num_sms // 2, min(num_ranks, 8)
        rdma_ranks = max(num_ranks // 8, 1)
        n = channels * ranks * (2 * rdma_ranks + 3) * 4
        n += channels * ranks * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 128 * (8 + 4 + 4))
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # moerl has no separate RDMA buffer in normal mode

    def __repr__(self) -> str:
        return (f'Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, '
                f'{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, '
                f'{self.num_max_rdma_chunked_recv_tokens}))')
