"""RL objectives and the learner: advantage estimators and policy losses (registries, in
`advantages` and `losses`), the training batch (`batch`), the jitted update (`update`) and
the supervised warm-start (`sft`)."""
