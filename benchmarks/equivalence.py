"""Bit-for-bit digests of training runs, to prove that a refactor changes no result.

Not a timing: each case trains a few float64 (or mixed-precision) steps and is reduced to a
SHA-256 of its losses, gradient norms and consolidated parameters, exactly, bit for bit. Record
before a change, check after it:

    python benchmarks/equivalence.py --out before.json            # on the old code
    python benchmarks/equivalence.py --check before.json          # on the new code

The matrix: ZeRO stages 0-3 at worlds 1, 2 and 4 on real gloo ranks (float64, float32, bf16,
fp16 with loss scaling), tensor, pipeline and expert parallelism, Muon, MiCS and hpZ (the cases
of tests/test_zero_multiprocess.py); then, on simulated worlds, offload to cpu and NVMe, the
1-bit optimizers, ZeRO++'s quantized weights and gradients, other optimizers and a chain,
donation, and `fnzero.jit` at its scopes. Exit status 1 when a checked digest differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import tempfile
import time
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import _worlds as W  # noqa: E402  (the tests' own models, batches and world functions)
import test_zero_multiprocess as Z  # noqa: E402

import fnzero  # noqa: E402
from fnzero.testing import run_world, simulated_world  # noqa: E402

STEPS = 4


def digest(obj) -> str:
    """SHA-256 of a result, bit for bit: tensors by dtype, shape and bytes, floats by their hex."""
    h = hashlib.sha256()

    def feed(x, path):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                feed(x[k], f"{path}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                feed(v, f"{path}[{i}]")
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, float):
            h.update(f"{path}:{x.hex()}".encode())
        elif isinstance(x, (int, bool, str)) or x is None:
            h.update(f"{path}:{x!r}".encode())
        else:
            raise TypeError(f"{path}: {type(x).__name__}")

    feed(obj, "")
    return h.hexdigest()[:16]


def _run_summary(out: dict) -> dict:
    metrics = [{"loss": m["loss"], "grad_norm": m["grad_norm"], "skipped": m["skipped"]} for m in out["metrics"]]
    return {"params": out["params"], "metrics": metrics}


# -- real gloo worlds ---------------------------------------------------------------------------

def gloo_cases(world: int) -> dict[str, str]:
    cases = Z.F64_CASES + Z.F32_CASES + Z.MIXED_CASES
    ranks = run_world(W.spawned_equivalence, world, cases, STEPS, Z.TP_CASES[world], Z.PP_CASES[world],
                      Z.EP_CASES[world], Z.MUON_STAGES[world], Z.GROUP_CASES[world], timeout=900)
    out = {}
    for r, res in enumerate(ranks):
        for key, v in res.items():
            out[f"gloo{world}|{key}" + ("" if "rank" in key else f"|rank{r}")] = digest(v)
    jit = run_world(spawned_jit_digests, world, timeout=900)
    for r, res in enumerate(jit):
        for key, v in res.items():
            out[f"gloo{world}|jit|{key}|rank{r}"] = v
    return out


def spawned_jit_digests() -> dict[str, str]:
    """World function: `fnzero.jit` at its scopes on real ranks (the whole-step graph needs a
    torch.distributed process group), digested on each rank."""
    import torch._dynamo

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    out = {}
    for scope in ("step", "loss"):
        torch._dynamo.reset()
        for stage in (0, 1, 2, 3):
            r = W.train_fnzero("gpt", stage, STEPS, comm, k=2, clip=0.5, jit={"backend": "aot_eager", "scope": scope})
            out[f"{scope}|z{stage}"] = digest(_run_summary(r))
    return out


# -- simulated worlds ---------------------------------------------------------------------------

def _sim(world: int, stage: int, extra: dict | None = None, kind: str = "gpt", **kw) -> list[str]:
    def rank(comm):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return digest(_run_summary(W.train_fnzero(kind, stage, STEPS, comm, k=2, clip=0.5, extra=extra, **kw)))

    return simulated_world(world).run(rank)


def _zero(stage: int, **keys) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **keys}}


def _optimizer(kind: str, **params) -> dict:
    return {"optimizer": {"type": kind, "params": params}}


def simulated_cases(tmp: pathlib.Path) -> dict[str, str]:
    cases: dict[str, tuple] = {}
    # The host's C kernels run in float32 (the offloaded master weights' dtype).
    f32 = {"dtype": torch.float32}
    for stage in (1, 2, 3):
        cases[f"offload-cpu|z{stage}"] = (2, stage, _zero(stage, offload_optimizer={"device": "cpu"}), f32)
    nvme = {"device": "nvme", "nvme_path": str(tmp / "nvme")}
    cases["offload-nvme-opt|z3"] = (2, 3, _zero(3, offload_optimizer=nvme), f32)
    cases["offload-nvme-param|z3"] = (2, 3, _zero(3, offload_optimizer={"device": "cpu"}, offload_param=nvme), f32)
    cases["offload-cpu-param|z3"] = (2, 3, _zero(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}),
                                     f32)
    for kind, params in (("OneBitAdam", {"freeze_step": 2}), ("ZeroOneAdam", {"var_freeze_step": 2}),
                         ("OneBitLamb", {"freeze_step": 2})):
        cases[f"1bit|{kind}"] = (2, 0, {**_zero(0), **_optimizer(kind, lr=1e-2, **params)})
    cases["zeropp|qw+qg|z3"] = (2, 3, _zero(3, zero_quantized_weights=True, zero_quantized_gradients=True))
    cases["zeropp|hpz|z3"] = (4, 3, _zero(3, zero_hpz_partition_size=2))
    cases["mics|z2"] = (4, 2, _zero(2, mics_shard_size=2))
    for kind, params, stages in (("Lamb", {"lr": 1e-2}, (0,)), ("Lion", {"lr": 1e-3}, (0, 3)),
                                 ("Adagrad", {"lr": 1e-2}, (0, 3)), ("SGD", {"lr": 1e-2, "momentum": 0.9}, (0, 3)),
                                 ("Adam", {"lr": 1e-2}, (0, 3))):
        for stage in stages:
            cases[f"opt|{kind}|z{stage}"] = (2, stage, {**_zero(stage), **_optimizer(kind, **params)})
    for sched in ({"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
                  {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                  "cycle_first_step_size": 2, "cycle_momentum": True}}):
        cases[f"sched|{sched['type']}|z2"] = (2, 2, {**_zero(2), "scheduler": sched})
    out = {}
    for name, (world, stage, extra, *kw) in cases.items():
        for r, d in enumerate(_sim(world, stage, extra, **(kw[0] if kw else {}))):
            out[f"sim{world}|{name}|rank{r}"] = d
    for stage in (1, 2):
        for r, d in enumerate(_sim(2, stage, _zero(stage), donate=True)):
            out[f"sim2|donate|z{stage}|rank{r}"] = d
    for stage in (0, 3):
        for r, d in enumerate(_sim(2, stage, _zero(stage), precision="fp16", dtype=torch.float32)):
            out[f"sim2|fp16|z{stage}|rank{r}"] = d
    out.update(_chain_cases())
    out.update(_hf_cases())
    return out


def _hf_cases() -> dict[str, str]:
    """Hugging Face models (their modules are what ZeRO-3 runs unit by unit), with layer
    checkpointing, and Muon with per-head orthogonalisation (which needs the model's heads)."""
    muon_heads = _optimizer("Muon", muon_lr=0.05, adam_lr=0.01, momentum=0.9, per_head_muon=True)
    cases = {f"hf|{kind}|z{stage}{'|ckpt' if ckpt else ''}": (kind, stage, ckpt, {})
             for kind in ("gpt2", "llama") for stage in (0, 3) for ckpt in (False, True)}
    cases["hf|llama|muon-heads|z2"] = ("llama", 2, False, muon_heads)
    out = {}
    for name, (kind, stage, ckpt, extra) in cases.items():
        def rank(comm, kind=kind, stage=stage, ckpt=ckpt, extra=extra):
            cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                      "gradient_clipping": 0.5, **_optimizer("AdamW", lr=1e-2, weight_decay=0.1),
                                      **_zero(stage), **extra}, world_size=comm.world_size)
            with W._INIT_LOCK:  # transformers' lazy imports are not thread-safe
                model = W.hf_model(kind)
            if ckpt:
                model.activation_checkpointing_enable()
            sm = fnzero.shard(model, config=cfg, comm=comm)
            state = sm.init_state()

            def loss_fn(params, b):
                logits = sm.apply(params, input_ids=b).logits
                return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 51), b[:, 1:].reshape(-1))

            step = fnzero.train_step(loss_fn, cfg)
            data = torch.randint(0, 51, (STEPS, comm.world_size, 4, 9), generator=torch.Generator().manual_seed(1))
            metrics = []
            for s in range(STEPS):
                state, m = step(state, data[s, comm.rank])
                metrics.append(m)
            return digest(_run_summary({"params": sm.gather(state), "metrics": metrics}))

        for r, d in enumerate(simulated_world(2).run(rank)):
            out[f"sim2|{name}|rank{r}"] = d
    return out


