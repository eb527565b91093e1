"""Run by a DeepSpeed interpreter (with transformers and accelerate), not fnzero's: a Hugging Face
Trainer fine-tunes a tiny Llama under DeepSpeed on 2 CPU ranks (gloo) and saves `OUT/checkpoint-3/`
as every Trainer user's job does (`global_step3/`, `trainer_state.json`, `model.safetensors`, ...).
`python hf_trainer_checkpoint.py OUT STAGE`. The ranks meet through a file store, not a port.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def llama():
    """The model the test rebuilds on its side (same seed, same config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _worker(rank: int, out: str, stage: int, store: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true")
    import deepspeed
    import deepspeed.comm.torch

    # On CPU DeepSpeed JIT-builds a shared-memory op on init (a minute, or a hang on a stale lock); gloo needs none.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"file://{store}", rank=rank, world_size=2)
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in (torch.randint(0, 64, (16,), generator=g)
                                                                   for _ in range(32))]
    auto = "auto"
    ds = {"train_micro_batch_size_per_gpu": auto, "gradient_accumulation_steps": auto, "train_batch_size": auto,
          "gradient_clipping": auto,
          "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
          "optimizer": {"type": "AdamW", "params": {"lr": auto, "betas": auto, "eps": auto, "weight_decay": auto,
                                                    "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": auto, "warmup_max_lr": auto,
                                                       "warmup_num_steps": auto}}}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                             save_steps=3, learning_rate=1e-3, warmup_steps=2, logging_steps=1, report_to=[],
                             deepspeed=ds, use_cpu=True, ddp_backend="gloo", seed=0, disable_tqdm=True)
    Trainer(model=llama(), args=args, train_dataset=data).train()


if __name__ == "__main__":
    out, stage = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="fnzero-trainer-") as tmp:
        mp.spawn(_worker, args=(out, stage, os.path.join(tmp, "store")), nprocs=2, join=True)
