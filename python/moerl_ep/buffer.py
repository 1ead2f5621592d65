"""moerl_ep.Buffer: DeepEP's Python Buffer (deep_ep/buffer.py at v1.2.1) over moerl's EP library.

DeepEP's buffers are sized in bytes and take any shape per call; a moerl Buffer is built for one shape
(hidden, top-k, experts, dtype, tokens per rank). This class therefore keeps one moerl engine per shape
it has seen, made collectively the first time every rank calls with that shape (calls are collective,
so every rank makes it at the same call). Normal mode fits max_tokens_per_rank to num_nvl_bytes;
low-latency mode uses num_max_dispatch_tokens_per_rank and checks num_rdma_bytes. docs/python.md lists
every difference from DeepEP.
"""
import uuid
from collections.abc import Sequence
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _C
from ._store import GroupStore
from .config import Config
from .utils import EventHandle, EventOverlap

Error = _C.Error
TimeoutError = _C.TimeoutError  # noqa: A001 (moerl_ep.TimeoutError is also the builtin's subclass)

_FP8 = getattr(torch, 'float8_e4m3fn', None)  # torch >= 2.1; fp8 rows are uint8 before that
_FP8_DTYPES = frozenset(d for d in (torch.uint8, _FP8) if d is not None)
_FP8_BLOCK = 128
_DTYPE_NAMES = {torch.bfloat16: 'bf16', torch.float32: 'fp32'}


def _dtype_name(t: torch.dtype) -> str:
    # Names the library parses; anything else gets its "unknown dtype" error.
    name = _DTYPE_NAMES.get(t)
    return name if name is not None else str(t).replace('torch.', '')


# The raw handle of a device's current stream without building a torch.cuda.Stream (a few
# microseconds a call, on every dispatch and combine); older torch builds lack it.
_current_raw_stream = getattr(torch._C, '_cuda_getCurrentRawStream', None)


