"""The search: space schema (:mod:`.space`), optimizers (:mod:`.optimizers`), Pareto front (:mod:`.pareto`)."""
