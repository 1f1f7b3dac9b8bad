"""A tensor subclass through a trace: the hooks' bookkeeping, which skips the torch function mode
for plain tensors, leaves a subclass its own type, so the aliases kept of a subclass input are of
that subclass, as the op outputs are.
"""

from __future__ import annotations

import torch

import torchlens as tl


class _Tagged(torch.Tensor):
    """A tensor subclass that only passes every torch function through (keeping its type)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_input_keeps_its_type_in_every_kept_alias():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4).as_subclass(_Tagged)
    with torch.no_grad():
        plain = net(x)  # the subclass's own forward, outside TorchLens
        t = tl.trace(net, x)
    assert type(plain) is _Tagged
    assert [type(op.tensor) for op in t.ops] == [_Tagged] * len(t.ops)
    for address in ("", "0", "2"):
        site = t.modules[address].facets["input"]
        assert type(site) is _Tagged, address
    assert torch.equal(t.ops[0].tensor.as_subclass(torch.Tensor), x.as_subclass(torch.Tensor))
    assert torch.equal(
        t.modules["2"].facets["output"].as_subclass(torch.Tensor), plain.as_subclass(torch.Tensor)
    )
