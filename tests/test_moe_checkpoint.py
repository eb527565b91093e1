"""Checkpoints of expert-parallel states (`specs/checkpoint-format.md` §Expert parallelism).

A checkpoint saved at one expert-parallel size loads at another (and at another world size and ZeRO
stage): parameters and Adam's moments, gathered by name, bit-identical to the saving run's, and
the next step equal to the saving run's next step (float64, 1e-9). The model is
`test_moe_sharded`'s GPT with two fnzero MoE layers of 4 experts, routing made deterministic (no
random token selection, no sampled second expert) so that a step does not depend on which rank's
generator draws for which tokens. Every step sees the same four chunks of tokens, split over the
ranks and their micro-batches.
"""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch
from torch import nn

import fnzero
import test_moe_sharded as M
from fnzero import CheckpointError
from fnzero.checkpoint import export, export_live, info, load, save
from fnzero.sharding.ep._group import ExpertGroup
from fnzero.testing import seeded, simulated_world

CHUNKS = 4  # token chunks per step, whatever the world size (each micro-batch is one)
# Loads leave torch's RNG alone (`restore_rng=False`): the simulated ranks are threads sharing one
# generator, and a rank restoring it while another builds its model under `seeded` would change
# that rank's weights (the build would no longer be reproducible).


def _model():
    model = M._build()
    for block in model.blocks:
        gate = block.moe.deepspeed_moe.gate
        gate.use_rts = gate.top2_2nd_expert_sampling = False
    return model


def _config(stage: int, world: int):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": CHUNKS // world, "gradient_clipping": M.CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": M.LR, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }, world_size=world)


def _named(sm, state) -> dict[str, torch.Tensor]:
    """Every parameter and both Adam moments by the whole model's names (ep-consolidated)."""
    out = {f"param/{n}": t for n, t in sm.gather(state).items()}
    for field in ("exp_avg", "exp_avg_sq"):
        out.update({f"{field}/{n}": t for n, t in sm.gather(getattr(state.opt_state, field)).items()})
    return out


def _run(stage: int, world: int, ep: int, ckpt: str, save_first: bool, extra=None, model=_model, loss=M._loss,
         chunk=M._chunk, tp: int = 1):
    """Save (after one step) or load a checkpoint at this mesh (`tp` > 1: the MoE GPT's attention
    split, `M.TP_PLAN`); returns (the state's named tensors then, the parameters after the next
    step, what `extra(sm, state, comm)` gave on rank 0)."""
    dp = world // tp
    cfg = _config(stage, dp)

    def rank(comm):
        mesh = fnzero.make_mesh(comm, ep=ep, tp=tp)
        sm = fnzero.shard(model(), config=cfg, comm=comm, mesh=mesh, tp_plan=M.TP_PLAN if tp > 1 else None)
        state = sm.init_state()
        assert (state.sharding.ep is not None, state.sharding.tp is not None) == (ep > 1, tp > 1)
        step = fnzero.train_step(lambda params, batch: loss(lambda x: sm.apply(params, x), batch), cfg)
        accum = CHUNKS // dp

        def batch(s):
            return [chunk(s, mesh.coords["dp"] * accum + i) for i in range(accum)]

        if save_first:
            state, _ = step(state, batch(0))
            save(ckpt, state, tag="t")
        else:
            state, _ = load(ckpt, like=state, restore_rng=False)  # threads share torch's RNG: see below
        named = _named(sm, state)
        more = extra(sm, state, comm) if extra is not None else None
        state, _ = step(state, batch(int(state.step)))
        return named, sm.gather(state), more

    named, after, more = simulated_world(world).run(rank)[0]
    return named, after, more


def _loads_as_saved(saved, at: list[tuple[int, ...]], ckpt: str, next_step: bool = True, **model) -> None:
    """Loaded at each (stage, world, ep[, tp]): named tensors bit-identical, the next step equal."""
    want, want_next, _ = saved
    for stage, world, ep, *tp in at:
        got, got_next, _ = _run(stage, world, ep, ckpt, save_first=False, tp=tp[0] if tp else 1, **model)
        where = f"stage {stage}, world {world}, ep {ep}, tp {tp[0] if tp else 1}"
        assert got.keys() == want.keys(), where
        for n in want:
            assert torch.equal(got[n], want[n]), f"{where}: {n}"
        for n in want_next if next_step else ():
            torch.testing.assert_close(got_next[n], want_next[n], rtol=1e-9, atol=1e-12, msg=f"{where}: {n}")