def _stream(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _current_raw_stream is not None:
        return _current_raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _event(async_finish: bool) -> EventOverlap:
    return EventOverlap(EventHandle() if async_finish else None)


def _pack_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # An fp8 tuple travels as opaque bf16 elements (the library copies rows bit for bit):
    # [T, H] e4m3 bytes | [T, H/128] fp32 scales -> [T, (H + 4 * H/128) / 2] bf16.
    if x.dim() != 2 or x.size(1) % _FP8_BLOCK != 0:
        raise Error(f'dispatch: the fp8 x is {list(x.shape)}, expected [num_tokens, hidden] with hidden a '
                    f'multiple of {_FP8_BLOCK}')
    if scales.dtype != torch.float32 or list(scales.shape) != [x.size(0), x.size(1) // _FP8_BLOCK]:
        raise Error(f'dispatch: the fp8 scales are {scales.dtype} {list(scales.shape)}, expected float32 '
                    f'[{x.size(0)}, {x.size(1) // _FP8_BLOCK}]')
    row = torch.cat([x.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)
    return row.view(torch.bfloat16)


def _unpack_fp8(packed: torch.Tensor, hidden: int) -> Tuple[torch.Tensor, torch.Tensor]:
    raw = packed.view(torch.uint8)
    x = raw[:, :hidden].contiguous()
    scales = raw[:, hidden:].contiguous().view(torch.float32)
    return (x.view(_FP8) if _FP8 is not None else x), scales


class DispatchHandle(Sequence):
    """The handle of a normal dispatch. Indexing and unpacking give DeepEP's intranode tuple
    (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head), computed on first access; the two channel matrices are None (moerl
    has no channels) and rank_prefix_matrix holds only this rank's column (docs/python.md)."""

    __slots__ = ('_buffer', '_routing', '_key', '_native', '_others', '_items')

    def __init__(self, buffer: 'Buffer', routing: torch.Tensor, key: tuple, native: '_C.Handle') -> None:
        self._buffer = buffer
        self._routing = routing  # [T, K'] the ids dispatched (K' = W when dispatched by is_token_in_rank)
        self._key = key  # the engine dispatched on: ('normal', hidden, dtype, top_k, num_experts)
        self._native = native
        self._others: Optional[Dict[tuple, _C.Handle]] = None  # the same routing on other engines
        self._items: Optional[tuple] = None

    @property
    def _num_experts(self) -> int:
        return self._key[4]

    @property
    def num_recv_tokens(self) -> int:
        return self._native.num_recv_tokens

    def native(self) -> '_C.Handle':
        return self._native

    def _native_on(self, key: tuple) -> Optional['_C.Handle']:
        if key == self._key:
            return self._native
        return self._others.get(key) if self._others is not None else None

    def _add_native(self, key: tuple, native: '_C.Handle') -> None:
        if self._others is None:
            self._others = {}
        self._others[key] = native

    def _tuple(self) -> tuple:
        if self._items is None:
            h, b = self.native(), self._buffer
            prefix = torch.zeros((b.group_size, b.group_size), dtype=torch.int32)
            prefix[:, b.rank] = torch.cumsum(h.num_recv_per_src, 0, dtype=torch.int32)
            send_head = h.send_pos
            dev = self._routing.device  # the tokens' device
            self._items = (prefix.to(dev), None, None, h.recv_src_token.to(dev), (send_head >= 0).to(dev),
                           send_head.to(dev))
        return self._items

    def __getitem__(self, i):
        return self._tuple()[i]

    def __len__(self) -> int:
        return 6


class LowLatencyHandle(Sequence):
    """DeepEP's low-latency handle: (recv_src_info [L, W*maxT] int32, recv_layout_range [L, W] int64
    as (first row << 32) | count, num_max_dispatch_tokens_per_rank, hidden, num_experts)."""

    __slots__ = ('_native', '_key', '_rest', '_device', '_items')

    def __init__(self, native: '_C.LowLatencyHandle', key: tuple, max_tokens: int, hidden: int,
                 num_experts: int, device: torch.device) -> None:
        self._native, self._key = native, key
        self._rest = (max_tokens, hidden, num_experts)
        self._device = device
        self._items: Optional[tuple] = None

    def __getitem__(self, i):
        if self._items is None:
            self._items = (self._native.recv_src_token.to(self._device),
                           self._native.recv_layout_range.to(self._device)) + self._rest
        return self._items[i]

    def __len__(self) -> int:
        return 5


class Buffer:
    """DeepEP's Buffer over moerl's EP library. Arguments as DeepEP's; moerl's own, keyword-only:

    transport: 'host' (processes of one machine, shared memory), 'fabric/tcp', 'fabric/shm', 'fabric/efa'
        (libfabric), 'cuda' (CUDA IPC) or 'nccl'. Default: 'cuda' for an NCCL group, else 'host'.
    timeout_s: the longest wait on a peer before a call raises moerl_ep.TimeoutError naming the phase
        and the peer. Default 60.
    num_sms: SMs each kernel of the cuda/nccl transports uses. Default 64 (moerl's Config).
    job_id: namespaces this buffer's shared memory and store keys. Default: a fresh id agreed by the group.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm=None, *, transport: Optional[str] = None,
                 timeout_s: float = 60.0, num_sms: Optional[int] = None, job_id: Optional[str] = None) -> None:
        if group is None:
            if comm is not None:
                raise NotImplementedError('moerl_ep.Buffer: an mpi4py communicator is not supported; '
                                          'pass a torch.distributed group')
            if not dist.is_initialized():
                raise ValueError("Either 'group' or 'comm' must be provided.")
            group = dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        if transport is None:
            transport = 'cuda' if dist.get_backend(group) == 'nccl' else 'host'
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self._num_sms = num_sms
        # One exchange over the group: rank 0's job id, and everybody's settings, which must agree.
        mine = (job_id or f'moerl_ep-{uuid.uuid4().hex[:12]}', self.num_nvl_bytes, self.num_rdma_bytes, transport)
        everyone = [None] * self.group_size
        dist.all_gather_object(everyone, mine, group=group)
        for r, theirs in enumerate(everyone):
            if theirs[1:] != mine[1:]:
                raise ValueError(f'moerl_ep.Buffer: rank {r} has (num_nvl_bytes, num_rdma_bytes, transport) = '
                                 f'{theirs[1:]}, but rank {self.rank} has {mine[1:]}')
        self._job_id = everyone[0][0]
        self._store = GroupStore(group, f'moerl_ep/{self._job_id}/')
        self._engines: Dict[tuple, _C.Engine] = {}
        self._normal = _C.NormalEngines()  # the normal-mode engines again, for dispatch's common call
        self._ll_out: Dict[tuple, list] = {}     # two sets of low-latency outputs per engine
        self._ll_next: Dict[tuple, int] = {}
        self._ll_combine_in: Dict[tuple, torch.Tensor] = {}

    # --- engines ---------------------------------------------------------------------------------
    def _engine_config(self, hidden: int, top_k: int, num_experts: int, dtype: str, max_tokens: int,
                       low_latency: bool, fp8: bool = False) -> '_C.EngineConfig':
        c = _C.EngineConfig()
        c.world_size, c.rank = self.group_size, self.rank
        c.num_experts, c.hidden, c.top_k = num_experts, hidden, top_k
        c.max_tokens_per_rank = max(int(max_tokens), 1)
        c.dtype = dtype
        c.fp8_dispatch = fp8
        c.transport = self.transport
        c.low_latency = low_latency
        c.timeout_s = self.timeout_s
        if self._num_sms is not None:
            c.num_sms = self._num_sms
        return c

    def _normal_max_tokens(self, hidden: int, top_k: int, num_experts: int, dtype: str) -> int:
        c = self._engine_config(hidden, top_k, num_experts, dtype, 1, False)
        one = c.normal_bytes_hint()
        c.max_tokens_per_rank = 2
        per_token = c.normal_bytes_hint() - one
        return max((self.num_nvl_bytes - (one - per_token)) // per_token, 0)

    def _make_engine(self, key: tuple, c: '_C.EngineConfig') -> '_C.Engine':
        c.validate()  # locally, before the collective construction
        c.job_id = f'{self._job_id}/{len(self._engines)}'
        engine = _C.Engine(c, self._store)
        self._engines[key] = engine
        return engine

    def _normal_engine(self, hidden: int, dtype: str, top_k: int, num_experts: int,
                       max_tokens: int = 1 << 20) -> Tuple[tuple, '_C.Engine']:
        # max_tokens caps the tokens per rank fitted to num_nvl_bytes (and so the memory registered).
        key = ('normal', hidden, dtype, top_k, num_experts)
        engine = self._engines.get(key)
        if engine is None:
            c = self._engine_config(hidden, top_k, num_experts, dtype, 1, False)
            c.validate()
            max_tokens = min(self._normal_max_tokens(hidden, top_k, num_experts, dtype), max_tokens)
            if max_tokens < 1:
                need = self.get_normal_size_hint(1, hidden, self.group_size, top_k, num_experts, dtype)
                raise Error(f'dispatch: num_nvl_bytes = {self.num_nvl_bytes} holds no token of hidden {hidden} '
                            f'({dtype}, top-k {top_k}) on {self.group_size} ranks; one token per rank needs '
                            f'{need} bytes (Buffer.get_normal_size_hint)')
            c.max_tokens_per_rank = max_tokens
            engine = self._make_engine(key, c)
            self._normal.add(key, engine)
        return key, engine

    def _check_alive(self) -> None:
        if self._engines is None:
            raise Error('moerl_ep.Buffer used after destroy()')

    def _native_handle(self, handle: DispatchHandle, key: tuple, engine: '_C.Engine', dtype: torch.dtype,
                       device: torch.device) -> '_C.Handle':
        # The handle of this routing on another engine (a payload of another shape): one dispatch of
        # zeros there gives it; the rows arrive in the same order, since the routing is the same.
        native = handle._native_on(key)
        if native is None:
            zeros = torch.zeros((handle._routing.size(0), key[1]), dtype=dtype, device=device)
            native = engine.dispatch(zeros, handle._routing, None, None, False, _stream(zeros))[4]
            handle._add_native(key, native)
        return native

    # --- static API ------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        return bool(_C.has_cuda) and _FP8 is not None

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_normal_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int,
                             num_experts: int, dtype: str = 'bf16') -> int:
        """num_nvl_bytes for normal dispatch/combine of up to num_max_tokens_per_rank tokens (moerl)."""
        c = _C.EngineConfig()
        c.world_size, c.num_experts, c.hidden, c.top_k = num_ranks, num_experts, hidden, num_topk
        c.max_tokens_per_rank, c.dtype, c.low_latency = num_max_tokens_per_rank, dtype, False
        return c.normal_bytes_hint()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, num_topk: Optional[int] = None) -> int:
        """num_rdma_bytes for low-latency calls with these sizes, bf16. moerl's regions grow with top-k,
        which DeepEP's signature lacks: without num_topk the largest the library takes (32, at most
        num_experts) is assumed."""
        c = _C.EngineConfig()
        c.world_size, c.num_experts, c.hidden = num_ranks, num_experts, hidden
        c.top_k = num_topk if num_topk is not None else min(num_experts, 32)
        c.max_tokens_per_rank, c.dtype, c.low_latency = num_max_dispatch_tokens_per_rank, 'bf16', True
        return c.low_latency_bytes_hint() + c.normal_bytes_hint()

    def get_comm_stream(self):
        raise NotImplementedError('moerl_ep: calls run on the current stream; there is no communication stream')

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        raise NotImplementedError('moerl_ep: the registered buffer is internal to the EP library')

    # --- normal mode -----------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        topk_idx = topk_idx.contiguous()
        if topk_idx.is_cuda:
            per_rank, per_expert, in_rank, bad, value = _C.layout_on_device(topk_idx, num_experts, self.group_size,
                                                                            _stream(topk_idx))
            if bad >= 0:
                t, k = divmod(bad, topk_idx.size(1))
                raise Error(f'topk_idx[{t},{k}] = {value}, but num_experts = {num_experts} '
                            f'(valid: -1..{num_experts - 1})')
        else:
            per_rank, per_expert, in_rank = _C.layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, _event(async_finish)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], Optional[List[int]], DispatchHandle, EventOverlap]:
        if (handle is None and topk_idx is not None and num_tokens_per_expert is not None and
                expert_alignment == 1 and num_worst_tokens == 0 and x.__class__ is torch.Tensor):
            # The common call, made by the extension in one step when an engine takes the tensors as
            # they are (None otherwise: the general path below converts them or raises).
            try:
                got = self._normal.dispatch(x, topk_idx, topk_weights, num_tokens_per_expert)
            except Error as e:
                raise self._with_sizing(e, x.size(1)) from None
            if got is not None:
                recv, recv_idx, recv_w, counts, native, key = got
                return (recv, recv_idx, recv_w, counts, DispatchHandle(self, topk_idx, key, native),
                        _event(async_finish))
        self._check_alive()
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        hidden = x.size(1) if x.dim() == 2 else -1
        if x_scales is None and x.dtype in _FP8_DTYPES:
            raise Error(f'dispatch: x is {x.dtype}; fp8 rows are dispatched as a tuple (x, x_scales)')
        payload = _pack_fp8(x, x_scales) if x_scales is not None else x.contiguous()
        dtype = _dtype_name(payload.dtype)

        if handle is not None:
            assert topk_idx is None and topk_weights is None
            key, engine = self._normal_engine(payload.size(1), dtype, handle._routing.size(1),
                                              handle._num_experts)
            native = self._native_handle(handle, key, engine, payload.dtype, payload.device)
            recv = self._dispatch_call(engine, payload, None, None, native, False, hidden)[0]
            recv = _unpack_fp8(recv, hidden) if x_scales is not None else recv
            return recv, None, None, None, None, _event(async_finish)

        if num_tokens_per_expert is None:
            raise Error('dispatch: num_tokens_per_expert is required (get_dispatch_layout gives it)')
        num_experts = num_tokens_per_expert.numel()
        with_topk = topk_idx is not None
        if with_topk:
            routing = topk_idx
        else:
            # DeepEP dispatches by is_token_in_rank alone: one id per rank the token goes to (that rank's
            # first expert) routes it the same way.
            if is_token_in_rank is None:
                raise Error('dispatch: topk_idx or is_token_in_rank is required without a handle')
            local = -(-num_experts // self.group_size)
            first = torch.arange(self.group_size, device=is_token_in_rank.device, dtype=torch.int64) * local
            routing = torch.where(is_token_in_rank, first.expand_as(is_token_in_rank),
                                  torch.full_like(first, -1).expand_as(is_token_in_rank))
        routing = routing.contiguous()
        if routing.dim() != 2:
            raise Error(f'dispatch: topk_idx has {routing.dim()} dimensions, expected 2')
        weights = topk_weights.contiguous() if topk_weights is not None else None
        key, engine = self._normal_engine(payload.size(1), dtype, routing.size(1), num_experts)
        recv, _, recv_idx, recv_w, native = self._dispatch_call(engine, payload, routing, weights, None,
                                                                with_topk, hidden)
        handle = DispatchHandle(self, routing, key, native)
        if with_topk:
            counts = native.num_recv_tokens_per_expert
            if weights is None:
                recv_w = None
        else:
            recv_idx = recv_w = None
            counts = self._recv_counts_of(num_tokens_per_expert)
        if expert_alignment > 1:
            counts = [-(-n // expert_alignment) * expert_alignment for n in counts]
        if num_worst_tokens > 0:
            recv, recv_idx, recv_w = self._pad_rows(num_worst_tokens, recv, recv_idx, recv_w)
            counts = []
        recv = _unpack_fp8(recv, hidden) if x_scales is not None else recv
        return recv, recv_idx, recv_w, counts, handle, _event(async_finish)

    def _dispatch_call(self, engine: '_C.Engine', payload: torch.Tensor, routing: Optional[torch.Tensor],
                       weights: Optional[torch.Tensor], native: Optional['_C.Handle'], want_topk: bool,
                       hidden: int) -> tuple:
        try:
            return engine.dispatch(payload, routing, weights, native, want_topk, _stream(payload))
        except Error as e:
            raise self._with_sizing(e, hidden) from None

    def _with_sizing(self, e: Exception, hidden: int) -> Exception:
        # Adds the buffer's sizing to the library's "too many rows" message.
        if 'Config.max_tokens_per_rank' in str(e):
            return type(e)(f'{e}; num_nvl_bytes = {self.num_nvl_bytes} holds that many tokens of hidden '
                           f'{hidden} per rank (Buffer.get_normal_size_hint sizes it)')
        return e

    def _recv_counts_of(self, num_tokens_per_expert: torch.Tensor) -> List[int]:
        # Without top-k ids the rows carry no expert ids; the counts come from every rank's layout.
        everyone = [torch.empty_like(num_tokens_per_expert) for _ in range(self.group_size)]
        dist.all_gather(everyone, num_tokens_per_expert.contiguous(), group=self.group)
        local = -(-num_tokens_per_expert.numel() // self.group_size)
        total = torch.stack(everyone).sum(0)
        return total[self.rank * local:(self.rank + 1) * local].tolist()

    @staticmethod
    def _pad_rows(rows: int, recv, recv_idx, recv_w):
        have = recv.size(0)
        if rows < have:
            raise Error(f'dispatch: num_worst_tokens = {rows}, but {have} tokens arrived')

        def pad(t, fill):
            if t is None:
                return None
            out = torch.full((rows,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[:have] = t
            return out
        return pad(recv, 0), pad(recv_idx, -1), pad(recv_w, 0)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        if topk_weights is None and bias is None and handle.__class__ is DispatchHandle and \
                x.__class__ is torch.Tensor and self._engines:
            # The common call: x as the dispatch's engine takes it (None otherwise: the path below).
            engine = self._engines.get(handle._key)
            out = engine.combine_current(x, handle._native) if engine is not None else None
            if out is not None:
                return out, None, _event(async_finish)
        self._check_alive()
        if not isinstance(handle, DispatchHandle):
            raise Error('combine: the handle must come from moerl_ep.Buffer.dispatch')
        if x.dim() != 2:
            raise Error(f'combine: x has {x.dim()} dimensions, expected 2')
        x = x.contiguous()
        dtype = _dtype_name(x.dtype)
        key, engine = self._normal_engine(x.size(1), dtype, handle._routing.size(1), handle._num_experts)
        native = self._native_handle(handle, key, engine, x.dtype, x.device)
        out = engine.combine(x, native, _stream(x))
        combined_w = None
        if topk_weights is not None:
            # The weights sum in fp32 over a second engine of K fp32 columns with the same routing, sized
            # for the tokens of the first.
            w = topk_weights.to(torch.float32).contiguous()
            wkey, wengine = self._normal_engine(w.size(1), 'fp32', handle._routing.size(1), handle._num_experts,
                                                engine.config.max_tokens_per_rank)
            wnative = self._native_handle(handle, wkey, wengine, torch.float32, w.device)
            combined_w = wengine.combine(w, wnative, _stream(w))
        if bias is not None:
            biases = bias if isinstance(bias, tuple) else (bias,)
            acc = out.float()
            for b in biases:
                if b is not None:
                    acc += b.float()
            out = acc.to(out.dtype)
        return out, combined_w, _event(async_finish)

    # --- low-latency mode ------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: moerl's low-latency regions need no zeroing between modes."""

    def _ll_engine(self, x: torch.Tensor, top_k: int, max_tokens: int, num_experts: int,
                   fp8: bool) -> Tuple[tuple, '_C.Engine']:
        if x.dim() != 2:
            raise Error(f'low_latency_dispatch: x has {x.dim()} dimensions, expected 2')
        dtype = _dtype_name(x.dtype)
        key = ('ll', x.size(1), dtype, top_k, num_experts, max_tokens, fp8)
        engine = self._engines.get(key)
        if engine is None:
            c = self._engine_config(x.size(1), top_k, num_experts, dtype, max_tokens, True, fp8)
            c.validate()
            need = c.low_latency_bytes_hint() + c.normal_bytes_hint()
            if self.num_rdma_bytes < need:
                raise Error(f'low_latency_dispatch: num_rdma_bytes = {self.num_rdma_bytes}, but '
                            f'{max_tokens} tokens per rank of hidden {x.size(1)} ({dtype}, top-k {top_k}, '
                            f'{num_experts} experts) on {self.group_size} ranks need {need} '
                            f'(Buffer.get_low_latency_rdma_size_hint(..., num_topk={top_k}))')
            engine = self._make_engine(key, c)
            rows, L = c.num_local_experts() * c.low_latency_rows_per_expert(), c.num_local_experts()
            opts = dict(device=x.device)
            self._ll_out[key] = [
                (torch.empty((rows, x.size(1)), dtype=torch.uint8 if fp8 else x.dtype, **opts),
                 torch.empty((rows, x.size(1) // _FP8_BLOCK), dtype=torch.float32, **opts) if fp8 else None,
                 torch.empty((L,), dtype=torch.int32, **opts)) for _ in range(2)]
            self._ll_next[key] = 0
        return key, engine

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, LowLatencyHandle,
                  EventOverlap, Optional[Callable]]:
        self._check_alive()
        if round_scale or use_ue8m0:
            raise NotImplementedError('moerl_ep: low_latency_dispatch has no round_scale / use_ue8m0 '
                                      '(fp8 scales are amax / 448 in fp32)')
        if topk_idx.dim() != 2:
            raise Error(f'low_latency_dispatch: topk_idx has {topk_idx.dim()} dimensions, expected 2')
        key, engine = self._ll_engine(x, topk_idx.size(1), num_max_dispatch_tokens_per_rank, num_experts,
                                      use_fp8)
        # Two sets of outputs in turn, as DeepEP's two buffers: a result is valid until the call after next.
        recv_x, recv_scales, recv_count = self._ll_out[key][self._ll_next[key]]
        self._ll_next[key] ^= 1
        native = engine.low_latency_dispatch(x.contiguous(), topk_idx.contiguous(), recv_x, recv_scales,
                                             recv_count, _stream(x))
        L = recv_count.numel()
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        packed = recv_x.view(L, -1, x.size(1))
        if use_fp8:
            packed = (packed.view(_FP8) if _FP8 is not None else packed, recv_scales.view(L, -1, recv_scales.size(1)))
        handle = LowLatencyHandle(native, key, num_max_dispatch_tokens_per_rank, x.size(1), num_experts, x.device)
        hook = (lambda: None) if return_recv_hook else None
        return packed, recv_count, handle, _event(async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The tensor low_latency_combine(..., zero_copy=True) reads: [L, W*maxT, hidden]."""
        key = handle._key
        if key not in self._ll_combine_in:
            recv_x = self._ll_out[key][0][0]
            L = self._ll_out[key][0][2].numel()
            dtype = torch.bfloat16 if key[2] == 'bf16' else torch.float32
            self._ll_combine_in[key] = torch.empty((L, recv_x.size(0) // L, key[1]), dtype=dtype,
                                                   device=recv_x.device)
        return self._ll_combine_in[key]

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        self._check_alive()
        if use_logfmt:
            raise NotImplementedError('moerl_ep: low_latency_combine has no LogFMT; it sends bf16/fp32 rows')
        if not isinstance(handle, LowLatencyHandle):
            raise Error('low_latency_combine: the handle must come from moerl_ep.Buffer.low_latency_dispatch')
        engine = self._engines[handle._key]
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        y = x.reshape(-1, x.size(-1))
        if out is None:
            out = torch.empty((topk_idx.size(0), x.size(-1)), dtype=x.dtype, device=x.device)
        engine.low_latency_combine(y.contiguous(), topk_idx.contiguous(), topk_weights.to(torch.float32).contiguous(),
                                   handle._native, out, _stream(x))
        hook = (lambda: None) if return_recv_hook else None
        return out, _event(async_finish), hook

    # --- teardown --------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Collective: releases every engine (DeepEP asks for explicitly_destroy=True first)."""
        assert self.explicitly_destroy, '`explicitly_destroy` flag must be set'
        self._release()

    def _release(self) -> None:
        engines, self._engines = self._engines, None
        self._normal.clear()
        for engine in (engines or {}).values():
            engine.destroy()

    def __del__(self) -> None:
        if getattr(self, '_engines', None) and not self.explicitly_destroy:
            try:
                self._release()
            except Exception:  # noqa: BLE001 - a dead peer must not raise out of a finalizer
                pass
