"""Training: the loss, MoE balancing (`routers`), the pipeline schedule, the functional step (`step`), evaluation,
metrics, checkpoints (`checkpoint`, with its manifest, preemption and fault points) and the loop a CLI run executes
(`loop`)."""
