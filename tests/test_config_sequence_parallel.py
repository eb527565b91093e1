"""`sequence_parallel_size` (alias `sp_size`) and what it changes in the config (specs/config.md §Top level,
§Batch triad): the data-parallel world the batch triad counts, and the gradient reduction dtype.

DeepSpeed 0.19.8, read at its source (deepspeed/): runtime/config.py `DeepSpeedConfig.__init__` counts
`world / config["sequence_parallel_size"]` ranks in the triad when it has no mpu; runtime/engine.py, with a
sequence-parallel world > 1, sets `self.communication_data_type = self._config.seq_parallel_communication_data_type`,
the dtype its gradient all-reduce and ZeRO's reduce use, whatever `communication_data_type` says (the setter
overwrites it). DeepSpeed is not imported here.
"""

from __future__ import annotations


from fnzero.config import load_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def test_tensor_parallel_size_as_integral_float_counts_too():
    # autotp_size 2.0 validates as 2, so the triad must divide by 2 as well.
    cfg = load_config({**BASE, "tensor_parallel": {"autotp_size": 2.0}}, world_size=8)
    assert (cfg.tensor_parallel.size, cfg.world_size) == (2, 4)