def _exported(path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(os.path.join(path, "model.safetensors"))


def test_ep2_checkpoint_loads_at_ep1_and_ep4(tmp_path):
    """The acceptance case: saved at ep 2 (world 2, stage 1), loaded at ep 1 (one rank, stage 3;
    two ranks, stage 0) and ep 4 (four ranks, stage 1). `export` of the checkpoint and
    `export_live` of the saving run both write the model's own names (those of the model at ep 1)
    with every expert's saved weights; `info` counts every expert."""
    ckpt, live = str(tmp_path / "ckpt"), str(tmp_path / "live")
    saved = _run(1, 2, 2, ckpt, save_first=True, extra=lambda sm, state, comm: export_live(sm, state, live, dtype="fp64"))
    weights = {n[len("param/"):]: t for n, t in saved[0].items() if n.startswith("param/")}
    model = _model()
    assert weights.keys() == model.state_dict().keys()
    assert any(".deepspeed_experts.3." in n for n in weights)  # every expert, by its global name
    export(ckpt, str(tmp_path / "out"), dtype="fp64")
    for got in (_exported(tmp_path / "out"), _exported(live)):
        assert got.keys() == weights.keys()
        for n, t in weights.items():
            assert torch.equal(got[n], t), n
    assert info(ckpt)["checkpoints"][0]["num_params"] == sum(p.numel() for p in model.parameters())
    _loads_as_saved(saved, [(3, 1, 1), (0, 2, 1), (1, 4, 4)], ckpt)


def test_ep2_world4_stage3_checkpoint_loads_anywhere(tmp_path):
    """Saved at ep 2 over four ranks at stage 3 (expert units sharded over two expert-data-parallel
    ranks): loads at ep 1 (two ranks, stage 1), ep 4 (stage 3) and ep 2 over two ranks (stage 2)."""
    saved = _run(3, 4, 2, str(tmp_path), save_first=True)
    _loads_as_saved(saved, [(1, 2, 1), (3, 4, 4), (2, 2, 2)], str(tmp_path))


def test_ep2_x_tp2_checkpoint_loads_without_either_and_with_both(tmp_path):
    """Saved at ep 2 x tp 2 (four ranks, ZeRO-3: attention split over tp, experts over ep): an
    ordinary checkpoint, loaded at ep 1 without tp (two ranks), ep 4, tp 2 alone and ep 2 x tp 2."""
    saved = _run(3, 4, 2, str(tmp_path), save_first=True, tp=2)
    _loads_as_saved(saved, [(1, 2, 1), (1, 4, 4), (3, 4, 1, 2), (3, 4, 2, 2)], str(tmp_path))


def test_ep1_checkpoint_loads_at_ep2(tmp_path):
    """Saved without expert parallelism (two ranks, stage 0): loads at ep 2 (stage 3)."""
    saved = _run(0, 2, 1, str(tmp_path), save_first=True)
    _loads_as_saved(saved, [(3, 2, 2)], str(tmp_path))


class _Stacked(ExpertGroup):
    """Hugging Face's layout: all of a layer's experts in one tensor per weight, dim 0 the expert;
    split over ep ranks, each keeps its rows under the same name. (Its tokens meet only this
    rank's experts, so its steps differ by ep size: only the load is compared.)"""

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.w = nn.Parameter(torch.randn(4, 3, 5, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(4, 5, dtype=torch.float64))

    def _keep_experts(self, lo: int, hi: int) -> None:
        for name in ("w", "b"):
            p = getattr(self, name)
            setattr(self, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))

    def forward(self, x):
        return (torch.einsum("nh,ehk->nek", x, self.w) + self.b[None]).sum(1)


def _stacked_model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(3, 3).double(), _Stacked())


def _stacked_chunk(step: int, i: int) -> torch.Tensor:
    return torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * step + i))


def test_stacked_experts_are_stored_whole_and_read_by_rows(tmp_path):
    """Experts stacked in one tensor (saved at ep 2, world 2, stage 1) are stored as the whole
    tensor, the ep ranks' rows in order, and read back at ep 1 and ep 4 (stage 3), moments too."""
    stacked = {"model": _stacked_model, "chunk": _stacked_chunk, "loss": lambda apply, x: apply(x).square().mean()}
    saved = _run(1, 2, 2, str(tmp_path), save_first=True, **stacked)
    assert saved[0]["param/1.w"].shape == (4, 3, 5)
    assert torch.equal(saved[0]["param/1.w"], _stacked_model()[1].w) is False  # trained: the step moved it
    _loads_as_saved(saved, [(3, 1, 1), (3, 4, 4)], str(tmp_path), next_step=False, **stacked)


