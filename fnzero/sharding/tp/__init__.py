"""Tensor parallelism: which layers are split and how (AutoTP plans, the layout), the split
layers, and the differentiable collectives they use (`specs/mesh.md`).

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""
