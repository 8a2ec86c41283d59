"""A run's settings checked at start-up, before anything compiles: the whole run
(`checks.validate`, with the device count `validate_for_devices`), LoRA's and a split
run's rules, and what a resume may change (`resume`)."""
