"""The router's decisions on a compiled graph's sizes: symbols (backed, as Dynamo
makes them), decided without raising and with no guard a rule does not need."""
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import torch_flash_backend as tfb
from torch_flash_backend import testing


def test_router_on_symbolic_sizes_counts_bytes_only_for_one_token():
    """A compiled graph's sizes are symbols: the single-token rule's byte count
    (head dim 256) is reached only by a one-token query, where it becomes a guard
    on the key length; a prefill call decides without one, and neither raises
    (a tensor's nbytes does on symbolic sizes)."""
    env = ShapeEnv(duck_shape=False)  # equal hints would share one symbol

    def symbol(name, hint):
        return env.create_symintnode(env.create_symbol(hint, ConstantSource(name)), hint=hint)

    def on_keys():  # the guards that involve the key length
        return [g.expr for g in env.guards if keys.node.expr in g.expr.free_symbols]

    with FakeTensorMode(shape_env=env), testing.pretend_cuda(capability=(9, 0),
                                                             kernels=testing.registry_kernel_names()):
        length, keys = symbol("L", 4096), symbol("S", 4096)
        q = torch.empty(1, 8, length, 256, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(1, 8, keys, 256, dtype=torch.bfloat16, device="cuda")
        d = tfb.explain(q, k, k, is_causal=True)
        assert d.served and d.kernel == "sm90_fwd_bf16_hdim256", d
        assert not on_keys(), [g.expr for g in env.guards]
        one = torch.empty(1, 8, 1, 256, dtype=torch.bfloat16, device="cuda")
        tfb.explain(one, k, k)  # decided, whichever way: the byte count is a guard on S
        assert on_keys(), [g.expr for g in env.guards]
