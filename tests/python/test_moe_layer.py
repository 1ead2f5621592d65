"""A DeepEP-style MoE layer over moerl_ep on 2 and 4 Gloo processes: outputs and gradients against the
same layer in one process holding every expert."""
import unittest

from harness import run_ranks

T, H, FFN, E, K = 6, 32, 24, 8, 2


def _layer_errors(rank, world, dtype_name, seed, transport='host', starve_last_rank=False):
    import torch
    import torch.distributed as dist
    import moerl_ep
    from moerl_ep.autograd import MoE

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    full = MoE(None, H, FFN, E, K, dtype=dtype)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    X = torch.randn(world * T, H).to(dtype)
    if starve_last_rank:  # positive x, and the last rank's experts score negative: it receives no row
        X = X.abs()
        last = E - E // world
        with torch.no_grad():
            full.router.weight.abs_()
            full.router.weight[last:].neg_()
    G = torch.randn(world * T, H).to(dtype)
    Xr = X.clone().requires_grad_()
    ref = full(Xr)
    (ref.float() * G.float()).sum().backward()

    buffer = moerl_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, transport=transport, timeout_s=20)
    layer = MoE(buffer, H, FFN, E, K, dtype=dtype)
    n = layer.w_gate.size(0)
    experts = slice(layer.first_expert, layer.first_expert + n)
    with torch.no_grad():
        layer.router.weight.copy_(full.router.weight)
        for name in ('w_gate', 'w_up', 'w_down'):
            getattr(layer, name).copy_(getattr(full, name)[experts])
    mine = slice(rank * T, (rank + 1) * T)
    x = X[mine].clone().requires_grad_()
    out = layer(x)
    (out.float() * G[mine].float()).sum().backward()
    router_grad = layer.router.weight.grad.float()  # Gloo of torch 1.13 sums no bf16
    dist.all_reduce(router_grad)  # the dense weight's gradient sums over data-parallel ranks

    def err(a, b):
        return float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12))
    errors = {
        'out': err(out, ref[mine]),
        'grad_x': err(x.grad, Xr.grad[mine]),
        'grad_router': err(router_grad, full.router.weight.grad),
    }
    for name in ('w_gate', 'w_up', 'w_down'):
        param = getattr(layer, name)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)  # experts without rows
        errors['grad_' + name] = err(grad, getattr(full, name).grad[experts])
    return errors


class MoELayerTest(unittest.TestCase):
    def check(self, world, dtype, tol, transport='host', starve_last_rank=False):
        for errors in run_ranks(world, _layer_errors, dtype, 1234, transport, starve_last_rank, timeout=120):
            for what, e in errors.items():
                self.assertLess(e, tol, f'{world} ranks, {dtype}, {transport}: {what} differs by {e:.3g}')

    def test_two_ranks_fp32(self):
        self.check(2, 'float32', 1e-5)

    def test_four_ranks_fp32(self):
        self.check(4, 'float32', 1e-5)

    def test_two_ranks_bf16(self):
        self.check(2, 'bfloat16', 5e-2)

    def test_rank_without_rows(self):
        self.check(2, 'float32', 1e-5, starve_last_rank=True)

    def test_two_ranks_fabric_tcp(self):
        import moerl_ep
        if 'fabric' not in moerl_ep._C.available_transports():
            self.skipTest('built without libfabric')
        self.check(2, 'float32', 1e-5, 'fabric/tcp')


if __name__ == '__main__':
    unittest.main()
