"""`ruvllm serve MODEL --replicas N`: engines as Ray Serve replicas behind our own
front door (docs/design.md section 16, docs/scale-out.md).

Only `ruvllm serve --replicas` imports this package's Ray modules (`client`,
`deploy`, `router`); `spec`, `model_view` and `prefix_table` import no Ray, so the
rest of ruvllm and its tests run without the `cluster` extra."""
