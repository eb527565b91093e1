"""Pipeline models: the layers of a `PipelineModule` and how they are cut into stages
(`specs/mesh.md` §Pipeline); the schedules that run them are in `fnzero/pipeline/`.

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""
