"""Communication: the `Collectives` interface and its gloo/NCCL, direct, functional, observed and
simulated forms; the process group (`init_distributed`), the collective watchdog, the device mesh.

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""