def _chain_cases() -> dict[str, str]:
    """A chain of gradient transformations given as `optimizer=`, eager and as one graph."""
    from fnzero import optim

    out = {}
    for stage in (0, 2):
        def rank(comm, stage=stage):
            cfg = W.config(stage, k=2, world=comm.world_size, clip=0.5)
            model = W.make_model("gpt")
            sm = fnzero.shard(model, config=cfg, comm=comm)
            chain = optim.chain(optim.scale_by_adam(b1=0.9, b2=0.99, eps=1e-8), optim.add_decayed_weights(0.1),
                                optim.scale_by_learning_rate(1e-2))
            state = sm.init_state(optimizer=chain)

            def loss_fn(params, batch):
                x, y = batch
                return W.loss_of("gpt", sm.apply(params, x), y)

            step = fnzero.train_step(loss_fn, cfg, optimizer=chain)
            metrics = []
            for s in range(STEPS):
                x, y = W.global_batch("gpt", s, comm.world_size, 2, 2, torch.float64)
                state, m = step(state, (x[:, comm.rank].flatten(0, 1), y[:, comm.rank].flatten(0, 1)))
                metrics.append(m)
            return digest(_run_summary({"params": sm.gather(state), "metrics": metrics}))

        for r, d in enumerate(simulated_world(2).run(rank)):
            out[f"sim2|chain|z{stage}|rank{r}"] = d
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the digests to this JSON file")
    p.add_argument("--check", help="compare with the digests in this JSON file")
    p.add_argument("--worlds", default="1,2,4", help="gloo world sizes (default 1,2,4)")
    p.add_argument("--only", choices=("gloo", "sim"), help="run one half of the matrix")
    args = p.parse_args()
    t0 = time.perf_counter()
    got: dict[str, str] = {}
    if args.only != "sim":
        for world in (int(w) for w in args.worlds.split(",")):
            got.update(gloo_cases(world))
            print(f"gloo world {world}: {len(got)} digests, {time.perf_counter() - t0:.0f} s", flush=True)
    if args.only != "gloo":
        with tempfile.TemporaryDirectory() as tmp:
            got.update(simulated_cases(pathlib.Path(tmp)))
        print(f"simulated: {len(got)} digests, {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    if not args.check:
        return 0
    want = json.loads(pathlib.Path(args.check).read_text())
    differ = sorted(k for k in got if k in want and got[k] != want[k])
    missing = sorted(k for k in want if k not in got)
    for k in differ:
        print(f"DIFFERS  {k}")
    print(f"{len(got) - len(differ)} of {len(got)} digests equal; {len(differ)} differ; "
          f"{len(missing)} recorded cases not run")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
