"""The layout as data, before any process starts: the mesh (`mesh`), PartitionSpecs and their placements (`spec`),
rules (`rules`), tensor-parallel styles (`tensor_parallel`), the plan halves of pipeline, context and expert
parallelism and of FSDP (`pipeline`, `context`, `experts`, `fsdp`), and the plan itself (`plan`, `plan_config`,
`plan_text`).

Pure data: nothing here starts a process group or allocates memory; a plan is built from a model on the meta device.
"""