def test_what_is_not_built_yet_is_refused(tmp_path):
    """A node-local save and frozen experts under expert parallelism: one CheckpointError each on
    every rank, before anything is written or read."""
    def model():
        m = _stacked_model()
        m[1].b.requires_grad_(False)
        return m

    cfg = _config(1, 2)

    def rank(comm):
        sm = fnzero.shard(model(), config=cfg, comm=comm, mesh=fnzero.make_mesh(comm, ep=2))
        state = sm.init_state()
        with pytest.raises(CheckpointError, match="node-local save"):
            save(str(tmp_path), state, node_local=True)
        for call in (lambda: save(str(tmp_path), state), lambda: load(str(tmp_path), like=state)):
            with pytest.raises(CheckpointError, match="frozen expert parameters"):
                call()

    simulated_world(2).run(rank)
    assert os.listdir(tmp_path) == []


def test_hugging_face_moe_checkpoint_loads_at_other_ep_and_exports_for_from_pretrained(tmp_path):
    """Mixtral through AutoEP (stacked expert tensors), saved at ep 2 (two ranks, ZeRO-3): loads
    bit-identically at ep 1 (one rank, ZeRO-1) and ep 4 (ZeRO-3) with the next step equal to the
    saving run's; exported from the checkpoint with the model's config, transformers'
    `from_pretrained` reads it back as the saving run's weights (whole stacked tensors)."""
    import test_moe_hf as H
    from transformers import AutoModelForCausalLM

    hf = {"model": lambda: H._build("mixtral"), "chunk": H._chunk,
          "loss": lambda apply, chunk: H._loss(apply(chunk[:, :-1]), chunk)}
    ckpt = str(tmp_path / "ckpt")
    saved = _run(3, 2, 2, ckpt, save_first=True, **hf)
    _loads_as_saved(saved, [(1, 1, 1), (3, 4, 4)], ckpt, **hf)
    config_dir = tmp_path / "config"
    H._build("mixtral").config.save_pretrained(config_dir)
    export(ckpt, str(tmp_path / "out"), dtype="fp64", hf_config=str(config_dir))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    weights = {n[len("param/"):]: t for n, t in saved[0].items() if n.startswith("param/")}
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name


def _pipelined_or_whole(stage: int, world: int, ep: int, pp: int, ckpt: str, save_first: bool) -> dict:
    """Every rank's consolidated parameters and moments (a pipeline's stages together) after saving
    (one step) or loading, with the MoE GPT cut into pp stages (`test_moe_sharded`'s layers)."""
    from fnzero.pipeline import PipelineModule

    dp = world // pp
    cfg = M.config(stage, world, pipeline={"stages": pp}) if pp > 1 else _config(stage, dp)

    def rank(comm):
        model, mesh = _model(), fnzero.make_mesh(comm, pp=pp, ep=ep)
        if pp > 1:
            layers = [M._EmbedLayer(model), *(M._BlockLayer(b) for b in model.blocks), M._HeadLayer(model.head)]
            pipe = PipelineModule(layers, M._pipe_loss, num_stages=pp, partition_method="uniform", names_from=model)
            sm = fnzero.shard(pipe, config=cfg, comm=comm, mesh=mesh)
            step = fnzero.train_step(fnzero.pipeline_loss(sm, "1f1b"), cfg)
        else:
            sm = fnzero.shard(model, config=cfg, comm=comm, mesh=mesh)
            step = fnzero.train_step(lambda params, batch: M._loss(lambda x: sm.apply(params, x), batch), cfg)
        state = sm.init_state()
        if save_first:
            accum = CHUNKS // dp
            chunks = torch.cat([M._chunk(0, mesh.coords["dp"] * accum + i) for i in range(accum)])
            state, _ = step(state, (chunks[:, :-1], chunks[:, 1:]) if pp > 1 else list(chunks.split(2)))
            save(ckpt, state, tag="t")
        else:
            state, _ = load(ckpt, like=state, restore_rng=False)  # threads share torch's RNG: see below
        return _named(sm, state)

    out: dict = {}
    for named in simulated_world(world).run(rank):
        out.update(named)
    return out


def test_ep2_pipeline_checkpoint_loads_at_other_meshes(tmp_path):
    """Saved at pp 2 x dp 2 with ep 2 (each stage's experts split over its dp ranks, ZeRO-1): one
    checkpoint, loaded without a pipeline at ep 1 (two ranks) and ep 4, and as pipelines at ep 2 and
    ep 1; parameters and moments bit-identical."""
    want = _pipelined_or_whole(1, 4, 2, 2, str(tmp_path), save_first=True)
    assert any(".deepspeed_experts.3." in n for n in want)
    for stage, world, ep, pp in [(1, 2, 1, 1), (3, 4, 4, 1), (0, 4, 2, 2), (1, 2, 1, 2)]:
        got = _pipelined_or_whole(stage, world, ep, pp, str(tmp_path), save_first=False)
        assert got.keys() == want.keys(), (stage, world, ep, pp)
        assert [n for n in want if not torch.equal(got[n], want[n])] == [], (stage, world, ep, pp)
