"""Write DeepSpeed checkpoints, and what DeepSpeed's own engine holds, for fnzero's reader tests.

Run with an interpreter that has DeepSpeed (CPU is enough; gloo, two processes):

    python tests/scripts/deepspeed_checkpoints.py OUT s0_fp32 s2_bf16 pipe_fp32 moe_fp32 ...

Each name `s{stage}_{fp32|bf16|fp16}` (or `pipe_*`, `moe_*` (ZeRO-2), `moe0_*` (stage 0), `llama_*`: a
tiny Hugging Face Llama at ZeRO-3, its `config.json` in `NAME/hf/`) is one small model trained two steps by
one engine, saved to `OUT/NAME/` with DeepSpeed's `save_checkpoint`; every engine runs in the same
two processes (one `import deepspeed`, one process group). `OUT/NAME/expected.pt` holds the full
fp32 weights DeepSpeed's engine holds after the save (`safe_get_full_fp32_param` of every trainable
parameter, the fp32 master of the stage-0 optimizer, the gathered value of frozen ones, each under
its `named_parameters()` name) and every buffer: the oracle the consolidated export must equal bit
for bit. For the pipelines and MoE models, `OUT/NAME/moments.pt` holds Adam's full fp32 moments the
engine holds (`{name: {"exp_avg": ..., "exp_avg_sq": ...}}`), the oracle of a resume's.
`tests/test_checkpoint_deepspeed.py` runs this once per session.
"""

import os
import shutil
import sys
import tempfile

D = 8


