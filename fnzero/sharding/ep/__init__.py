"""Expert parallelism: a model's experts split over the mesh's `ep` ranks, tokens sent to their
experts and back by all-to-all (`specs/mesh.md §Expert parallelism`).

Layer 3 of `specs/architecture.md`; the order of the sub-packages is written there."""
