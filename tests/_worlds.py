"""Training runs shared by the equivalence tests: the fnzero step on any world (simulated, spawned
or single), and an independent plain-torch reference (torch.optim.AdamW, loss.backward,
clip_grad_norm_), both fed the same global batches."""

from __future__ import annotations

import copy
import threading
import warnings

import torch
import torch.nn.functional as F

import fnzero
from fnzero.testing import GPT, MLP, GPTConfig, gpt_layers, seeded

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


_INIT_LOCK = threading.Lock()  # simulated ranks are threads sharing torch's global RNG


def make_model(kind: str, dtype=torch.float64, seed: int = 0):
    with _INIT_LOCK:
        return _make_model(kind, dtype, seed)


def _make_model(kind, dtype, seed):
    torch.manual_seed(seed)
    if kind == "gpt":
        model = GPT(vocab_size=37, seq_len=8, d_model=12, n_layer=2, n_head=3)
    elif kind == "gpt_tied":
        model = GPT(vocab_size=37, seq_len=8, d_model=12, n_layer=1, n_head=2, tied=True)
    elif kind == "gpt_tp":  # heads and widths that 2 and 4 tensor-parallel ranks divide; a vocabulary that they do not
        model = GPT(vocab_size=37, seq_len=8, d_model=16, n_layer=2, n_head=4, mlp_ratio=3)
    elif kind == "gpt_tp_tied":
        model = GPT(vocab_size=37, seq_len=8, d_model=16, n_layer=1, n_head=4, mlp_ratio=3, tied=True)
    elif kind.startswith("mlp:"):
        sizes = [int(s) for s in kind[4:].split(",")]
        model = MLP(sizes)
    elif kind == "mlp_frozen":
        model = MLP([5, 7, 3])
        model.layers[0].weight.requires_grad_(False)
    else:
        raise ValueError(kind)
    return model.to(dtype)


def in_dim(kind):
    if kind == "mlp_frozen":
        return 5, 3
    sizes = [int(s) for s in kind[4:].split(",")]
    return sizes[0], sizes[-1]