def _mlp(torch):
    class Net(torch.nn.Module):
        """Odd sizes (partitions that do not divide), a tied weight, a frozen layer and two buffers."""

        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Linear(D, D, bias=False)
            self.frozen = torch.nn.Linear(D, D)
            self.frozen.requires_grad_(False)
            self.l1 = torch.nn.Linear(D, 7)
            self.l2 = torch.nn.Linear(7, D)
            self.head = torch.nn.Linear(D, D, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("step_buf", torch.arange(3, dtype=torch.float32))
            self.register_buffer("count", torch.tensor([7], dtype=torch.int64))

        def forward(self, x):
            h = self.frozen(self.emb(x))
            return self.head(self.l2(torch.relu(self.l1(h))))

    return Net()


def _pipe(torch):
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(torch.nn.Linear, D, D), LayerSpec(torch.nn.ReLU), LayerSpec(torch.nn.Linear, D, 5),
              LayerSpec(torch.nn.Linear, 5, D)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")


def _moe(torch):
    from deepspeed.moe.layer import MoE

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(D, D)
            self.moe = MoE(hidden_size=D, expert=torch.nn.Linear(D, D), num_experts=4, ep_size=2, k=1,
                           use_residual=False, min_capacity=1)
            self.out = torch.nn.Linear(D, D)

        def forward(self, x):
            h, _, _ = self.moe(self.inp(x))
            return self.out(h)

    return M()


def _llama(torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _persistent_buffers(module) -> dict:
    out = {}
    for prefix, m in module.named_modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out[f"{prefix}.{n}" if prefix else n] = b.detach().clone()
    return out


def _config(stage: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10}},
           "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":  # dynamic loss scaling: the files then hold a DynamicLossScaler
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if stage == 3:  # so that even these tiny parameters are partitioned
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    return cfg


def _full_fp32(deepspeed, torch, eng, p):
    """What the engine holds as `p`'s full fp32 value (a collective at ZeRO-1..3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    if not p.requires_grad:
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            return p.detach().clone().float()
    full = safe_get_full_fp32_param(p)
    if full is not None:
        return full.detach().clone().float()
    masters = getattr(eng.optimizer, "fp32_groups", None)  # stage 0, bf16: FP16_UnfusedOptimizer
    if masters is not None:
        for lp_group, hp_group in zip(eng.optimizer.fp16_groups, masters):
            for lp, hp in zip(lp_group, hp_group):
                if lp is p:
                    return hp.detach().clone().float()
    return p.detach().clone().float()


def _global_names(eng) -> dict:
    """A MoE layer's expert parameters under the global expert ids its expert files use (each
    rank's module numbers its own experts from 0), as DeepSpeed's `_save_moe_checkpoint` renames them."""
    import re

    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    names = {}
    for prefix, module in eng.module.named_modules():
        if isinstance(module, MoE):
            first = groups._get_expert_parallel_rank(module.expert_group_name) * module.num_local_experts
            for n, _ in module.named_parameters(prefix=prefix):
                names[n] = re.sub(r"(deepspeed_experts\.)(\d+)", lambda m: f"{m[1]}{first + int(m[2])}", n)
    return names


def _expected(deepspeed, torch, eng, dist) -> dict:
    renamed = _global_names(eng)
    out = {renamed.get(n, n): _full_fp32(deepspeed, torch, eng, p) for n, p in eng.module.named_parameters()}
    out.update(_persistent_buffers(eng.module))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)  # pipeline stages and expert ranks each hold their own part
    merged = {}
    for part in gathered:
        for n, t in part.items():
            merged.setdefault(n, t)
    return merged


def _moments(torch, eng, dist) -> dict:
    """Adam's full fp32 moments of every trainable parameter as DeepSpeed's engine holds them
    (`safe_get_full_optimizer_state`, a collective over the parameter's data-parallel group; the
    torch optimizer's own state where DeepSpeed keeps no partitions), under the names `_expected` uses."""
    from deepspeed.utils import safe_get_full_optimizer_state

    renamed, out = _global_names(eng), {}
    if hasattr(eng.optimizer, "_hp_optimizer_states_linked"):
        # ZeRO-1/2 link each parameter to its moments once, after the first optimizer step; MoE
        # groups step one at a time, so the expert group was linked before it had moments: link again.
        eng.optimizer._hp_optimizer_states_linked = False
        eng.optimizer._lazy_init_hp_params_optimizer_state()
    for n, p in eng.module.named_parameters():
        if p.requires_grad:
            got = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
            out[renamed.get(n, n)] = {k: (v if v is not None else eng.optimizer.state[p][k]).detach().clone().float()
                                      for k, v in got.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {n: m for part in gathered for n, m in part.items()}


def _one(name: str, out: str, rank: int, deepspeed, torch, dist) -> None:
    kind, prec = name.split("_")
    stage = int(kind[1:]) if kind.startswith("s") else {"moe": 2, "llama": 3}.get(kind, 0)  # (moe0: MoE at stage 0)
    kind = "moe" if kind == "moe0" else kind
    torch.manual_seed(0)
    model = {"pipe": _pipe, "moe": _moe, "llama": _llama}.get(kind, _mlp)(torch)
    params = [p for p in model.parameters()]
    if kind == "moe":
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=_config(stage, prec))
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec, torch.float32)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        x, y = torch.randn(2, D, generator=g).to(dt), torch.randn(2, D, generator=g).to(dt)
        if kind == "pipe":
            eng.train_batch(data_iter=iter([(x, y)]))
        elif kind == "llama":
            ids = torch.randint(0, 64, (2, 8), generator=g)
            eng.backward(eng(input_ids=ids, labels=ids).loss)
            eng.step()
        else:
            eng.backward(torch.nn.functional.mse_loss(eng(x), y))
            eng.step()
    eng.save_checkpoint(os.path.join(out, name))
    if kind == "llama" and rank == 0:  # what the Trainer's save_model writes beside it
        model.config.save_pretrained(os.path.join(out, name, "hf"))
    expected = _expected(deepspeed, torch, eng, dist)
    moments = _moments(torch, eng, dist) if kind in ("pipe", "moe") else None
    if rank == 0:
        torch.save(expected, os.path.join(out, name, "expected.pt"))
        if moments is not None:
            torch.save(moments, os.path.join(out, name, "moments.pt"))
    dist.barrier()


def _worker(rank: int, world: int, store: str, out: str, names: list) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    # TorchBackend.__init__ would JIT-build a shared-memory C++ op (a minute of g++, and a wait
    # forever on a stale lock file); gloo does not need it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    # The ranks meet through a file store, not a TCP port: a port picked free (bind port 0, close)
    # can be taken by another process before rank 0 binds it again ("address already in use").
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"file://{store}", rank=rank, world_size=world)
    import torch.distributed as dist

    for name in names:
        _one(name, out, rank, deepspeed, torch, dist)


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="ds_store_")
    try:  # the store file must not exist yet: the ranks create it
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), out, names), nprocs=2, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
