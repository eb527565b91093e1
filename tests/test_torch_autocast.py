"""`torch_autocast`: the forward runs under torch.autocast, as DeepSpeed's engine runs it
(`specs/config.md` §torch_autocast); the parameters, master copy and optimizer stay fp32."""

import pytest
import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import GPT, seeded, simulated_world


def _model():
    with seeded(0):  # ranks are threads: build alone
        return GPT(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2)


@pytest.mark.parametrize("stage,world", [(0, 1), (3, 2)])
def test_forward_computes_in_the_autocast_dtype_like_plain_torch(stage, world):
    ids = torch.randint(0, 32, (2 * world, 8), generator=torch.Generator().manual_seed(0))
    ref = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(ids)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
                              "torch_autocast": {"enabled": True, "dtype": "bf16"},
                              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
                             world_size=world)

    def rank(comm):
        sm = fnzero.shard(_model(), config=cfg, comm=comm)
        state = sm.init_state()
        x = ids[2 * comm.rank: 2 * comm.rank + 2]
        out = sm.apply(state.params, x)
        step = fnzero.train_step(lambda p, b: F.cross_entropy(sm.apply(p, b).float().flatten(0, 1), b.flatten()), cfg)
        new, _ = step(state, x)
        return out, {k: v.dtype for k, v in new.params.items()}

    for r, (out, dtypes) in enumerate(simulated_world(world).run(rank)):
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, want[2 * r: 2 * r + 2])  # the same kernels on the same weights
        assert set(dtypes.values()) == {torch.float32}


def test_safe_modules_warn_that_reduction_stays_in_the_parameter_dtype():
    with pytest.warns(fnzero.ConfigWarning, match="lower_precision_safe_modules"):
        fnzero.load_config({"train_micro_batch_size_per_gpu": 1,
                            "torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}})
