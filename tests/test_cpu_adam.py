"""The cpu profile's AdamW state, made at build (megatron_workers/engine.py: allocate_adam_state): the
steps it gives equal those of torch's own state, made at the first step, to the bit. Megatron's
optimizer wrappers are stood in for by their two attributes the function reads (``.optimizer``,
``.chained_optimizers``); the layout tests run it inside megatron's real optimizer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_workers.engine import allocate_adam_state


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True, **kw)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_made_at_build_steps_as_torchs_own_to_the_bit(amsgrad):
    lazy_params, eager_params = _params(0), _params(0)
    lazy, eager = _adamw(lazy_params, amsgrad=amsgrad), _adamw(eager_params, amsgrad=amsgrad)
    allocate_adam_state(SimpleNamespace(optimizer=eager))
    assert not lazy.state
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    for p in eager_params:
        assert set(eager.state[p]) == keys
        assert all(torch.count_nonzero(v) == 0 for v in eager.state[p].values())

    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for a, b in zip(lazy_params, eager_params):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        lazy.step()
        eager.step()
        for a, b in zip(lazy_params, eager_params):
            assert torch.equal(a, b), f"step {step + 1}"
            for key in keys:
                x, y = lazy.state[a][key], eager.state[b][key]
                assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, key
                assert torch.equal(x, y), (step + 1, key)


def test_state_already_there_is_kept_and_chained_optimizers_each_get_theirs():
    first, second = _params(0), _params(1)
    a, b = _adamw(first), _adamw(second)
    first[0].grad, first[1].grad = torch.ones(3, 4), torch.ones(5)
    a.step()  # a checkpoint's state, or a step already taken
    kept = {k: v.clone() for k, v in a.state[first[0]].items()}
    allocate_adam_state(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=a),
                                                            SimpleNamespace(optimizer=b)]))
    assert all(torch.equal(a.state[first[0]][k], v) for k, v in kept.items())
    assert float(a.state[first[0]]["step"]) == 1.0
    assert all(set(b.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in second)


def test_other_optimizers_are_refused():
    with pytest.raises(TypeError, match="AdamW; megatron built SGD"):
        allocate_adam_state(SimpleNamespace(optimizer=torch.optim.SGD(_params(0), lr=0.1)))
    with pytest.raises(RuntimeError, match="after use_fused_cpu_adam"):
        allocate_adam_state(SimpleNamespace(optimizer=torch.optim.AdamW(_params(0), lr=0.1)))