def global_batch(kind: str, step: int, world: int, k: int, micro: int, dtype):
    """Shape (k, world, micro, ...): micro-batch i of rank r is [i, r]."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind.startswith("gpt"):
        x = torch.randint(0, 37, (k, world, micro, 8), generator=g)
        y = torch.randint(0, 37, (k, world, micro, 8), generator=g)
    else:
        din, dout = in_dim(kind)
        x = torch.randn(k, world, micro, din, generator=g).to(dtype)
        y = torch.randn(k, world, micro, dout, generator=g).to(dtype)
    return x, y


def loss_of(kind, out, y):
    if kind.startswith("gpt"):
        return F.cross_entropy(out.flatten(0, -2).float() if out.dtype in (torch.float16, torch.bfloat16) else out.flatten(0, -2), y.flatten())
    return F.mse_loss(out.to(y.dtype), y)


def config(stage, k=1, micro=2, world=1, clip=1.0, precision="fp32", extra=None):
    c = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": k,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision == "fp16":
        c["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    if extra:
        c.update(extra)
    return fnzero.load_config(c, world_size=world)


def train_fnzero(kind, stage, steps, comm, *, k=1, micro=2, clip=1.0, dtype=torch.float64, precision="fp32",
                 donate=False, extra=None, return_state=False, jit=None):
    world, rank = comm.world_size, comm.rank
    cfg = config(stage, k, micro, world, clip, precision, extra)
    tp = cfg.tensor_parallel.size  # the ranks of one tensor-parallel group share their data
    world, rank = world // tp, rank // tp
    model = make_model(kind, dtype)
    if precision != "fp32":
        model = model.float()
    sm = fnzero.shard(model, config=cfg, comm=comm)
    state = sm.init_state()

    def loss_fn(params, batch):
        x, y = batch
        out = sm.apply(params, x)
        if sm.tp is not None and sm.tp.vocab_head is not None:  # logits split over the vocabulary
            return sm.cross_entropy(out, y)
        return loss_of(kind, out, y)

    step = fnzero.train_step(loss_fn, cfg, donate=donate)
    if jit is not None:  # torch.compile options for fnzero.jit
        step = fnzero.jit(step, **jit)
    losses, metrics = [], []
    for s in range(steps):
        x, y = global_batch(kind, s, world, k, micro, dtype if precision == "fp32" else torch.float32)
        xb, yb = x[:, rank].flatten(0, 1), y[:, rank].flatten(0, 1)
        state, m = step(state, (xb, yb))
        losses.append(m["loss"])
        metrics.append(m)
    params = sm.gather(state)
    out = {"losses": losses, "params": params, "metrics": metrics}
    if jit is not None:
        out["graph_breaks"] = step.graph_breaks
    if return_state:
        out["state"] = state
        out["sm"] = sm
    return out


def train_reference(kind, steps, world, *, k=1, micro=2, clip=1.0, dtype=torch.float64):
    model = make_model(kind, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for s in range(steps):
        x, y = global_batch(kind, s, world, k, micro, dtype)
        opt.zero_grad()
        total = 0.0
        for i in range(k):
            loss = loss_of(kind, model(x[i].flatten(0, 1)), y[i].flatten(0, 1))
            (loss / k).backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(total / k)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.state_dict(keep_vars=True).items() if isinstance(p, torch.nn.Parameter) or True}}


MUON = {"optimizer": {"type": "Muon", "params": {"muon_lr": 0.05, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1}}}


def spawned_equivalence(cases, steps, tp_cases=(), pp_cases=(), ep_cases=(), muon_stages=(), group_cases=(),
                        sp=False):
    """World function: run every (kind, stage, k, clip) case on this rank, then every (kind,
    stage, tp) tensor-parallel case (float64, k=2, clip 0.5: its mesh is a torch DeviceMesh over
    these processes), then every (stages, stage, schedule) pipeline case on fnzero's GPT as layers
    (float64, k=4), then every (kind, stage, ep) expert-parallel case (the MoE GPT of
    tests/test_moe_sharded.py, or a Hugging Face family of tests/test_moe_hf.py); return rank 0's view, and every rank's results of the tp, pp and ep
    cases; then Muon (float64, k=2, clip 0.5) at each of `muon_stages` (rank 0's view); with `sp`,
    tests/_sp_models.py's sequence-parallel cases last (every rank's)."""
    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    out = {}
    for kind, stage, k, clip, precision, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        r = train_fnzero(kind, stage, steps, comm, k=k, clip=clip, dtype=dtype, precision=precision)
        out[f"{kind}|{stage}|{k}|{clip}|{precision}|{dtype_name}"] = {"losses": r["losses"], "params": r["params"]}
    for kind, stage, tp in tp_cases:
        r = train_fnzero(kind, stage, steps, comm, k=2, clip=0.5, extra={"tensor_parallel": {"autotp_size": tp}})
        out[f"tp|{kind}|{stage}|{tp}|rank{comm.rank}"] = {"losses": r["losses"], "params": r["params"]}
    for stages, stage, sched, tp in pp_cases:
        extra = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else None
        layers = pipe_gpt_layers() if tp == 1 else pipe_gpt_of_model  # tp: the GPT's own AutoTP plan and names
        params, losses, _ = train_pipelined(comm, layers, lm_loss, pipe_gpt_batches(), stages, stage, 4, sched, extra)
        out[f"pp|{stages}|{stage}|{sched}|{tp}|rank{comm.rank}"] = {"losses": losses, "params": params}
    for kind, stage, ep in ep_cases:
        if kind == "moe_gpt":
            import test_moe_sharded as moe

            params = moe.train_on_rank(comm, stage, ep)
        else:  # a Hugging Face MoE family through AutoEP
            import test_moe_hf as hf

            params = hf.train_on_rank(comm, kind, stage, ep)
        out[f"ep|{kind}|{stage}|{ep}|rank{comm.rank}"] = {"params": params}
    for stage in muon_stages:
        r = train_fnzero("gpt", stage, steps, comm, k=2, clip=0.5, extra=MUON)
        out[f"muon|{stage}"] = {"losses": r["losses"], "params": r["params"]}
    for kind, stage, key, size in group_cases:  # MiCS and hpZ groups (specs/mesh.md §MiCS, specs/mesh.md §hpZ) over real gloo groups
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, key: size}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`zero_optimization.mics_shard_size` turns on MiCS")
            r = train_fnzero(kind, stage, steps, comm, k=2, clip=0.5, extra={"zero_optimization": zero})
        out[f"zg|{kind}|{stage}|{key}|{size}"] = {"params": r["params"]}
    if sp:  # last: it compiles units (jit), which nothing before it should share a dynamo cache with
        import _sp_models

        out[f"sp|rank{comm.rank}"] = _sp_models.spawned_sp_cases()
    if comm.rank == 0:
        return out
    return {key: v for key, v in out.items() if key.startswith(("tp|", "pp|", "ep|", "sp|"))}


def without_key_bias(params: dict) -> dict:
    """`params` with the key third of each fused `qkv.bias` left out. Its gradient is zero in exact
    arithmetic (softmax does not change when one number is added to all of a query's scores), so
    Adam moves it by the sign of rounding noise, about lr per step: two paths whose fp16 roundings
    differ (torch's AVX512 kernels against its AVX2 ones, offload against in memory) disagree there
    and nowhere else. Compare the rest; the losses still see every parameter."""
    out = {}
    for name, t in params.items():
        if name.endswith("qkv.bias"):
            third = t.numel() // 3
            t = torch.cat([t[:third], t[2 * third:]])
        out[name] = t
    return out


def assert_close_tree(got: dict, want: dict, rtol: float, atol: float = 0.0, what=""):
    assert set(got) >= {n for n in want if n in got}, (set(got), set(want))
    for name in want:
        if name not in got:
            continue
        g, w = got[name], want[name]
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        diff = (g.to(torch.float64) - w.to(torch.float64)).abs()
        scale = w.to(torch.float64).abs()
        bad = diff > atol + rtol * scale
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            raise AssertionError(
                f"{what} {name}: {int(bad.sum())} elements differ; first at flat index {i}: "
                f"got {g.flatten()[i].item()!r}, want {w.flatten()[i].item()!r} (max abs diff {diff.max().item():.3e})"
            )


def spawned_donate_matches_pure():
    """World function: at stages 1-2 the donated step gathers new parameters into the input's own
    buffers; it must equal the pure step exactly. Returns the largest difference per case."""
    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    out = {}
    for stage in (1, 2):
        for prec, dtype in (("fp32", torch.float64), ("bf16", torch.float32)):
            a = train_fnzero("gpt", stage, 3, comm, k=2, dtype=dtype, precision=prec, donate=False)
            b = train_fnzero("gpt", stage, 3, comm, k=2, dtype=dtype, precision=prec, donate=True)
            out[f"{stage}|{prec}"] = max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])
    return out


def spawned_jit_matches_eager(backend, steps, scope="loss", stages=(0, 1, 2, 3), extra=None):
    """World function: compiled and eager steps at each stage on this rank; returns rank 0's
    largest parameter and loss differences and the graph breaks per stage."""
    return spawned_jit_runs([(stage, backend, scope, stage, extra) for stage in stages], steps)


def spawned_jit_runs(runs, steps):
    """World function: like `spawned_jit_matches_eager`, for any mix of cases in one world (a world
    costs seconds to start). `runs` is a list of (key, backend, scope, stage, extra); dynamo is
    reset where the backend or scope changes, as a fresh world would have it. Returns rank 0's
    {key: largest parameter and loss differences, graph breaks}."""
    import torch._dynamo

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    out, last = {}, None
    for key, backend, scope, stage, extra in runs:
        if last is not None and (backend, scope) != last:
            torch._dynamo.reset()
        last = (backend, scope)
        a = train_fnzero("gpt", stage, steps, comm, k=2, extra=extra)
        b = train_fnzero("gpt", stage, steps, comm, k=2, extra=extra, jit={"backend": backend, "scope": scope})
        out[key] = {
            "param": max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"]),
            "loss": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
            "breaks": b["graph_breaks"],
        }
    return out if comm.rank == 0 else None


# --- pipeline parallelism (tests/test_pipeline.py, and the gloo worlds of test_zero_multiprocess) ---

PIPE_GPT = GPTConfig(vocab_size=37, seq_len=8, d_model=16, n_layer=3, n_head=2)


def pipe_gpt_layers():
    with seeded(0):
        return [layer.double() for layer in gpt_layers(PIPE_GPT)]


def pipe_gpt_of_model():
    """The same GPT's pipeline, cut from a GPT model so it keeps the model's names (and AutoTP plan)."""
    from fnzero.pipeline import PipelineModule

    with seeded(0):
        model = GPT(PIPE_GPT).double()
    return PipelineModule(gpt_layers(model=model), lm_loss, names_from=model)


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def pipe_gpt_batches(steps=3):
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, PIPE_GPT.vocab_size, (8, PIPE_GPT.seq_len + 1), generator=g) for _ in range(steps)]
    return [(b[:, :-1], b[:, 1:]) for b in data]


def pipe_config(dp: int, stages: int, stage: int, k: int, extra=None):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 8 // (dp * k), "gradient_accumulation_steps": k, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage}, "pipeline": {"stages": stages}, **(extra or {}),
    }, world_size=dp * stages * (extra or {}).get("tensor_parallel", {}).get("autotp_size", 1))


def train_pipe_reference(layers, loss_fn, batches, k):
    """Plain torch: the whole model, AdamW, micro-batch accumulation, clip 0.5, in one process."""
    model = torch.nn.Sequential(*copy.deepcopy(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(k), y.chunk(k)):
            loss = loss_fn(model(xs), ys) / k
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(total)
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def train_pipelined(comm, layers, loss_fn, batches, stages, zero, k, sched, extra=None, method="parameters",
                    virtual=1):
    """One rank of a pipelined run over `comm`: (this stage's consolidated parameters, losses, sm).
    Data-parallel replica d takes rows [d * per, (d + 1) * per) of each batch. `layers` may be a
    zero-argument factory of the PipelineModule instead."""
    from fnzero.pipeline import PipelineModule
    from fnzero.sharding import MeshShape

    tp = (extra or {}).get("tensor_parallel", {}).get("autotp_size", 1)
    dp = comm.world_size // (stages * tp)
    cfg = pipe_config(dp, stages, zero, k, extra)
    pipe = layers() if callable(layers) else PipelineModule(copy.deepcopy(layers), loss_fn, partition_method=method,
                                                            virtual_stages=virtual)
    sm = fnzero.shard(pipe, config=cfg, comm=comm)
    state = sm.init_state()
    step = fnzero.train_step(fnzero.pipeline_loss(sm, sched), cfg)
    d = MeshShape(dp=dp, tp=tp, pp=stages).coords(comm.rank)["dp"]
    losses = []
    for x, y in batches:
        per = x.shape[0] // dp
        state, m = step(state, (x[d * per:(d + 1) * per], y[d * per:(d + 1) * per]))
        losses.append(m["loss"])
    return sm.gather(state), losses, sm


def hf_model(kind: str, layers: int = 2):
    """A small float64 Hugging Face causal LM built from a config (nothing downloaded): "gpt2"
    (Conv1D, fused q|k|v, tied head), "llama" (GQA, untied) or "llama_tied"; vocabulary 51."""
    import transformers

    with seeded(0):
        if kind == "gpt2":
            c = transformers.GPT2Config(vocab_size=51, n_positions=16, n_embd=16, n_layer=layers, n_head=4, resid_pdrop=0,
                                        embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
            return transformers.GPT2LMHeadModel(c).double()
        c = transformers.LlamaConfig(vocab_size=51, hidden_size=16, intermediate_size=22, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     tie_word_embeddings=kind == "llama_tied", bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)  # fmt: skip
        return transformers.LlamaForCausalLM(c).double()
